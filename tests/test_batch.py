"""The acceptance tests of the batch containers (`xtoken_dp.batch` and the modules it gathers), with real processes,
real files and a real Ray.

The notebooks `nbs/02*_*.ipynb` (ragged, dataproto, tensorclasses, persistence, batch) assert most behaviours as
examples; this file holds every acceptance test as a pytest test named `test_<number>_...` (so each can be run
alone), plus what a notebook cannot host: the `python -O` check, a fresh-process import check, spawned `mp.Queue`
and `DataLoader` workers (fork and spawn), Ray, and hypothesis properties of the offsets kernels against a per-row
reference. Set `XTOKEN_DP_HYPOTHESIS_EXAMPLES` to run more examples (default 25). Test 30 needs CUDA and is skipped
without it. Hostile directories are in `test_batch_hostile.py`, rows that disagree in `test_batch_rows.py`.
"""
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from xtoken_dp.batch import (MANIFEST_NAME, BatchDirectoryError, DataProto, DataProtoDataset, DataProtoItem,
                             DistillBatch, RewardData, TeacherSeq, TokenSeq, collate_data_protos, ragged_cat,
                             ragged_index, ragged_repeat, ragged_slice, ray_get, ray_put, transport_probe_worker)
from batch_helpers import rows_of
from xtoken_dp.codec import materialize, object_array
from xtoken_dp.schema import AlignmentBatch, FieldSpec, Schema, is_jagged, lengths_to_offsets, make_jagged

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("XTOKEN_DP_HYPOTHESIS_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAN_PAYLOAD = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)  # a NaN with a non-default payload


# ---------------------------------------------------------------------------------------------------------- helpers
def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def same_bits(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    return type(a) is type(b) and a == b


def make_rows(n: int, seed: int = 0) -> list[dict]:
    "Per-row reference data: two token groups (ids/logprobs/mask; top-k [.., 2]), dense reward/extra, a uid string."
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length, chunks = int(torch.randint(0, 7, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
        logprobs = -torch.rand(length, generator=g)
        if length and i % 3 == 0: logprobs[0] = NAN_PAYLOAD[0]
        rows.append({"input_ids": torch.randint(0, 1000, (length,), generator=g),
                     "logprobs": logprobs, "mask": torch.rand(length, generator=g) < 0.7,
                     "topk": torch.randint(0, 50, (chunks, 2), generator=g, dtype=torch.int32),
                     "bf16": torch.randn(length, generator=g).to(torch.bfloat16),
                     "reward": torch.rand((), generator=g), "extra": torch.arange(3) + i, "uid": f"uid-{seed}-{i}"})
    return rows


TOKEN_GROUPS = {"input_ids": "tok", "logprobs": "tok", "mask": "tok", "bf16": "tok", "topk": "chunk"}
SCHEMA = Schema([FieldSpec("input_ids", "token", torch.int64, group="tok"),
                 FieldSpec("logprobs", "token", torch.float32, group="tok"),
                 FieldSpec("mask", "token", torch.bool, group="tok"),
                 FieldSpec("topk", "token", torch.int32, group="chunk", trailing_shape=(2,)),
                 FieldSpec("bf16", "token", torch.bfloat16, group="tok"),
                 FieldSpec("reward", "sample", torch.float32), FieldSpec("extra", "rect", torch.int64),
                 FieldSpec("uid", "object")])


def build(rows: list[dict], schema: bool = False, meta=None) -> DataProto:
    "A DataProto from reference rows (one offsets object per group, built here, not by the code under test)."
    n = len(rows)
    offsets = {}
    for group in ("tok", "chunk"):
        key = next(k for k, g in TOKEN_GROUPS.items() if g == group)
        offsets[group] = lengths_to_offsets(torch.tensor([r[key].shape[0] for r in rows], dtype=torch.int64))
    leaves = {}
    for key in ("input_ids", "logprobs", "mask", "topk", "bf16"):
        trailing = (2,) if key == "topk" else ()
        dtype = {"input_ids": torch.int64, "logprobs": torch.float32, "mask": torch.bool, "topk": torch.int32,
                 "bf16": torch.bfloat16}[key]
        values = torch.cat([r[key] for r in rows]) if rows else torch.empty((0, *trailing), dtype=dtype)
        leaves[key] = make_jagged(values, offsets[TOKEN_GROUPS[key]])
    leaves["reward"] = torch.stack([r["reward"] for r in rows]) if rows else torch.empty(0)
    leaves["extra"] = torch.stack([r["extra"] for r in rows]) if rows else torch.empty(0, 3, dtype=torch.int64)
    return DataProto(TensorDict(leaves, batch_size=[n]), {"uid": object_array(r["uid"] for r in rows)},
                     {"temperature": 0.7} if meta is None else meta, schema=SCHEMA if schema else None)


def assert_rows(dp: DataProto, expected: list[dict]):
    got = rows_of(dp)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.keys() <= b.keys(), (a.keys(), b.keys())
        for key in a:
            assert same_bits(a[key], b[key]), f"row {i} field {key}: {a[key]} != {b[key]}"


def assert_shared(dp: DataProto):
    "Test 6: every group's fields share one offsets object, with the min/max seqlen cache set and correct."
    for group in dp._groups():
        for key in group.keys:
            leaf = dp.batch.get(key)
            assert leaf.offsets() is group.offsets, f"{key} does not share the offsets of group {group.name}"
            cache = leaf._metadata_cache
            assert cache.get("min_seqlen") is not None and cache.get("max_seqlen") is not None, key
            if leaf.device.type != "meta" and len(dp):
                lengths = leaf.offsets().diff()
                assert (leaf._min_seqlen, leaf._max_seqlen) == (int(lengths.min()), int(lengths.max())), key


def payload_nbytes(dp: DataProto) -> int:
    total = 0
    for g in dp._groups(): total += g.offsets.numel() * 8 + sum(dp.batch.get(k).values().nbytes for k in g.keys)
    return total + sum(dp.batch.get(k).nbytes for k in dp.batch.keys() if not dp.batch.get(k).is_nested)


def expect(exc, fn, contains=""):
    with pytest.raises(exc) as info: fn()
    assert contains in str(info.value), str(info.value)
    return info.value


# -------------------------------------------------------------------------------------------- 1-2: invariants, len
def test_01_invariant_violations_raise_typed_errors():
    dp = build(make_rows(4))
    expect(ValueError, lambda: DataProto(dp.batch, {"uid": object_array(range(5))}), "length 5, expected N=4")
    expect(TypeError, lambda: DataProto(dp.batch, {"uid": ["a"] * 4}), "must be a np.ndarray")
    expect(ValueError, lambda: DataProto(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3])), "one batch dim")
    stack = NonTensorStack(*(NonTensorData(f"s{i}") for i in range(2)))
    expect(TypeError, lambda: DataProto(TensorDict({"s": stack}, batch_size=[2])), "non_tensor_batch")
    expect(TypeError, lambda: DataProto(TensorDict({"s": NonTensorData(np.array(["a", "b"]), batch_size=[2])},
                                                   batch_size=[2])), "non_tensor_batch")
    expect(TypeError, lambda: DataProto(meta_info=[1]), "meta_info must be a dict")


def test_01_invariants_hold_under_python_O():
    code = textwrap.dedent("""
        import numpy as np, torch
        from tensordict import NonTensorData, NonTensorStack, TensorDict
        from xtoken_dp.batch import DataProto
        from xtoken_dp.codec import object_array
        td = TensorDict({"x": torch.zeros(3)}, batch_size=[3])
        stack = NonTensorStack(*(NonTensorData(f"s{i}") for i in range(3)))
        checks = {
            "length": (ValueError, lambda: DataProto(td, {"o": object_array(range(4))})),
            "list": (TypeError, lambda: DataProto(td, {"o": [1, 2, 3]})),
            "dims": (ValueError, lambda: DataProto(TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3]))),
            "stack": (TypeError, lambda: DataProto(TensorDict({"s": stack}, batch_size=[3]))),
            "meta": (TypeError, lambda: DataProto(td, meta_info=[])),
            "chunk": (ValueError, lambda: DataProto(td).chunk(2)),
            "repeat": (ValueError, lambda: DataProto(td).repeat(0)),
            "index": (IndexError, lambda: DataProto(td)[3]),
        }
        failed = []
        for name, (exc, fn) in checks.items():
            try: fn(); failed.append(name)
            except exc: pass
        print("asserts stripped:", __debug__ is False, "| not raised:", failed)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.stdout.strip() == "asserts stripped: True | not raised: []", out.stdout + out.stderr


BATCH_MODULES = ("ragged", "dataproto", "tensorclasses", "persistence", "batch")


@pytest.mark.parametrize("module", BATCH_MODULES)
def test_01_library_has_no_assert_statements(module):
    import ast
    tree = ast.parse((ROOT / "xtoken_dp" / f"{module}.py").read_text())
    assert [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)] == []


def test_02_len_of_batch_only_non_tensor_only_and_empty():
    dp = build(make_rows(4))
    assert len(DataProto(batch=dp.batch)) == 4
    assert len(DataProto(non_tensor_batch={"o": object_array("abc")})) == 3
    assert len(DataProto()) == 0 and len(build([])) == 0


# -------------------------------------------------------------------------------------------- 3-5: rows and gathers
def test_03_int_indexing():
    rows = make_rows(6)
    dp = build(rows)
    for key, i in ((-1, 5), (np.int64(2), 2), (torch.tensor(3), 3), (0, 0)):
        item = dp[key]
        assert isinstance(item, DataProtoItem) and item.batch.batch_size == torch.Size([])
        for k in item.batch.keys(): assert same_bits(item.batch.get(k), rows[i][k]), k
        assert item.non_tensor_batch["uid"] == rows[i]["uid"] and item.meta_info == dp.meta_info
        assert item.meta_info is not dp.meta_info
    for bad in (6, -7, np.int32(9)): expect(IndexError, lambda: dp[bad])


def test_04_slices_share_storage_and_step_two_equals_reference():
    rows = make_rows(9, seed=1)
    dp = build(rows)
    view = dp[2:7]
    for key in ("input_ids", "topk"):
        parent, child = dp.batch.get(key), view.batch.get(key)
        assert child.values().untyped_storage().data_ptr() == parent.values().untyped_storage().data_ptr()
        assert int(child.offsets()[0]) == 0 and child.offsets() is not parent.offsets()
    assert view.batch.get("reward").untyped_storage().data_ptr() == dp.batch.get("reward").untyped_storage().data_ptr()
    assert np.shares_memory(view.non_tensor_batch["uid"], dp.non_tensor_batch["uid"])
    assert_rows(view, rows[2:7]); assert_shared(view)
    assert_rows(dp[1:9:2], rows[1:9:2]); assert_rows(dp[::-3], rows[::-3]); assert_rows(dp[7:3], [])


def test_05_gathers_equal_reference_and_bad_keys_raise():
    rows = make_rows(7, seed=2)
    dp = build(rows)
    index = [6, 0, -1, 3, 3, -7]
    expected = [rows[i] for i in index]
    for key in (torch.tensor(index), index, np.array(index), np.array(index, dtype=np.int32)):
        out = dp[key]
        assert_rows(out, expected); assert_shared(out)
    mask = [True, False, True, True, False, False, True]
    for key in (torch.tensor(mask), mask, np.array(mask)):
        assert_rows(dp[key], [r for r, m in zip(rows, mask) if m])
    expect(IndexError, lambda: dp[torch.tensor([True, False])], "bool mask must have shape (7,)")
    expect(IndexError, lambda: dp[[7]], "out of range")
    expect(TypeError, lambda: dp[torch.tensor([1.0, 2.0])], "float32")
    expect(TypeError, lambda: dp[np.array([0.5])], "float64")
    expect(TypeError, lambda: dp["input_ids"])


# -------------------------------------------------------------------------------------------- 6-13: the API
@pytest.mark.parametrize("schema", [False, True])
def test_06_offsets_sharing_survives_every_op(schema, tmp_path):
    dp = build(make_rows(8, seed=3), schema=schema)
    structure = dp.groups
    results = {"index": dp[[3, 1, 1]], "mask": dp[torch.arange(8) % 2 == 0], "slice": dp[1:6],
               "select": dp.select(["input_ids", "mask", "topk"] + ([] if schema else []), None, None),
               "concat": DataProto.concat([dp[:3], dp[3:3], dp[[7, 0]]]), "repeat": dp.repeat(3),
               "tile": dp.repeat(2, interleave=False), "to": build(make_rows(8, seed=3), schema=schema).to("meta"),
               "unpickle": pickle.loads(pickle.dumps(dp[2:5], protocol=5)),
               "unpickle4": pickle.loads(pickle.dumps(dp, protocol=4))}
    union_base = dp.select(["input_ids", "reward"], [], [])
    results["union"] = union_base.union(dp.select(["logprobs", "mask", "topk"], [], []))
    results.update({f"chunk{i}": p for i, p in enumerate(dp.chunk(4))})
    results.update({f"split{i}": p for i, p in enumerate(dp.split([3, 0, 5]))})
    dp.save(tmp_path / "saved")
    results["load"] = DataProto.load(tmp_path / "saved", allow_pickle=True)
    results["load_cpu"] = DataProto.load(tmp_path / "saved", device="cpu", allow_pickle=True)
    results["load_meta"] = DataProto.load(tmp_path / "saved", device="meta", allow_pickle=True)
    for name, out in results.items():
        assert_shared(out)
        for group_keys in out.groups.values():  # no group is split or merged with another
            assert any(set(group_keys) <= set(keys) for keys in structure.values()), (name, out.groups)


def test_07_select_shares_tensors_and_copies_only_objects_when_asked():
    dp = build(make_rows(5), schema=True)
    part = dp.select(["input_ids", "mask"], ["uid"], ["temperature"])
    assert part.batch.get("input_ids").values().data_ptr() == dp.batch.get("input_ids").values().data_ptr()
    assert part.batch.get("input_ids").offsets() is part.batch.get("mask").offsets()
    assert part.schema.names == ("input_ids", "mask", "uid")
    expect(KeyError, lambda: dp.select(["nope"]), "nope")
    expect(KeyError, lambda: dp.select(non_tensor_batch_keys=["nope"]), "nope")
    expect(KeyError, lambda: dp.select(meta_info_keys=["nope"]), "nope")
    deep = dp.select(deepcopy=True)
    assert deep.non_tensor_batch["uid"] is not dp.non_tensor_batch["uid"] and deep.meta_info is not dp.meta_info
    assert deep.batch.get("reward").data_ptr() == dp.batch.get("reward").data_ptr()
    shallow = dp.select()
    assert shallow.non_tensor_batch["uid"] is dp.non_tensor_batch["uid"] and shallow.meta_info is not dp.meta_info


def test_08_union_merges_equal_overlaps_and_is_atomic_on_conflicts():
    rows = make_rows(6, seed=4)
    dp = build(rows)
    left = dp.select(["input_ids", "reward"], ["uid"], ["temperature"])
    right = build(rows).select(["input_ids", "logprobs", "topk"], ["uid"], [])  # equal copies of the overlap
    right.meta_info["step"] = 2
    assert left.union(right) is left
    assert list(left.batch.keys()) == ["input_ids", "reward", "logprobs", "topk"] and left.meta_info["step"] == 2
    assert left.batch.get("logprobs").offsets() is left.batch.get("input_ids").offsets()  # re-pointed into the group
    assert_rows(left, rows); assert_shared(left)

    def state(d): return (list(d.batch.keys()), list(d.non_tensor_batch), dict(d.meta_info), d.batch.get("reward").clone())
    target = build(rows)
    conflicts = [DataProto(TensorDict({"reward": torch.zeros(6)}, batch_size=[6])),
                 DataProto(non_tensor_batch={"uid": object_array(range(6))}),
                 DataProto(TensorDict({"new": torch.zeros(6)}, batch_size=[6]), meta_info={"temperature": 1.5}),
                 build(rows[:5]).select(["logprobs"], [], [])]
    for other in conflicts:
        before = state(target)
        expect(ValueError, lambda: target.union(other))
        after = state(target)
        assert before[:3] == after[:3] and torch.equal(before[3], after[3])
    nan = DataProto(non_tensor_batch={"v": object_array([float("nan")] * 6)})
    assert build(rows).union(nan).union(DataProto(non_tensor_batch={"v": object_array([float("nan")] * 6)}))


def test_08_union_of_schemas_checks_groups_and_declarations():
    rows = make_rows(5, seed=5)
    dp = build(rows, schema=True)
    ids = dp.select(["input_ids"], [], [])
    other_rows = make_rows(5, seed=6)
    moved = build(other_rows, schema=True).select(["logprobs"], [], [])  # group "tok", other rows
    expect(ValueError, lambda: ids.union(moved), "group 'tok' has different rows")
    wrong = DataProto(dp.select(["input_ids"], [], []).batch, schema=Schema([FieldSpec("input_ids", "token", group="other")]))
    expect(ValueError, lambda: dp.select(["input_ids", "mask"], [], []).union(wrong), "declared differently")
    merged = dp.select(["input_ids"], [], []).union(dp.select(["topk", "reward"], ["uid"], []))
    assert merged.schema.names == ("input_ids", "topk", "reward", "uid") and merged.groups == {"tok": ("input_ids",), "chunk": ("topk",)}


def test_09_concat_equals_reference_and_refuses_ambiguity():
    rows = make_rows(10, seed=7)
    dp = build(rows)
    parts = [dp[0:3], dp[3:3], dp[[9, 4]], build([]), dp[5:6]]
    joined = DataProto.concat(parts)
    assert_rows(joined, rows[0:3] + [rows[9], rows[4]] + rows[5:6]); assert_shared(joined)
    expect(ValueError, lambda: DataProto.concat([]), "non-empty list")
    expect(ValueError, lambda: DataProto.concat([dp, dp.select(["reward"])]), "batch keys")
    expect(ValueError, lambda: DataProto.concat([dp, dp.select(None, [])]), "non_tensor_batch keys")
    expect(ValueError, lambda: DataProto.concat([dp, DataProto(dp.batch, dp.non_tensor_batch, {"temperature": 9.0})]),
           "meta_info key 'temperature'")
    expect(ValueError, lambda: DataProto.concat([dp, DataProto(non_tensor_batch=dp.non_tensor_batch)]), "batch")
    expect(ValueError, lambda: DataProto.concat([dp, build(rows, schema=True)]), "part 1 has a schema, part 0 has no schema")
    padded_ids = build(rows, schema=True)
    padded_ids.schema = Schema([FieldSpec("input_ids", "token", torch.int64, pad_value=-1, group="tok"), *list(SCHEMA)[1:]])
    expect(ValueError, lambda: DataProto.concat([build(rows, schema=True), padded_ids]), "first differing field: 'input_ids'")
    cast = DataProto(TensorDict({"reward": torch.zeros(2, dtype=torch.float64)}, batch_size=[2]))
    expect(TypeError, lambda: DataProto.concat([dp.select(["reward"], [], []), cast]), "dtype")
    wide = DataProto(TensorDict({"extra": torch.zeros(2, 4, dtype=torch.int64)}, batch_size=[2]))
    expect(ValueError, lambda: DataProto.concat([dp.select(["extra"], [], []), wide]), "trailing shape")
    a = DataProto(dp.batch, meta_info={"metrics": {"loss": 1.0, "kl": 0.1}, "step": 3})
    b = DataProto(dp.batch, meta_info={"metrics": {"loss": 2.0, "kl": 0.2}})
    assert DataProto.concat([a, b]).meta_info == {"metrics": {"loss": [1.0, 2.0], "kl": [0.1, 0.2]}, "step": 3}


def test_10_chunk_and_split_are_views_with_checked_sizes():
    rows = make_rows(12, seed=8)
    dp = build(rows)
    expect(ValueError, lambda: dp.chunk(5), "split")
    for parts in (dp.chunk(4), dp.split(5), dp.split([2, 0, 10])):
        assert_rows(DataProto.concat(parts), rows)
        for p in parts:
            if len(p): assert p.batch.get("logprobs").values().untyped_storage().data_ptr() == \
                dp.batch.get("logprobs").values().untyped_storage().data_ptr()
    assert [len(p) for p in dp.split(5)] == [5, 5, 2]
    expect(ValueError, lambda: dp.split([5, 5]), "summing to N=12")
    expect(ValueError, lambda: dp.split([13, -1]), "split_size[1]: expected an int >= 0, got -1")
    expect(ValueError, lambda: dp.split(0), "split_size: expected an int >= 1, got 0")
    expect(TypeError, lambda: dp.split(2.5), "split_size: expected an int")


def test_11_repeat_interleave_and_tile_equal_reference():
    rows = make_rows(4, seed=9)
    dp = build(rows)
    assert_rows(dp.repeat(3), [r for r in rows for _ in range(3)])
    assert_rows(dp.repeat(3, interleave=False), rows * 3)
    assert dp.repeat(1) == dp and dp.repeat(1) is not dp
    for bad in (0, -1): expect(ValueError, lambda: dp.repeat(bad), f"repeat_times: expected an int >= 1, got {bad}")
    for bad in (1.5, True): expect(TypeError, lambda: dp.repeat(bad), "repeat_times: expected an int >= 1")


def test_12_make_iterator_counts_rows_and_seeds():
    rows = make_rows(12, seed=10)
    dp = build(rows)
    expect(ValueError, lambda: dp.make_iterator(5, 1), "not divisible")
    expect(ValueError, lambda: dp.make_iterator(4, 1, dataloader_kwargs={"num_workers": 1}), "num_workers")
    expect(ValueError, lambda: dp.make_iterator(0, 1), "mini_batch_size")
    expect(ValueError, lambda: dp.make_iterator(4, -1), "epochs")
    for shuffle in (False, True):
        batches = list(dp.make_iterator(4, 3, seed=1, dataloader_kwargs={"shuffle": shuffle}))
        assert len(batches) == 12 * 3 // 4 and all(len(b) == 4 for b in batches)
        for epoch in range(3):
            uids = sum((b.non_tensor_batch["uid"].tolist() for b in batches[epoch * 3:(epoch + 1) * 3]), [])
            assert sorted(uids) == sorted(r["uid"] for r in rows)
    runs = [[b.non_tensor_batch["uid"].tolist() for b in dp.make_iterator(3, 2, seed=5, dataloader_kwargs={"shuffle": True})]
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][:4] != runs[0][4:]
    by_uid = {r["uid"]: r for r in rows}
    for b in dp.make_iterator(6, 1, seed=2, dataloader_kwargs={"shuffle": True}):
        assert_rows(b, [by_uid[u] for u in b.non_tensor_batch["uid"]])


def test_13_to_returns_self_keeps_host_objects_and_sharing():
    dp = build(make_rows(5, seed=11), schema=True)
    plain = dp.batch.to("meta")
    assert plain.get("input_ids").offsets() is not plain.get("logprobs").offsets()  # what tensordict alone does
    uid = dp.non_tensor_batch["uid"]
    assert dp.to("meta") is dp
    assert dp.batch.get("input_ids").device.type == "meta" and dp.non_tensor_batch["uid"] is uid
    assert_shared(dp)


def test_14_fancy_indexing_and_repeat_work_on_jagged_leaves():
    rows = make_rows(5, seed=12)
    dp = build(rows)
    njt = dp.batch.get("input_ids")
    with pytest.raises(NotImplementedError): njt[torch.tensor([1, 0])]  # verl indexes each leaf like this
    with pytest.raises((NotImplementedError, RuntimeError)): dp.batch.repeat_interleave(2, dim=0)  # verl's repeat
    assert_rows(dp[torch.tensor([1, 0])], [rows[1], rows[0]])
    assert_rows(dp.repeat(2), [r for r in rows for _ in range(2)])


def test_15_materialize_and_wire_round_trip():
    dp = build(make_rows(6, seed=13))
    got, expected = dp.materialize(pad_to_seqlen=8), materialize(dp.to_wire(), pad_to_seqlen=8)
    assert type(got) is dict and list(got) == list(expected)
    for key in got:
        if isinstance(got[key], np.ndarray): assert got[key].tolist() == expected[key].tolist()
        else: assert same_bits(got[key], expected[key]), key
    assert DataProto.from_wire(dp.to_wire(), dp.meta_info) == dp
    declared = build(make_rows(6, seed=13), schema=True)
    assert DataProto.from_wire(declared.to_wire(), declared.meta_info, schema=declared.schema) == declared
    only_objects = DataProto(non_tensor_batch={"o": object_array([None, {"a": 1}])})
    assert DataProto.from_wire(only_objects.to_wire()) == only_objects


# -------------------------------------------------------------------------------------------- 16-23: tensorclasses, files
def jagged_reward(n=4, seed=0, rewards=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (n,), generator=g)
    offsets = lengths_to_offsets(lengths)
    total = int(offsets[-1])
    return RewardData(make_jagged(torch.randint(0, 100, (total,), generator=g), offsets),
                      make_jagged(torch.ones(total, dtype=torch.bool), offsets),
                      make_jagged(torch.randn(total, generator=g), offsets) if rewards else None,
                      torch.rand(n, generator=g), batch_size=[n])


def dense_reward(n=4):
    return RewardData(torch.arange(n * 5).reshape(n, 5), torch.ones(n, 5, dtype=torch.bool), end_scores=torch.rand(n),
                      batch_size=[n])


def reward_equal(a: RewardData, b: RewardData) -> bool:
    if type(a) is not type(b) or a.batch_size != b.batch_size: return False
    for name in ("input_ids", "attention_mask", "rewards", "end_scores"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            if x is not y: return False
        elif x.is_nested != y.is_nested: return False
        elif x.is_nested:
            if not (same_bits(x.values(), y.values()) and torch.equal(x.offsets(), y.offsets())): return False
        elif not same_bits(x, y): return False
    return True


def test_16_reward_data_padded_and_jagged():
    padded, jagged = dense_reward(), jagged_reward(rewards=True)
    assert padded.input_ids.shape == (4, 5) and is_jagged(jagged.input_ids)
    other = make_jagged(torch.ones(jagged.input_ids.values().shape[0] + 1, dtype=torch.bool),
                        lengths_to_offsets(torch.tensor([1, 1, 1, jagged.input_ids.values().shape[0] - 2])))
    expect(ValueError, lambda: RewardData(jagged.input_ids, other, batch_size=[4]), "attention_mask must have the rows")
    expect(ValueError, lambda: RewardData(jagged.input_ids, jagged.attention_mask, rewards=torch.zeros(4, 5),
                                          batch_size=[4]), "rewards must be jagged")
    picked = jagged[torch.tensor([3, 0])]
    assert same_bits(picked.input_ids[0], jagged.input_ids[3]) and picked.input_ids.offsets() is picked.attention_mask.offsets()
    assert torch.cat([jagged, jagged]).batch_size == torch.Size([8])
    rows = jagged.unbind(0)
    assert len(rows) == 4 and same_bits(rows[2].input_ids, jagged.input_ids[2])
    row = pickle.loads(pickle.dumps(rows[1]))  # a row (batch_size []) pickles the tensordict way
    assert type(row) is RewardData and same_bits(row.input_ids, rows[1].input_ids)
    for protocol in (2, 5):
        back = pickle.loads(pickle.dumps(jagged, protocol=protocol))
        assert reward_equal(back, jagged) and back.input_ids.offsets() is back.attention_mask.offsets()
        assert (back.input_ids._min_seqlen, back.input_ids._max_seqlen) == (jagged.input_ids._min_seqlen, jagged.input_ids._max_seqlen)
    state = jagged.state_dict()
    target = jagged.clone()
    target.load_state_dict(state)
    assert reward_equal(target, jagged)
    td = jagged.to_tensordict()
    assert isinstance(td, TensorDict) and same_bits(td.get("input_ids").values(), jagged.input_ids.values())
    assert td.get("input_ids").values().data_ptr() != jagged.input_ids.values().data_ptr()  # a copy


def test_17_dense_reward_data_uses_tensordict_format_jagged_uses_ours(tmp_path):
    dense, jagged = dense_reward(), jagged_reward()
    dense.save(tmp_path / "dense"); jagged.save(tmp_path / "jagged")
    assert (tmp_path / "dense" / "meta.json").exists() and not (tmp_path / "dense" / MANIFEST_NAME).exists()
    assert (tmp_path / "jagged" / MANIFEST_NAME).exists()
    assert reward_equal(TensorDict.load_memmap(tmp_path / "dense"), dense)
    for path, original in ((tmp_path / "dense", dense), (tmp_path / "jagged", jagged)):
        assert reward_equal(RewardData.load(path), original) and reward_equal(RewardData.load_memmap(path), original)


def test_18_memmap_family(tmp_path):
    jagged = jagged_reward(seed=1, rewards=True)
    jagged.save(tmp_path / "saved")  # save routes to memmap
    assert json.loads((tmp_path / "saved" / MANIFEST_NAME).read_text())["class"].endswith("RewardData")
    assert reward_equal(RewardData.load(tmp_path / "saved"), jagged)  # load routes to load_memmap
    target = jagged_reward(seed=2, rewards=True)
    assert target.load_(tmp_path / "saved") is target and reward_equal(target, jagged)
    mapped = jagged.clone()
    assert mapped.memmap_(tmp_path / "in_place") is mapped and mapped.is_locked
    with pytest.raises(RuntimeError): mapped.end_scores = torch.zeros(4)
    copy_ = jagged.memmap(tmp_path / "copy")
    assert copy_.is_locked and reward_equal(copy_, jagged) and not jagged.is_locked
    like = jagged.memmap_like(tmp_path / "like")
    manifest = json.loads((tmp_path / "like" / MANIFEST_NAME).read_text())
    for f in manifest["fields"]:
        data = (tmp_path / "like" / f["file"]).read_bytes()
        assert len(data) == f["nbytes"] > 0 and set(data) == {0}
    offsets = np.fromfile(tmp_path / "like" / manifest["groups"][0]["file"], dtype=np.int64)
    assert offsets.tolist() == jagged.input_ids.offsets().tolist()
    assert like.input_ids.offsets().tolist() == jagged.input_ids.offsets().tolist() and int(like.input_ids.values().sum()) == 0
    # an on-disk edit: the directory now holds another batch with other rows
    other = jagged_reward(n=4, seed=7, rewards=True)
    shutil.rmtree(tmp_path / "copy"); other.save(tmp_path / "copy")
    assert copy_.memmap_refresh_() is copy_ and reward_equal(copy_, other) and copy_.is_locked
    expect(ValueError, lambda: jagged_reward().memmap_refresh_(), "no saved path")
    expect(ValueError, lambda: dense_reward().memmap_refresh_(), "no saved path")
    expect(NotImplementedError, lambda: jagged.memmap(tmp_path / "early", num_threads=2, return_early=True), "return_early")


def test_19_persistence_round_trip_is_exact(tmp_path):
    rows = make_rows(7, seed=14)
    dp = build(rows, schema=True, meta={"step": 3, "nested": {"a": (1, 2.5)}, "nan": float("nan")})
    dp.non_tensor_batch["numbers"] = np.arange(7, dtype=np.int16)
    dp.schema = Schema([*dp.schema, FieldSpec("numbers", "object")])
    dp.save(tmp_path / "dp", num_threads=2)
    expect(BatchDirectoryError, lambda: DataProto.load(tmp_path / "dp"), "allow_pickle=True")  # pickles: opt in
    back = DataProto.load(tmp_path / "dp", allow_pickle=True)
    assert type(back) is DataProto and back == dp and back.schema == dp.schema
    assert_rows(back.select(None, ["uid"]), rows); assert_shared(back)
    for key in dp.batch.keys():
        a, b = dp.batch.get(key), back.batch.get(key)
        if a.is_nested: assert same_bits(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
    assert back.non_tensor_batch["numbers"].dtype == np.int16 and back.meta_info["nested"] == {"a": (1, 2.5)}
    rd = jagged_reward(seed=3)
    rd.save(tmp_path / "rd")
    loaded = RewardData.load(tmp_path / "rd")
    assert loaded.rewards is None and reward_equal(loaded, rd)
    assert loaded.input_ids.offsets() is loaded.attention_mask.offsets()
    assert (loaded.input_ids._min_seqlen, loaded.input_ids._max_seqlen) == (rd.input_ids._min_seqlen, rd.input_ids._max_seqlen)
    assert json.loads((tmp_path / "rd" / MANIFEST_NAME).read_text())["none_fields"] == ["rewards"]


def test_20_meta_loading_reads_only_the_manifest(tmp_path):
    dp = build(make_rows(6, seed=15), schema=True)
    dp.save(tmp_path / "dp")
    rd = jagged_reward(seed=4, rewards=True)
    rd.save(tmp_path / "rd")
    for path in (tmp_path / "dp", tmp_path / "rd"):
        shutil.rmtree(path / "tensors"); shutil.rmtree(path / "offsets")
    meta = DataProto.load(tmp_path / "dp", device="meta", allow_pickle=True)
    for key in dp.batch.keys():
        a, b = dp.batch.get(key), meta.batch.get(key)
        assert b.device.type == "meta" and a.dtype == b.dtype and a.shape[2 if a.is_nested else 1:] == b.shape[2 if b.is_nested else 1:]
        if a.is_nested:
            assert (a._min_seqlen, a._max_seqlen) == (b._min_seqlen, b._max_seqlen) and a.values().shape == b.values().shape
    assert_shared(meta)
    rd_meta = RewardData.load_memmap(tmp_path / "rd", device="meta")
    assert rd_meta.input_ids.device.type == "meta" and rd_meta.input_ids.offsets() is rd_meta.rewards.offsets()
    assert rd_meta.input_ids._max_seqlen == rd.input_ids._max_seqlen and rd_meta.rewards.dtype == torch.float32


def test_21_device_none_maps_files_and_cpu_copies(tmp_path):
    dp = build(make_rows(5, seed=16))
    dp.save(tmp_path / "dp")
    mapped = DataProto.load(tmp_path / "dp", allow_pickle=True)
    mapped.batch.get("logprobs").values()[0] = 123.0
    mapped.batch.get("reward")[1] = -5.0
    again = DataProto.load(tmp_path / "dp", allow_pickle=True)
    assert again.batch.get("logprobs").values()[0].item() == 123.0 and again.batch.get("reward")[1].item() == -5.0
    copied = DataProto.load(tmp_path / "dp", device="cpu", allow_pickle=True)
    copied.batch.get("reward")[1] = 7.0
    assert DataProto.load(tmp_path / "dp", allow_pickle=True).batch.get("reward")[1].item() == -5.0


def test_22_refuses_directories_that_are_not_ours(tmp_path):
    (tmp_path / "empty").mkdir()
    expect(FileNotFoundError, lambda: DataProto.load(tmp_path / "empty"), "not an xtoken_dp batch directory")
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "x.bin").write_bytes(os.urandom(64))
    expect(FileNotFoundError, lambda: DataProto.load(tmp_path / "random"), "not an xtoken_dp batch directory")
    expect(FileNotFoundError, lambda: DataProto.load(tmp_path / "missing"))
    TensorDict({"x": torch.zeros(3)}, batch_size=[3]).memmap(tmp_path / "td")
    expect(FileNotFoundError, lambda: DataProto.load(tmp_path / "td"), "TensorDict.load_memmap")
    build(make_rows(4)).save(tmp_path / "dp")
    manifest_path = tmp_path / "dp" / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    for bad, message in (({"format": "tensordict"}, "format must be"), ({"version": 2}, "unsupported version 2")):
        manifest_path.write_text(json.dumps({**manifest, **bad}))
        expect(BatchDirectoryError, lambda: DataProto.load(tmp_path / "dp"), message)
    manifest_path.write_text("{not json")
    expect(BatchDirectoryError, lambda: DataProto.load(tmp_path / "dp"), "not valid JSON")
    manifest_path.write_text(json.dumps(manifest))
    expect(TypeError, lambda: RewardData.load_memmap(tmp_path / "dp"), "DataProto")
    jagged_reward().save(tmp_path / "rd")
    error = expect(TypeError, lambda: DataProto.load(tmp_path / "rd"), "RewardData")
    assert isinstance(error, BatchDirectoryError)  # a class mismatch is both
    victim = tmp_path / "dp" / manifest["fields"][1]["file"]
    victim.write_bytes(victim.read_bytes()[:-4])
    error = expect(BatchDirectoryError, lambda: DataProto.load(tmp_path / "dp", allow_pickle=True), str(victim))
    assert str(manifest["fields"][1]["nbytes"]) in str(error)
    victim.unlink()
    expect(FileNotFoundError, lambda: DataProto.load(tmp_path / "dp", allow_pickle=True), str(victim))
    build(make_rows(4)).save(tmp_path / "bad_offsets")
    offsets_file = tmp_path / "bad_offsets" / json.loads((tmp_path / "bad_offsets" / MANIFEST_NAME).read_text())["groups"][0]["file"]
    raw = np.fromfile(offsets_file, dtype=np.int64)
    raw[1], raw[2] = raw[2] + 1, raw[1]
    raw.tofile(offsets_file)
    expect(BatchDirectoryError, lambda: DataProto.load(tmp_path / "bad_offsets", allow_pickle=True), "offsets")
    build(make_rows(3)).save(tmp_path / "pickles")
    expect(BatchDirectoryError, lambda: DataProto.load(tmp_path / "pickles", allow_pickle=False), "allow_pickle=False")
    error = expect(BatchDirectoryError, lambda: DataProto.load(tmp_path / "pickles"), "allow_pickle=True")  # the default
    assert "runs whatever code" in str(error) and "objects/0000.pkl" in str(error) and "meta_info.pkl" in str(error)
    no_pickles = build(make_rows(3), meta={}).select(None, [])
    no_pickles.save(tmp_path / "no_pickles")
    assert DataProto.load(tmp_path / "no_pickles") == no_pickles


def test_23_existing_targets_and_interrupted_writes(tmp_path):
    dp = build(make_rows(4))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("someone else's file")
    expect(FileExistsError, lambda: dp.save(tmp_path / "full"), "not an empty directory")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    dp.save(tmp_path / "empty")  # an empty directory is a fine target
    assert DataProto.load(tmp_path / "empty", allow_pickle=True) == dp
    broken = DataProto(dp.batch, dp.non_tensor_batch, {"callback": lambda: None})  # meta_info cannot be pickled
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)): broken.save(tmp_path / "target")
    assert sorted(os.listdir(tmp_path)) == ["empty", "full"]  # no target, no temporary sibling


# -------------------------------------------------------------------------------------------- 24: DistillBatch
def distill_flat(n=4, seed=0, k=3):
    "A padded collator-style flat batch: teacher 0 cross-tokenizer with top-k, teacher 1 same-vocab, teacher 2 cross."
    g = torch.Generator().manual_seed(seed)
    flat = {}
    s_len = torch.randint(1, 7, (n,), generator=g)
    nc0, nc2 = torch.minimum(s_len, torch.randint(1, 4, (n,), generator=g)), torch.minimum(s_len, torch.randint(1, 3, (n,), generator=g))
    def side(prefix, lengths, width):
        live = torch.arange(width) < lengths[:, None]
        flat[prefix + "input_ids"] = torch.where(live, torch.randint(1, 500, (n, width), generator=g), 7)
        flat[prefix + "input_lengths"] = lengths
        flat[prefix + "token_mask"] = live & (torch.rand(n, width, generator=g) < 0.9)
        return live
    def chunk_ids(lengths, nc, width):  # chunk c covers an even share of the row; -1 on padding
        pos = torch.arange(width)[None, :]
        return torch.where(pos < lengths[:, None], torch.div(pos * nc[:, None], lengths[:, None].clamp(min=1), rounding_mode="floor"), -1)
    side("", s_len, 8)
    flat["sample_mask"] = (torch.rand(n, generator=g) < 0.8).float()
    flat["idx"] = torch.arange(n) + 100
    for i, nc in ((0, nc0), (2, nc2)):
        t_len = torch.maximum(nc, torch.randint(1, 6, (n,), generator=g))
        side(f"teacher_{i}_", t_len, 6)
        if i == 0:
            live = (torch.arange(6) < t_len[:, None])[..., None]
            flat["teacher_0_topk_ids"] = torch.where(live, torch.randint(0, 99, (n, 6, k), generator=g, dtype=torch.int32), 0)
            flat["teacher_0_topk_logprobs"] = torch.where(live, -torch.rand(n, 6, k, generator=g), 0.0).to(torch.bfloat16)
        s_cid, t_cid = chunk_ids(s_len, nc, 8), chunk_ids(t_len, nc, 6)
        P = max(1, int(nc.max()))
        valid = torch.arange(P) < nc[:, None]
        flat.update({f"alignment_{i}_pair_valid": valid, f"alignment_{i}_pair_is_correct": valid & (torch.rand(n, P, generator=g) < .5),
                     f"alignment_{i}_student_exact_partition_mask": s_cid == 0,
                     f"alignment_{i}_teacher_exact_partition_mask": t_cid == 0,
                     f"alignment_{i}_student_chunk_id": s_cid, f"alignment_{i}_teacher_chunk_id": t_cid,
                     f"alignment_{i}_num_chunks": nc})
    return flat, (True, False, True)


def distill_equal(a: DistillBatch, b: DistillBatch) -> bool:
    fa, fb = a.to_flat(layout="jagged"), b.to_flat(layout="jagged")
    return fa.keys() == fb.keys() and all(
        (same_bits(x.values(), y.values()) and torch.equal(x.offsets(), y.offsets())) if x.is_nested else same_bits(x, y)
        for x, y in zip(fa.values(), fb.values()))


def test_24_distill_batch_flat_round_trip_sharing_and_row_alignment():
    flat, layout = distill_flat()
    batch = DistillBatch.from_flat(flat, teacher_layout=layout).validate()
    assert batch.num_teachers == 3 and batch.teacher_layout == layout and batch.teacher(1).alignment is None
    expect(IndexError, lambda: batch.teacher(3), "[0, 3)")
    expect(TypeError, lambda: batch.teacher("0"), "i: expected an int")
    s = batch.student.offsets
    assert batch.student.token_mask.offsets() is s and batch.teacher(1).tokens.offsets is s
    for i in (0, 2):
        t = batch.teacher(i)
        assert t.alignment.student_chunk_id.offsets() is s and t.alignment.student_exact_partition_mask.offsets() is s
        assert t.alignment.teacher_chunk_id.offsets() is t.tokens.offsets is t.tokens.token_mask.offsets()
        assert t.alignment.pair_valid.offsets() is t.alignment.pair_is_correct.offsets()
    assert batch.teacher(0).topk_ids.offsets() is batch.teacher(0).tokens.offsets
    out = batch.to_flat()
    for i, nc in ((0, flat["alignment_0_num_chunks"]), (2, flat["alignment_2_num_chunks"])):
        P = max(1, int(nc.max()))
        pairs = out[f"alignment_{i}_pair_valid"]
        assert pairs.shape == (4, P) and torch.equal(pairs, torch.arange(P) < nc[:, None])
        cid = out[f"alignment_{i}_student_chunk_id"]
        assert bool((cid[torch.arange(cid.shape[1]) >= flat["input_lengths"][:, None]] == -1).all())
    assert distill_equal(DistillBatch.from_flat(out, teacher_layout=layout), batch)
    assert distill_equal(DistillBatch.from_flat(batch.to_flat(layout="jagged"), teacher_layout=layout), batch)
    assert distill_equal(DistillBatch.from_flat(batch.to_flat(pad_to_seqlen=16), teacher_layout=layout), batch)
    dp = batch.to_data_proto()
    assert dp.groups["teacher_0"][:2] == ("teacher_0_input_ids", "teacher_0_token_mask") and "pairs_2" in dp.groups
    assert distill_equal(DistillBatch.from_flat(dp.batch, teacher_layout=tuple(dp.meta_info["teacher_layout"])), batch)
    expect(ValueError, lambda: DistillBatch.from_flat({**flat, "junk": flat["idx"]}, teacher_layout=layout), "junk")
    expect(KeyError, lambda: DistillBatch.from_flat(flat, teacher_layout=(True, False, True, True)), "teacher_3")
    expect(TypeError, lambda: DistillBatch.from_flat(flat, teacher_layout="yes"), "tuple of bools")


def test_24_distill_batch_index_cat_pickle_keep_rows_aligned():
    flat, layout = distill_flat(n=5, seed=3)
    batch = DistillBatch.from_flat(flat, teacher_layout=layout)
    order = torch.tensor([4, 1, 1, 0])
    picked = batch[order].validate()
    reference = DistillBatch.from_flat({k: v[order] for k, v in flat.items()}, teacher_layout=layout)
    assert distill_equal(picked, reference)
    both = torch.cat([batch, picked]).validate()
    assert distill_equal(both, DistillBatch.from_flat({k: torch.cat([v, v[order]]) for k, v in flat.items()},
                                                      teacher_layout=layout))
    for protocol in (2, 4, 5):
        back = pickle.loads(pickle.dumps(batch, protocol=protocol)).validate()
        assert distill_equal(back, batch) and back.student.offsets is back.teacher(0).alignment.student_chunk_id.offsets()


def test_24_padded_alignment_is_converted_and_same_vocab_topk_refused():
    flat, layout = distill_flat(n=3, seed=5)
    batch = DistillBatch.from_flat(flat, teacher_layout=layout)
    padded = AlignmentBatch.from_flat(flat, prefix="alignment_0_")
    t0 = batch.teacher(0)
    rebuilt = DistillBatch(batch.student, batch.sample_mask, TensorDict(
        {"0": TeacherSeq(t0.tokens, padded, t0.topk_ids, t0.topk_logprobs, batch_size=[3])}, batch_size=[3]),
        batch.idx, batch_size=[3]).validate()
    a = rebuilt.teacher(0).alignment
    assert a.layout == "jagged" and a.student_chunk_id.offsets() is rebuilt.student.offsets
    tokens = TokenSeq.from_padded(flat["input_ids"], torch.arange(8) < flat["input_lengths"][:, None])
    with_topk = DistillBatch(tokens, batch.sample_mask, TensorDict({"0": TeacherSeq(
        tokens, None, make_jagged(torch.zeros(tokens.input_ids.values().shape[0], 2, dtype=torch.int32), tokens.offsets),
        batch_size=[3])}, batch_size=[3]), batch_size=[3])
    expect(ValueError, lambda: with_topk.to_flat(), "same-vocab")


# -------------------------------------------------------------------------------------------- 25-26: pickle
@pytest.mark.parametrize("n", [1, 4000])
def test_25_protocol_5_out_of_band_and_small_inband(n):
    rows = [dict(r, uid=f"row-{i}-" + "x" * 20) for i, r in enumerate(make_rows(n, seed=17))]
    dp = build(rows, schema=True, meta={"step": 1})
    oob = []
    inband = pickle.dumps(dp, protocol=5, buffer_callback=oob.append)
    assert len(inband) < 64 * 1024
    assert all(isinstance(b, pickle.PickleBuffer) for b in oob)
    data_bytes = sum(b.raw().nbytes for b in oob)
    assert data_bytes >= payload_nbytes(dp)
    back = pickle.loads(inband, buffers=[b.raw() for b in oob])
    assert back == dp and back.schema == dp.schema
    addresses = {np.frombuffer(b.raw(), np.uint8).ctypes.data for b in oob if b.raw().nbytes}
    assert back.batch.get("logprobs").values().data_ptr() in addresses  # loads aliases the buffers
    for protocol in (2, 3, 4):
        assert pickle.loads(pickle.dumps(dp, protocol=protocol)) == dp


def test_26_pickled_slice_ships_only_its_rows():
    g = torch.Generator().manual_seed(18)
    lengths = torch.empty(512).exponential_(6 / 1024, generator=g).long().clamp(1, 1024)  # long tail, mean S/6
    offsets = lengths_to_offsets(lengths)
    total = int(offsets[-1])
    dp = DataProto(TensorDict({"input_ids": make_jagged(torch.randint(0, 150_000, (total,), generator=g), offsets),
                               "logprobs": make_jagged(-torch.rand(total, generator=g), offsets),
                               "mask": make_jagged(torch.rand(total, generator=g) < .9, offsets),
                               "reward": torch.rand(512, generator=g)}, batch_size=[512]),
                   {"uid": object_array(f"uid-{i}" for i in range(512))})
    part = dp[200:208]
    payload = payload_nbytes(part) + len(pickle.dumps(part.non_tensor_batch["uid"], protocol=5))
    header = len(pickle.dumps(part, protocol=5, buffer_callback=lambda b: None))  # the in-band part alone
    pickled = len(pickle.dumps(part, protocol=5))
    assert pickled <= 1.1 * payload + header, (pickled, payload, header)
    assert len(pickle.dumps(dp.batch[200:208])) > 20 * pickled  # what a tensordict slice ships


# -------------------------------------------------------------------------------------------- 27: processes
def test_27_spawned_queue_carries_data_proto_and_reward_data_intact():
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=transport_probe_worker, args=(inbox, outbox), daemon=True)
    worker.start()
    try:
        dp = build(make_rows(9, seed=19), schema=True)
        items = [dp[2:7], dp[[8, 0, 0]], jagged_reward(seed=5, rewards=True)]
        for item in items: inbox.put(item)
        replies = [outbox.get(timeout=120) for _ in items]
    finally:
        inbox.put(None); worker.join(60)
        if worker.is_alive(): worker.kill()
    for item, (back, seen) in zip(items, replies):
        if isinstance(item, DataProto):
            assert back == item and seen == {"type": "DataProto", "rows": len(item), "groups_shared": True, "seqlens_cached": True}
            assert_shared(back)
        else:
            assert reward_equal(back, item) and back.input_ids.offsets() is back.attention_mask.offsets()
            assert seen["seqlens_cached"] and seen["offsets_objects"] == 1


class _RowsOnly(torch.utils.data.Dataset):
    "Rows one at a time through __getitem__ (no __getitems__): the per-item path of the DataLoader."
    def __init__(self, dp): self.dp = dp
    def __len__(self): return len(self.dp)
    def __getitem__(self, i): return self.dp[i:i + 1]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_27_dataloader_workers_deliver_every_row_once(context):
    rows = make_rows(24, seed=20)
    dp = build(rows)
    by_uid = {r["uid"]: r for r in rows}
    datasets = [DataProtoDataset(dp)] + ([_RowsOnly(dp)] if context == "fork" else [])
    for dataset in datasets:
        loader = torch.utils.data.DataLoader(dataset, batch_size=5, shuffle=True, num_workers=2,
                                             collate_fn=collate_data_protos, multiprocessing_context=context,
                                             generator=torch.Generator().manual_seed(0))
        batches = list(loader)
        assert [len(b) for b in batches] == [5, 5, 5, 5, 4]
        joined = DataProto.concat(batches)
        uids = joined.non_tensor_batch["uid"].tolist()
        assert sorted(uids) == sorted(by_uid)
        assert_rows(joined, [by_uid[u] for u in uids]); assert_shared(joined)


# -------------------------------------------------------------------------------------------- 28: Ray
def test_28_ray_put_get_is_exact_zero_copy_and_locked(ray_session):
    dp = build(make_rows(200, seed=21), schema=True, meta={"step": 4})
    ref = ray_put(dp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-writable-buffer warning is handled, not printed per field
        first, second = ray_get(ref), ray_get(ref)
    assert first == dp and first.schema == dp.schema
    assert first.batch.get("logprobs").values().data_ptr() == second.batch.get("logprobs").values().data_ptr()
    assert first.batch.is_locked
    with pytest.raises(RuntimeError): first.batch.set("reward", torch.zeros(200))
    writable = first.batch.get("reward").clone()
    writable[0] = 42.0
    assert writable[0].item() == 42.0 and first.batch.get("reward")[0].item() != 42.0
    rd = jagged_reward(seed=6, rewards=True)
    rd_back = ray_get(ray_put(rd))
    assert reward_equal(rd_back, rd) and rd_back.is_locked


# -------------------------------------------------------------------------------------------- 29-30
def test_29_import_hygiene_in_a_fresh_process():
    code = textwrap.dedent("""
        import sys, tensordict
        before = (tensordict.lazy_legacy(), tensordict.list_to_stack())
        import xtoken_dp.batch
        after = (tensordict.lazy_legacy(), tensordict.list_to_stack())
        print(before == after, "ray" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True, timeout=300)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_30_cuda_sharing_pinned_loader_and_device_materialize():
    dp = build(make_rows(16, seed=22), schema=True)
    expected = dp.materialize(pad_to_seqlen=8)
    on_gpu = build(make_rows(16, seed=22), schema=True).to("cuda")
    assert on_gpu.batch.get("input_ids").is_cuda and on_gpu.batch.get("input_ids").offsets().is_cuda
    assert_shared(on_gpu); assert_shared(on_gpu[[3, 1]]); assert_shared(on_gpu.repeat(2))
    got = on_gpu.materialize(pad_to_seqlen=8)
    for key, value in expected.items():
        if isinstance(value, np.ndarray): assert got[key].tolist() == value.tolist()
        else: assert got[key].is_cuda and same_bits(got[key].cpu(), value), key
    loader = torch.utils.data.DataLoader(DataProtoDataset(dp), batch_size=4, collate_fn=collate_data_protos, pin_memory=True)
    for batch in loader:
        assert all(batch.batch.get(k).is_pinned() for k in batch.batch.keys() if not batch.batch.get(k).is_nested)
        assert all(batch.batch.get(k).values().is_pinned() for k in batch.batch.keys() if batch.batch.get(k).is_nested)
        assert_shared(batch)
    back = pickle.loads(pickle.dumps(on_gpu, protocol=5))
    assert back.batch.get("input_ids").is_cuda and back.to("cpu") == dp


# -------------------------------------------------------------------------------------------- kernel properties
@st.composite
def offsets_and_index(draw):
    lengths = draw(st.lists(st.integers(0, 6), min_size=0, max_size=12))
    n = len(lengths)
    index = draw(st.lists(st.integers(-n, n - 1), max_size=15)) if n else []
    return lengths, index


@PROPERTY
@given(offsets_and_index(), st.integers(1, 3), st.booleans())
def test_property_kernels_match_per_row_rule(case, times, interleave):
    lengths, index = case
    offsets = lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))
    values = torch.arange(int(offsets[-1]))
    rows = [values[offsets[i]:offsets[i + 1]].tolist() for i in range(len(lengths))]
    new, positions = ragged_index(offsets, torch.tensor(index, dtype=torch.int64))
    picked = [rows[i] for i in index]
    assert new.tolist() == lengths_to_offsets(torch.tensor([len(r) for r in picked], dtype=torch.int64)).tolist()
    assert values[positions].tolist() == sum(picked, [])
    mask = [i % 2 == 0 for i in range(len(lengths))]
    new, positions = ragged_index(offsets, torch.tensor(mask, dtype=torch.bool))
    assert values[positions].tolist() == sum((r for r, m in zip(rows, mask) if m), [])
    new, positions = ragged_repeat(offsets, times, interleave)
    expected = [r for r in rows for _ in range(times)] if interleave else rows * times
    assert values[positions].tolist() == sum(expected, []) and new[-1].item() == len(sum(expected, []))
    cut = len(lengths) // 2
    new, v0, v1 = ragged_slice(offsets, cut, len(lengths))
    assert values[v0:v1].tolist() == sum(rows[cut:], []) and new[0].item() == 0
    joined = ragged_cat([offsets, offsets[: cut + 1]])
    assert joined.tolist() == lengths_to_offsets(torch.tensor(lengths + lengths[:cut], dtype=torch.int64)).tolist()


@PROPERTY
@given(st.integers(0, 9), st.integers(0, 1000), st.data())
def test_property_data_proto_ops_match_reference(n, seed, data):
    rows = make_rows(n, seed=seed)
    dp = build(rows, schema=data.draw(st.booleans()))
    index = data.draw(st.lists(st.integers(-n, n - 1), max_size=12)) if n else []
    assert_rows(dp[index], [rows[i] for i in index])
    a, b = sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n))))
    assert_rows(dp[a:b], rows[a:b])
    out = DataProto.concat([dp[a:b], dp[index], dp[:a]])
    assert_rows(out, rows[a:b] + [rows[i] for i in index] + rows[:a]); assert_shared(out)
    assert pickle.loads(pickle.dumps(out, protocol=5)) == out
    assert pickle.loads(ForkingPickler.dumps(out)) == out
