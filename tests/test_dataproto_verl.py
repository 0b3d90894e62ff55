"""verl's wider `DataProto` surface against a per-row reference: each expected batch is built row by row from the
input rows (jagged fields, dense fields and object columns), never by the code under test. Also here: the gather
over two real gloo processes (`all_gather_data_proto`) and `DataProtoFuture` on the test session's local Ray, and
what code written against `verl.protocol` meets: its names, list columns, None arguments, verl's `collate_fn`, the
module-level helpers and the `meta_info` merge of `concat`.
"""
import pickle

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from tensordict import NonTensorData, NonTensorStack, TensorDict

from xtoken_dp.batch import (AUTO_PADDING_KEY, DataProto, DataProtoConfig, DataProtoFuture, all_gather_data_proto,
                             all_gather_probe_worker, collate_fn, deserialize_single_tensor, deserialize_tensordict,
                             fold_batch_dim, list_of_dict_to_dict_of_list, pad_dataproto_to_divisor, ray_put,
                             serialize_single_tensor, serialize_tensordict, unfold_batch_dim, union_numpy_dict,
                             union_tensor_dict, unpad_dataproto)
from batch_helpers import rows_of
from xtoken_dp.codec import LengthsError, object_array
from xtoken_dp.schema import FieldSpec, Schema, lengths_to_offsets, make_jagged

KEYS = ("input_ids", "logprobs", "mask", "topk", "reward", "extra", "uid")
GROUP = {"input_ids": "tok", "logprobs": "tok", "mask": "tok", "topk": "chunk"}
SCHEMA = Schema([FieldSpec("input_ids", "token", torch.int64, group="tok"),
                 FieldSpec("logprobs", "token", torch.float32, group="tok"),
                 FieldSpec("mask", "token", torch.bool, group="tok"),
                 FieldSpec("topk", "token", torch.int32, group="chunk", trailing_shape=(2,)),
                 FieldSpec("reward", "sample", torch.float32), FieldSpec("extra", "rect", torch.int64),
                 FieldSpec("uid", "object")])
EMPTY = {"input_ids": (torch.int64, ()), "logprobs": (torch.float32, ()), "mask": (torch.bool, ()),
         "topk": (torch.int32, (2,))}


# ---------------------------------------------------------------------------------------------------------- helpers
def make_rows(n: int, seed: int = 0, multiple: int = 1) -> list[dict]:
    "Reference rows: token fields of 0..6 (times `multiple`) tokens, top-k chunks, a reward, an extra, a uid."
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = multiple * int(torch.randint(0, 7, (1,), generator=g))
        chunks = int(torch.randint(0, 4, (1,), generator=g))
        rows.append({"input_ids": torch.randint(0, 1000, (length,), generator=g),
                     "logprobs": -torch.rand(length, generator=g), "mask": torch.rand(length, generator=g) < 0.7,
                     "topk": torch.randint(0, 50, (chunks, 2), generator=g, dtype=torch.int32),
                     "reward": torch.rand((), generator=g), "extra": torch.arange(4) + 10 * i,
                     "uid": f"uid-{seed}-{i}"})
    return rows


def build(rows: list[dict], schema: bool = False, meta=None) -> DataProto:
    "A DataProto from reference rows: one offsets object per group, built here."
    offsets = {g: lengths_to_offsets(torch.tensor([r[k].shape[0] for r in rows], dtype=torch.int64))
               for k, g in (("input_ids", "tok"), ("topk", "chunk"))}
    leaves = {}
    for key, (dtype, trailing) in EMPTY.items():
        values = torch.cat([r[key] for r in rows]) if rows else torch.empty((0, *trailing), dtype=dtype)
        leaves[key] = make_jagged(values, offsets[GROUP[key]])
    leaves["reward"] = torch.stack([r["reward"] for r in rows]) if rows else torch.empty(0)
    leaves["extra"] = torch.stack([r["extra"] for r in rows]) if rows else torch.empty(0, 4, dtype=torch.int64)
    return DataProto(TensorDict(leaves, batch_size=[len(rows)]), {"uid": object_array(r["uid"] for r in rows)},
                     {"temperature": 0.7} if meta is None else meta, schema=SCHEMA if schema else None)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray): return isinstance(b, np.ndarray) and a.tolist() == b.tolist()
    return type(a) is type(b) and a == b


def assert_rows(dp: DataProto, expected: list[dict]):
    got = rows_of(dp)
    assert len(got) == len(expected), (len(got), len(expected))
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.keys() == b.keys(), (i, a.keys(), b.keys())
        for key in a: assert same(a[key], b[key]), f"row {i} field {key}: {a[key]} != {b[key]}"


def assert_shared(dp: DataProto):
    "Every group's fields share one offsets object."
    for keys in dp.groups.values():
        assert len({id(dp.batch.get(k).offsets()) for k in keys}) == 1, keys


def only(rows, keys, rename=None):
    rename = rename or {}
    return [{rename.get(k, k): r[k] for k in keys} for r in rows]


# ------------------------------------------------------------------------------------------------ columns: pop, rename
def test_pop_moves_columns_out_and_refuses_missing_keys_atomically():
    rows = make_rows(5, seed=1)
    dp = build(rows, schema=True, meta={"temperature": 0.7, "step": 3})
    popped = dp.pop(batch_keys=["logprobs", "topk"], non_tensor_batch_keys=["uid"], meta_info_keys=["step"])
    assert_rows(popped, only(rows, ("logprobs", "topk", "uid")))
    assert_rows(dp, only(rows, ("input_ids", "mask", "reward", "extra")))
    assert popped.meta_info == {"step": 3} and dp.meta_info == {"temperature": 0.7}
    assert popped.groups == {"tok": ("logprobs",), "chunk": ("topk",)} and dp.groups == {"tok": ("input_ids", "mask")}
    assert_shared(dp)
    with pytest.raises(KeyError, match="'nope'"): dp.pop(["input_ids", "nope"])
    assert_rows(dp, only(rows, ("input_ids", "mask", "reward", "extra")))  # nothing was removed
    with pytest.raises(KeyError, match="non_tensor_batch keys"): dp.pop(non_tensor_batch_keys=["uid"])


def test_rename_keeps_rows_and_groups():
    rows = make_rows(4, seed=2)
    dp = build(rows, schema=True)
    assert dp.rename(["input_ids", "topk"], ["ids", "top"]) is dp
    assert_rows(dp, only(rows, KEYS, {"input_ids": "ids", "topk": "top"}))
    assert dp.groups == {"tok": ("ids", "logprobs", "mask"), "chunk": ("top",)} and dp.schema["top"].trailing_shape == (2,)
    assert_shared(dp)
    for bad, exc in ((("ids", ["a", "b"]), ValueError), (("nope", "a"), KeyError), (("ids", "mask"), ValueError),
                     (("ids", "uid"), ValueError), ((3, "a"), TypeError)):
        with pytest.raises(exc): dp.rename(*bad)
    assert list(dp.batch.keys())[0] == "ids"


# --------------------------------------------------------------------------------------- rows: select_idxs, slice, reorder
def test_select_idxs_slice_and_reorder_equal_reference():
    rows = make_rows(7, seed=3)
    dp = build(rows)
    mask = [True, False, True, True, False, False, True]
    assert_rows(dp.select_idxs(mask), [r for r, m in zip(rows, mask) if m])
    assert_rows(dp.select_idxs(np.array(mask)), [r for r, m in zip(rows, mask) if m])
    for idx in ([6, 0, -1, 0, 3], torch.tensor([6, 0, -1, 0, 3]), np.array([6, 0, -1, 0, 3])):
        assert_rows(dp.select_idxs(idx), [rows[i] for i in (6, 0, -1, 0, 3)])
        assert_shared(dp.select_idxs(idx))
    for start, end, step in ((None, None, None), (1, 5, None), (-3, None, None), (0, 7, 2), (None, None, -1), (5, 1, -2)):
        assert_rows(dp.slice(start, end, step), rows[slice(start, end, step)])
    with pytest.raises(IndexError): dp.select_idxs([True, False])
    with pytest.raises(IndexError): dp.select_idxs([7])
    with pytest.raises(TypeError): dp.slice(1.5)
    perm = [3, 6, 0, 1, 5, 2, 4]
    assert dp.reorder(torch.tensor(perm)) is None
    assert_rows(dp, [rows[i] for i in perm])
    assert_shared(dp)
    for bad in ([0, 0, 1, 2, 3, 4, 5], [0, 1], [0, 1, 2, 3, 4, 5, 9]):
        with pytest.raises((ValueError, IndexError)): dp.reorder(bad)
    assert_rows(dp, [rows[i] for i in perm])


# ---------------------------------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("n", [0, 1, 5, 8])
@pytest.mark.parametrize("divisor", [1, 2, 3, 8])
def test_pad_to_divisor_and_unpad_round_trip_exactly(n, divisor):
    rows = make_rows(n, seed=4)
    dp = build(rows, schema=True)
    padded, pad_size = pad_dataproto_to_divisor(dp, divisor)
    assert pad_size == -n % divisor and len(padded) % divisor == 0
    assert_rows(padded, rows + [rows[i % n] for i in range(pad_size)])
    assert (padded is dp) == (pad_size == 0)
    padded.validate()
    assert_shared(padded)
    back = unpad_dataproto(padded, pad_size)
    assert back == dp and back.meta_info == dp.meta_info
    assert len(padded.chunk(divisor)) == divisor


def test_padding_in_place_and_auto_padding_flag():
    rows = make_rows(4, seed=5)
    dp = build(rows)
    dp.padding(3)
    assert_rows(dp, rows + [rows[-1]] * 3)
    dp.padding(2, "first")
    assert_rows(dp, rows + [rows[-1]] * 3 + [rows[0]] * 2)
    assert_shared(dp)
    with pytest.raises(ValueError, match="padding_candidate"): dp.padding(1, "middle")
    with pytest.raises(ValueError, match="empty batch"): build([]).padding(1)
    with pytest.raises(ValueError, match="pad_size"): unpad_dataproto(build(rows), 5)
    flagged = DataProto.from_single_dict({"x": torch.zeros(2), "u": object_array("ab")}, {"k": 1}, True)
    assert flagged.is_padding_enabled() and flagged.meta_info == {"k": 1, AUTO_PADDING_KEY: True}
    assert not build(rows).is_padding_enabled()
    with pytest.raises(TypeError, match="auto_padding"): DataProto.from_single_dict({"x": torch.zeros(2)}, None, "yes")


# ---------------------------------------------------------------------------------------------------------- repeats
def test_repeat_and_sample_level_repeat_equal_reference():
    rows = make_rows(4, seed=6)
    dp = build(rows, schema=True)
    assert_rows(dp.repeat(3), [r for r in rows for _ in range(3)])
    assert_rows(dp.repeat(2, interleave=False), rows + rows)
    counts = [2, 0, 1, 3]
    for given in (counts, tuple(counts), np.array(counts), torch.tensor(counts, dtype=torch.int32)):
        out = dp.sample_level_repeat(given)
        assert_rows(out, [r for r, c in zip(rows, counts) for _ in range(c)])
        assert_shared(out)
    assert len(dp.sample_level_repeat([0, 0, 0, 0])) == 0
    for bad, exc in (([1, 2], ValueError), ([1, -1, 1, 1], ValueError), ([1.0, 1, 1, 1], TypeError), (2, TypeError)):
        with pytest.raises(exc): dp.sample_level_repeat(bad)


def test_unfold_column_chunks_equals_reference():
    n_split, rows = 2, make_rows(4, seed=7, multiple=2)
    for r in rows: r["pairs"] = np.array([f"{r['uid']}-a", f"{r['uid']}-b"], dtype=object)
    base = build(rows)
    dp = DataProto(base.batch, {**base.non_tensor_batch, "pairs": np.stack([r["pairs"] for r in rows])},
                   base.meta_info, schema=Schema([*SCHEMA, FieldSpec("pairs", "object")]))
    split = ["input_ids", "logprobs", "mask", "extra", "pairs"]
    out = dp.unfold_column_chunks(n_split, split)
    expected = []
    for r in rows:
        for j in range(n_split):
            part = {k: r[k] for k in ("topk", "reward", "uid")}
            for k in split:
                width = r[k].shape[0] // n_split
                part[k] = r[k][j * width:(j + 1) * width]
            expected.append(part)
    assert_rows(out, [{k: e[k] for k in KEYS + ("pairs",)} for e in expected])
    assert_shared(out)
    assert out.schema["extra"].trailing_shape is None and out.groups == {"tok": ("input_ids", "logprobs", "mask"),
                                                                         "chunk": ("topk",)}
    with pytest.raises(ValueError, match="cut together"): dp.unfold_column_chunks(2, ["input_ids"])
    with pytest.raises(ValueError, match="not a multiple of n_split=3"):
        dp.unfold_column_chunks(3, ["input_ids", "logprobs", "mask"])
    with pytest.raises(KeyError): dp.unfold_column_chunks(2, ["nope"])


def test_fold_and_unfold_batch_dim_equal_reference():
    rows = make_rows(6, seed=8)
    dp = build(rows, schema=True).select(["reward", "extra"])
    folded = fold_batch_dim(dp, 3)
    assert len(folded) == 3
    for k, row in enumerate(rows_of(folded)):
        members = rows[2 * k:2 * k + 2]
        assert same(row["reward"], torch.stack([m["reward"] for m in members]))
        assert same(row["extra"], torch.stack([m["extra"] for m in members]))
        assert row["uid"].tolist() == [m["uid"] for m in members]
    back = unfold_batch_dim(folded)
    assert back == dp
    assert_rows(back, only(rows, ("reward", "extra", "uid")))
    with pytest.raises(ValueError, match="jagged fields"): fold_batch_dim(build(rows), 3)
    with pytest.raises(ValueError, match="do not fold"): fold_batch_dim(dp, 4)


# ------------------------------------------------------------------------------------------------- one TensorDict
def test_to_tensordict_and_back_keeps_jagged_fields_objects_and_meta():
    rows = make_rows(5, seed=9)
    dp = build(rows, schema=True, meta={"temperature": 0.7, "tags": ["a", "b"]})
    td = dp.to_tensordict()
    assert isinstance(td.get("uid"), NonTensorStack) and isinstance(td.get("tags"), NonTensorData)
    assert td.get("input_ids") is dp.batch.get("input_ids")
    for i, r in enumerate(rows):
        assert td.get("uid")[i].data == r["uid"] and same(td.get("topk")[i], r["topk"])
    back = DataProto.from_tensordict(td, schema=SCHEMA)
    assert back == dp and back.meta_info == {"temperature": 0.7, "tags": ["a", "b"]}
    assert_rows(back, only(rows, KEYS))
    assert_shared(back)
    with pytest.raises(ValueError, match="given twice"): DataProto.from_tensordict(td, meta_info={"tags": 1})


# ----------------------------------------------------------------------------------------------------- inspection
def test_data_info_sizes_and_consistency():
    rows = make_rows(5, seed=10)
    dp = build(rows, schema=True)
    info = dp.get_data_info()
    tokens = sum(r["input_ids"].shape[0] for r in rows)
    assert f"  input_ids: jagged (5, j) (int64) cpu, group 'tok', {tokens} tokens" in info
    assert "  uid: ndarray(5,) (object) of str" in info and "  temperature: float" in info
    row_bytes = sum(r[k].numel() * r[k].element_size() for r in rows for k in ("input_ids", "logprobs", "mask",
                                                                               "topk", "reward", "extra"))
    assert dp.print_size() == (row_bytes + 2 * 6 * 8, 5 * 8)  # two groups' offsets, counted once each
    dp.check_consistency()
    mask = dp.batch.get("mask")
    wrong_cache = make_jagged(mask.values(), mask.offsets(), min_seqlen=0, max_seqlen=99)
    broken = DataProto(TensorDict({**dict(dp.batch.items()), "mask": wrong_cache}, batch_size=[5]))
    with pytest.raises(LengthsError, match="cached min/max seqlen"): broken.check_consistency()


# -------------------------------------------------------------------------------------- gather over two gloo processes
def test_all_gather_over_two_gloo_processes(tmp_path):
    rows = [make_rows(3, seed=11), make_rows(5, seed=12)]
    parts = [build(rows[0], schema=True, meta={"rank": 0}), build(rows[1], schema=True, meta={"rank": 1})]
    mp.spawn(all_gather_probe_worker, args=(2, f"file://{tmp_path}/rendezvous", parts, str(tmp_path)), nprocs=2,
             join=True)
    for rank in (0, 1):
        got = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        assert got["same_object"] and got["seen"] == {"type": "DataProto", "rows": 8, "groups_shared": True,
                                                      "seqlens_cached": True}
        assert_rows(got["data"], only(rows[0] + rows[1], KEYS))
        assert got["data"].meta_info == {"rank": rank} and got["data"].schema == SCHEMA
    with pytest.raises(TypeError, match="data must be a DataProto"): all_gather_data_proto([])


# -------------------------------------------------------------------------------------------------- futures over Ray
def test_data_proto_future_on_a_local_ray(ray_session):
    rows = make_rows(6, seed=13)
    dp = build(rows, schema=True)
    future = DataProtoFuture.concat([ray_put(dp[0:1]), ray_put(dp[1:4]), ray_put(dp[4:6])])
    assert_rows(future.get(), only(rows, KEYS))
    for chunks in (1, 2, 3):
        for i, part in enumerate(future.chunk(chunks)):
            size = 6 // chunks
            assert_rows(part.get(), only(rows[i * size:(i + 1) * size], KEYS))
    assert_rows(future.chunk(2)[1].chunk(3)[0].get(), only(rows[3:4], KEYS))
    with pytest.raises(ValueError, match="use split"): future.chunk(4)[0].get()
    with pytest.raises(TypeError, match="future 1 holds a dict"):
        DataProtoFuture.concat([ray_put(dp), ray_put({"x": 1})]).get()


# ------------------------------------------------------------------------------- drop-in: the names of verl.protocol
VERL_PROTOCOL_NAMES = ("DataProto", "DataProtoItem", "DataProtoConfig", "collate_fn", "union_tensor_dict",
                       "union_numpy_dict", "list_of_dict_to_dict_of_list", "serialize_single_tensor",
                       "deserialize_single_tensor", "serialize_tensordict", "deserialize_tensordict",
                       "pad_dataproto_to_divisor", "unpad_dataproto", "fold_batch_dim", "unfold_batch_dim")


def test_every_verl_protocol_name_imports_from_dataproto_and_batch():
    import xtoken_dp.batch as batch
    import xtoken_dp.columns as columns
    import xtoken_dp.dataproto as dataproto
    for name in VERL_PROTOCOL_NAMES:
        assert getattr(dataproto, name) is getattr(batch, name), name
        assert name in dataproto.__all__ and name in batch.__all__, name
    for name in ("union_tensor_dict", "union_numpy_dict", "serialize_tensordict", "tensor_equal"):
        assert getattr(dataproto, name) is getattr(columns, name)
    assert batch.DataProtoFuture and batch.all_gather_data_proto  # the Ray and torch.distributed parts live in batch


def test_from_dict_takes_list_columns_as_numpy_makes_them_and_leaves_the_callers_dicts():
    labels, scores, pairs = ["x", "y", "z"], [[], [0.5, 0.8], [0.9]], [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]
    given = {"labels": labels, "scores": scores, "pairs": pairs, "info": ({"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0})}
    dp = DataProto.from_dict({"obs": torch.arange(3)}, given, {"step": 1})
    cols = dp.non_tensor_batch
    assert all(v.dtype == object for v in cols.values())
    assert {k: v.shape for k, v in cols.items()} == {"labels": (3,), "scores": (3,), "pairs": (3, 2), "info": (3,)}
    assert cols["scores"][1] == [0.5, 0.8] and cols["pairs"][2].tolist() == ["c1", "c2"] and cols["info"][1] == {"acc": 0.0}
    assert given["labels"] is labels and isinstance(given["pairs"], list)  # verl would have replaced them in place
    row = dp[1]
    assert row.non_tensor_batch["pairs"].tolist() == ["b1", "b2"] and row.non_tensor_batch["scores"] == [0.5, 0.8]
    again = DataProto.concat(dp.chunk(3))
    assert again == dp and again.non_tensor_batch["pairs"].shape == (3, 2)
    back = DataProto.from_tensordict(dp.to_tensordict())
    assert back.non_tensor_batch["scores"].tolist() == scores and back.meta_info == {"step": 1}
    with pytest.raises(TypeError, match=r"non_tensors\['s'\] must be a np.ndarray, list or tuple"):
        DataProto.from_dict(non_tensors={"s": torch.arange(3)})
    with pytest.raises(ValueError, match="expected N=3"): DataProto.from_dict({"obs": torch.arange(3)}, {"s": [1, 2]})
    with pytest.raises(TypeError, match="must be a np.ndarray"): DataProto(non_tensor_batch={"s": ["a"]})


def test_none_arguments_mean_empty_as_in_verl():
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info={"k": 1})) == 0
    empty = DataProto(None, None, None)
    assert (empty.batch, empty.non_tensor_batch, empty.meta_info) == (None, {}, {})
    only_columns = DataProto.from_dict(non_tensors={"labels": ["a", "b"]}, meta_info={"k": 1})
    assert only_columns.batch is None and len(only_columns) == 2 and only_columns.meta_info == {"k": 1}
    assert DataProto.from_dict(tensors=None).batch is None
    dp = DataProto.from_dict({"obs": torch.zeros(4, 2)}, None, None, 1, True)  # verl's positional order
    assert dp.meta_info == {AUTO_PADDING_KEY: True} and dp.batch.batch_size == torch.Size([4])
    for dims in (0, 2, 3):
        with pytest.raises(ValueError, match="num_batch_dims"): DataProto.from_dict({"obs": torch.zeros(4, 2)}, num_batch_dims=dims)


def test_concat_merges_meta_info_as_verl_and_refuses_conflicts():
    rows = make_rows(6, seed=14)
    parts = [build(rows[:2], meta={"metrics": [{"loss": 0.5, "acc": 0.9}], "flag": True, "a": 1}),
             build(rows[2:4], meta={"flag": True, "b": 2, "metrics": None}),
             build(rows[4:], meta={"metrics": {"loss": 0.6, "acc": 0.8}, "flag": True})]
    joined = DataProto.concat(parts)
    assert joined.meta_info == {"metrics": {"loss": [0.5, 0.6], "acc": [0.9, 0.8]}, "flag": True, "a": 1, "b": 2}
    assert_rows(joined, rows)
    assert all(p.meta_info.get("metrics", 0) != joined.meta_info["metrics"] for p in parts)  # parts untouched
    with pytest.raises(ValueError, match="meta_info key 'flag' differs"):
        DataProto.concat([parts[0], build(rows[2:3], meta={"flag": False})])
    with pytest.raises(ValueError, match="meta_info key 'x' differs"):
        DataProto.concat([build(rows[:1], meta={"x": np.array([1.0, np.nan])}), build(rows[1:2], meta={"x": np.array([1.0, 2.0])})])
    same_nan = {"x": np.array([1.0, np.nan])}
    assert DataProto.concat([build(rows[:1], meta=same_nan), build(rows[1:2], meta={"x": same_nan["x"].copy()})]).meta_info.keys() == {"x"}
    with pytest.raises(TypeError, match="list of dicts"): DataProto.concat([build(rows[:1], meta={"metrics": ["loss"]})])


def test_collate_fn_rebuilds_jagged_batches_from_rows():
    rows = make_rows(7, seed=15)
    dp = build(rows, schema=True, meta={"temperature": 0.7})
    loader = torch.utils.data.DataLoader(dp, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0),
                                         collate_fn=collate_fn)
    seen = []
    for part in loader:
        assert part.meta_info == {} and part.groups == {"g0": ("input_ids", "logprobs", "mask"), "g1": ("topk",)}
        assert_shared(part)
        part.validate()
        seen += rows_of(part)
    assert sorted(r["uid"] for r in seen) == sorted(r["uid"] for r in rows)
    by_uid = {r["uid"]: r for r in rows}
    for got in seen:
        for key in KEYS: assert same(got[key], by_uid[got["uid"]][key]), key
    assert_rows(collate_fn([dp[i] for i in (4, 0, 4)]), [rows[i] for i in (4, 0, 4)])
    assert collate_fn([dp[2]]).batch.get("input_ids").is_nested  # a one-row batch stays jagged


def test_helpers_round_trip_and_refuse_conflicts_atomically():
    rows = make_rows(4, seed=16)
    dp = build(rows)
    encoded = serialize_tensordict(dp.batch)
    assert encoded[0] == (4,) and encoded[2]["input_ids"][0] == "jagged" and len(encoded[2]["topk"][1]) == 4
    back = DataProto(deserialize_tensordict(pickle.loads(pickle.dumps(encoded))), dp.non_tensor_batch, dp.meta_info)
    assert_rows(back, rows)
    assert back.groups == {"g0": ("input_ids", "logprobs", "mask"), "g1": ("topk",)}  # equal lengths share offsets
    for t in (torch.randn(2, 3).to(torch.bfloat16), torch.tensor([float("nan"), -0.0]), torch.zeros(0, 5, dtype=torch.int32)):
        again = deserialize_single_tensor(serialize_single_tensor(t))
        assert again.dtype == t.dtype and again.shape == t.shape and torch.equal(again.view(torch.uint8), t.view(torch.uint8))
    left = dp.batch.select("input_ids", "reward").clone()
    with pytest.raises(ValueError, match="key 'reward'"):
        union_tensor_dict(left, TensorDict({"extra": dp.batch.get("extra"), "reward": torch.zeros(4)}, [4]))
    assert set(left.keys()) == {"input_ids", "reward"}
    assert set(union_tensor_dict(left, dp.batch.select("reward", "extra")).keys()) == {"input_ids", "reward", "extra"}
    columns = {"uid": dp.non_tensor_batch["uid"]}
    with pytest.raises(ValueError, match="key 'uid'"):
        union_numpy_dict(columns, {"new": np.arange(4), "uid": object_array("abcd")})
    assert list(columns) == ["uid"]
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3, "b": 4}]) == {"a": [1, 3], "b": [2, 4]}
    with pytest.raises(ValueError, match="dict 1 has keys"): list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3}])


def test_data_proto_config_switches_auto_padding_for_every_batch(monkeypatch):
    dp = build(make_rows(3, seed=17))
    assert not dp.is_padding_enabled() and DataProtoConfig.auto_padding_key == AUTO_PADDING_KEY
    monkeypatch.setattr(DataProtoConfig, "_auto_padding", False)
    DataProtoConfig.auto_padding = True
    assert dp.is_padding_enabled() and DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "true")
    assert dp.is_padding_enabled()
    monkeypatch.setenv("VERL_AUTO_PADDING", "0")
    assert not dp.is_padding_enabled()
    with pytest.raises(TypeError, match="auto_padding"): DataProtoConfig.auto_padding = 1
