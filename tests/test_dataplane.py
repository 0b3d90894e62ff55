"""The data plane: one battery run against both adapters (the in-process reference and TransferQueue on the test
session's local Ray), plus what only the real store can show: worker processes that attach, read their shard by key
and write back, and a worker killed between two writes.

TransferQueue starts once per test session (`tq_plane`) and is stopped at the end, with a check that none of its
services is left running. Every test uses its own partition.
"""
import pickle
import socket
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from xtoken_dp.codec import long_tail_lengths, pack_jagged_fields
from tensordict import NonTensorData, TensorDict

from xtoken_dp.dataplane import (AttachError, DataPlaneError, DataPlaneOp, FieldSelectionError, InProcessDataPlane,
                                 KVBatchMeta, MissingFieldsError, MissingKeysError, OverwriteError, PartitionInfo,
                                 StaleReceiptError, TransferQueueDataPlane, UnknownPartitionError, WorkerTask,
                                 build_data_plane_client, concat_metas, read_acks, read_columns, shard_balance,
                                 shard_meta_for_dp, spawn_worker, write_columns)
from xtoken_dp.schema import FieldSpec, Schema

TESTS = Path(__file__).resolve().parent
WAIT_S = 0.4  # the bounded wait of the clients under test


@pytest.fixture(params=["in_process", "transfer_queue", "transfer_queue_tensor_rows"])
def plane(request):
    if request.param == "in_process":
        with InProcessDataPlane(timeout_s=WAIT_S) as p: yield p
        return
    tq = request.getfixturevalue("tq_plane")
    saved = tq.row_format
    tq.row_format = "tensors" if request.param.endswith("tensor_rows") else "bytes"
    try: yield tq
    finally: tq.row_format = saved


@pytest.fixture
def partition(plane):
    name = f"p_{uuid.uuid4().hex[:10]}"
    plane.register_partition(name)
    return name


OBJECTS = [None, "text", b"\x00bytes", {"a": [1, (2, 3)]}, (4, "five"), np.float32(1.5), "ünï", 7]


def every_kind_columns(n: int, seed: int = 0) -> tuple[dict, dict, Schema]:
    "Padded columns of every field kind (two token groups), their lengths (rows of length 0 included) and schema."
    g = torch.Generator().manual_seed(seed)
    s_len = torch.randint(0, 7, (n,), generator=g)
    t_len = torch.randint(0, 5, (n,), generator=g)
    if n: s_len[0], t_len[-1] = 0, 0
    lp = torch.randn(n, 7, generator=g).bfloat16()
    if n: lp.view(torch.int16)[0, 1] = 0x7FC1  # a NaN with a payload: compared bit for bit
    columns = {"zeta_ids": torch.randint(0, 50_000, (n, 7), generator=g), "logprobs": lp,
               "mask": torch.rand(n, 7, generator=g) > 0.5, "topk": torch.randint(0, 99, (n, 7, 4), generator=g, dtype=torch.int32),
               "teacher_ids": torch.randint(0, 50_000, (n, 5), generator=g), "teacher_lp": torch.randn(n, 5, generator=g),
               "reward": torch.randn(n, generator=g), "done": torch.rand(n, generator=g) > 0.5,
               "box": torch.randn(n, 3, generator=g, dtype=torch.float64),
               "grid": torch.randint(-9, 9, (n, 2, 2), generator=g, dtype=torch.int16),
               "meta": np.array([OBJECTS[i % len(OBJECTS)] for i in range(n)] + [None], dtype=object)[:n]}
    schema = Schema([FieldSpec("zeta_ids", "token", torch.int64, group="student"),
                     FieldSpec("logprobs", "token", torch.bfloat16, group="student"),
                     FieldSpec("mask", "token", torch.bool, group="student"),
                     FieldSpec("topk", "token", torch.int32, group="student", trailing_shape=(4,)),
                     FieldSpec("teacher_ids", "token", torch.int64, group="teacher_0"),
                     FieldSpec("teacher_lp", "token", torch.float32, group="teacher_0"),
                     FieldSpec("reward", "sample", torch.float32), FieldSpec("done", "sample", torch.bool),
                     FieldSpec("box", "rect", torch.float64, trailing_shape=(3,)),
                     FieldSpec("grid", "rect", torch.int16, trailing_shape=(2, 2)), FieldSpec("meta", "object")])
    return columns, {"student": s_len, "teacher_0": t_len}, schema


def every_kind_batch(n: int, rows=None, seed: int = 0):
    "The wire batch of `every_kind_columns`, optionally of some rows only."
    columns, lengths, schema = every_kind_columns(n, seed)
    if rows is not None:
        idx = torch.tensor(rows, dtype=torch.int64)
        columns = {k: (v[np.asarray(rows, dtype=np.int64)] if isinstance(v, np.ndarray) else v[idx]) for k, v in columns.items()}
        lengths = {k: v[idx] for k, v in lengths.items()}
    return pack_jagged_fields(columns, lengths=lengths, schema=schema), schema


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_same_wire(got, want, schema: Schema):
    "Bitwise equal leaves, dtypes and shapes; field order as written; one offsets object per token group."
    assert list(got.keys()) == list(want.keys())
    assert got.batch_size == want.batch_size
    for spec in (schema[k] for k in want.keys()):
        a, b = got.get(spec.name), want.get(spec.name)
        if spec.kind == "object":
            items, expected = a.tolist() if len(want) else [], b.tolist() if len(want) else []
            assert items == expected and [type(x) for x in items] == [type(x) for x in expected], spec.name
            continue
        assert a.dtype == b.dtype, spec.name
        if spec.kind == "token":
            assert torch.equal(a.offsets(), b.offsets()), spec.name
            assert a.values().shape == b.values().shape and torch.equal(bits(a.values()), bits(b.values())), spec.name
            assert (a._min_seqlen, a._max_seqlen) == (b._min_seqlen, b._max_seqlen), spec.name
        else:
            assert a.shape == b.shape and not a.is_nested and torch.equal(bits(a), bits(b)), spec.name
    for group, names in schema.groups().items():
        names = [n for n in names if n in want.keys()]
        assert len({id(got.get(n).offsets()) for n in names}) <= 1, f"group {group} lost its shared offsets"


def keys_for(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]

# ------------------------------------------------------------------------------------------------ the battery


def test_round_trip_every_field_kind(plane, partition):
    wire, schema = every_kind_batch(9)
    meta = plane.put_samples(keys_for(9), partition, wire, tags=[{"i": i} for i in range(9)], schema=schema)
    assert meta.fields == list(schema.names) and meta.group_lengths["student"][0] == 0
    assert meta.sequence_lengths == list(meta.group_lengths["student"])   # NeMo-RL's per-row length: the first group's
    got = plane.get_by_meta(meta, list(reversed(schema.names)))   # asked in another order: returned as written
    assert_same_wire(got, wire, schema)


def test_rows_by_key_in_any_order(plane, partition):
    wire, schema = every_kind_batch(9)
    meta = plane.put_samples(keys_for(9), partition, wire, schema=schema)
    rows = [8, 0, 4]
    want, _ = every_kind_batch(9, rows)
    assert_same_wire(plane.get_by_meta(meta.subset(rows), schema.names), want, schema)
    one = plane.get_by_meta(meta.subset([2]), ["teacher_ids", "meta"])
    assert list(one.keys()) == ["teacher_ids", "meta"]


def test_rows_by_key_alone(plane, partition):
    "NeMo-RL's direct read: the keys and the field names are enough, the layout comes back as written."
    wire, schema = every_kind_batch(9)
    plane.put_samples(keys_for(9), partition, wire, schema=schema)
    rows = [8, 0, 4]
    want, _ = every_kind_batch(9, rows)
    got = plane.get_samples([f"k{r}" for r in rows], partition, schema.names)
    assert_same_wire(got, want, schema)
    asked = ["meta", "teacher_ids", "zeta_ids"]   # by key, fields come in the order asked
    assert list(plane.get_samples(["k3"], partition, asked).keys()) == asked


def test_empty_batch_and_empty_rows(plane, partition):
    wire, schema = every_kind_batch(0)
    meta = plane.put_samples([], partition, wire, schema=schema)
    assert meta.size == 0
    assert_same_wire(plane.get_by_meta(meta, schema.names), wire, schema)
    assert plane.get_samples([], partition, ["zeta_ids"]).batch_size == torch.Size([0])
    zeros = pack_jagged_fields({"ids": torch.zeros(3, 4, dtype=torch.int64), "w": torch.ones(3, 4, dtype=torch.bool)},
                               lengths=torch.zeros(3, dtype=torch.int64), token_aligned_fields=["ids", "w"])
    meta = plane.put_samples(keys_for(3, "z"), partition, zeros)
    got = plane.get_by_meta(meta, ["ids", "w"])
    assert_same_wire(got, zeros, meta.schema)
    assert got["ids"]._max_seqlen == 0


def test_field_nobody_wrote_is_a_typed_error(plane, partition):
    wire, schema = every_kind_batch(4)
    meta = plane.put_samples(keys_for(4), partition, wire, schema=schema)
    with pytest.raises(MissingFieldsError, match=r"\['advantage'\] are not in the receipt of keys \['k0', 'k1', 'k2', 'k3'\]") as e:
        plane.get_by_meta(meta, ["reward", "advantage"])
    assert e.value.fields == ("advantage",) and e.value.keys == tuple(keys_for(4))
    with pytest.raises(TypeError, match="fetching every field is refused"):
        plane.get_by_meta(meta, None)
    # a receipt that promises a field the store does not hold for its keys: a bounded wait, then the field and the keys
    promised = meta.slice(0, 2).with_fields(["score"])
    start = time.monotonic()
    with pytest.raises(MissingFieldsError, match=r"after waiting 0.4 s, 'score' missing for keys \['k0', 'k1'\]"):
        plane.get_by_meta(promised, ["score"])
    with pytest.raises(KeyError):   # what NeMo-RL's callers catch
        plane.get_samples(keys_for(2), partition, ["score"])
    assert time.monotonic() - start < 30   # bounded (a hang would never get here)
    # keys the store never saw fail at once, as a KeyError
    ghost = KVBatchMeta(partition, None, keys_for(2, "ghost"), schema=Schema([FieldSpec("reward", "sample", torch.float32)]))
    with pytest.raises(MissingKeysError, match=r"sample ids \['ghost0', 'ghost1'\] are not in the store") as e:
        plane.get_by_meta(ghost, ["reward"])
    assert isinstance(e.value, KeyError) and e.value.keys == ("ghost0", "ghost1")


def test_clearing_frees_the_keys(plane, partition):
    wire, schema = every_kind_batch(5)
    meta = plane.put_samples(keys_for(5), partition, wire, schema=schema)
    plane.clear_samples(keys_for(2), partition)
    with pytest.raises(MissingKeysError, match=r"sample ids \['k0', 'k1'\] are not in the store"):
        plane.get_by_meta(meta, ["reward"])
    assert plane.get_by_meta(meta.slice(2), ["reward"])["reward"].shape == (3,)
    again, _ = every_kind_batch(2, seed=1)
    meta2 = plane.put_samples(keys_for(2), partition, again, schema=schema)   # freed keys can be written afresh
    assert_same_wire(plane.get_by_meta(meta2, schema.names), again, schema)
    plane.clear_samples(meta.sample_ids, partition)
    with pytest.raises(KeyError):
        plane.get_samples(meta.sample_ids, partition, ["reward"])


def test_clearing_what_this_client_put(plane, partition):
    "`clear_samples(None, partition)` frees the keys this client put there, and only those."
    fields = TensorDict({"x": torch.arange(4)}, batch_size=[4])
    plane.put_samples(["a", "b", "c", "d"], partition, fields)
    plane.clear_samples(["b"], partition)
    plane.clear_samples(None, partition)
    with pytest.raises(KeyError):
        plane.get_samples(["a"], partition, ["x"])
    assert list(plane.produced[partition]) == []


def test_write_back_and_padded_reads_agree_across_ranks(plane, partition):
    wire, schema = every_kind_batch(10)
    meta = plane.put_samples(keys_for(10), partition, wire, schema=schema)
    shards, inverse = shard_meta_for_dp(meta, dp_world=3, group="student", pad_multiple=8)
    cols = [read_columns(plane, s, ["zeta_ids", "mask", "teacher_ids", "box"]) for s in shards]
    assert len({c["zeta_ids"].shape[1:] for c in cols}) == 1 and len({c["teacher_ids"].shape[1:] for c in cols}) == 1
    assert cols[0]["zeta_ids"].shape[1] % 8 == 0 and cols[0]["box"].shape[1:] == (3,)
    written = [write_columns(plane, s, {"adv": c["zeta_ids"].float() * 0.5,
                                        "score": torch.tensor([float(k[1:]) for k in s.sample_ids])}, schema=Schema([
        FieldSpec("adv", "token", torch.float32, group="student"), FieldSpec("score", "sample", torch.float32)]))
        for s, c in zip(shards, cols)]
    gathered = meta.merge_written(concat_metas(written).subset(inverse))
    assert gathered.fields == [*schema.names, "adv", "score"]
    back = read_columns(plane, gathered, ["zeta_ids", "adv", "score"], layout="jagged")
    assert torch.equal(back["adv"].values(), back["zeta_ids"].values().float() * 0.5)
    assert back["adv"].offsets() is back["zeta_ids"].offsets()
    assert back["score"].tolist() == list(range(10))


def test_metrics_and_callback(plane, partition):
    seen = []
    plane.on_op = seen.append
    try:
        before = {op: dict(m) for op, m in plane.metrics.items()}
        wire, schema = every_kind_batch(6)
        meta = plane.put_samples(keys_for(6), partition, wire, schema=schema)
        plane.get_by_meta(meta, ["zeta_ids"])
        plane.clear_samples(meta.sample_ids, partition)
    finally:
        plane.on_op = None
    assert [r.op for r in seen] == ["put", "get", "clear"] and all(isinstance(r, DataPlaneOp) for r in seen)
    assert seen[1].nbytes == wire["zeta_ids"].values().nbytes + wire["zeta_ids"].offsets().nbytes
    assert plane.metrics["put"]["count"] == before.get("put", {}).get("count", 0) + 1
    assert plane.metrics["get"]["rows"] >= 6 and plane.metrics["get"]["seconds"] > 0


def test_puts_are_checked(plane, partition):
    wire, schema = every_kind_batch(3)
    with pytest.raises(DataPlaneError, match="is not registered"):
        plane.put_samples(keys_for(3), partition + "_other", wire)
    with pytest.raises(ValueError, match="expected 3 ids"):
        plane.put_samples(keys_for(2), partition, wire)
    with pytest.raises(ValueError, match="duplicates"):
        plane.put_samples(["a", "a", "b"], partition, wire)
    with pytest.raises(TypeError, match="fields: expected a TensorDict"):
        plane.put_samples(keys_for(3), partition, {"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="names starting with '_xdp:' are the store's own"):
        plane.put_samples(keys_for(3), partition, wire, tags=[{"_xdp:n:default": 1}] * 3)


def test_tags_only_puts_and_partition_declarations(plane, partition):
    plane.register_partition(partition, fields=["x"], num_samples=2, consumer_tasks=["train", "ref"], grpo_group_size=2)
    assert plane.partitions[partition] == PartitionInfo(partition, ("x",), 2, ("train", "ref"), 2, {})
    plane.put_samples(["a", "b"], partition, TensorDict({"x": torch.arange(2), "extra": torch.ones(2)}, batch_size=[2]))
    only_tags = plane.put_samples(["a", "b"], partition, tags=[{"r": 1}, {"r": 2}])   # no fields: the tags of the keys
    assert (only_tags.fields, only_tags.tags) == (None, [{"r": 1}, {"r": 2}])
    assert plane.get_samples(["b", "a"], partition, ["extra", "x"])["x"].tolist() == [1, 0]

# ------------------------------------------------------------------------------------------ the receipt alone


def test_receipt_is_small_and_tensor_free():
    meta = KVBatchMeta("p", "train", keys_for(64), schema=Schema([FieldSpec("ids", "token", torch.int64)]),
                       group_lengths={"default": long_tail_lengths(64, 4096, seed=0)}).with_tags(reward=torch.rand(64))
    blob = pickle.dumps(meta)
    assert b"_rebuild_tensor" not in blob and len(blob) < 4096
    assert pickle.loads(blob) == meta


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_presharding_balances_tokens_and_inverts_exactly(dp_size):
    n = 512
    meta = KVBatchMeta("p", None, keys_for(n), schema=Schema([FieldSpec("ids", "token", torch.int64, group="student")]),
                       group_lengths={"student": long_tail_lengths(n, 4096, seed=0)})
    shards, inverse = shard_meta_for_dp(meta, dp_world=dp_size)
    balance = shard_balance(shards)
    print(f"dp={dp_size}: tokens per rank {balance['tokens']}, max/mean {balance['max_over_mean']:.5f}")
    assert balance["max_over_mean"] < 1.01
    assert sorted(s.size for s in shards) == [n // dp_size] * dp_size
    assert sorted(k for s in shards for k in s.sample_ids) == sorted(meta.sample_ids)
    assert isinstance(inverse, list) and concat_metas(shards).subset(inverse) == meta.with_pad_target(1)
    values = torch.arange(n)
    assert torch.equal(torch.cat([values[torch.tensor([int(k[1:]) for k in s.sample_ids])] for s in shards])[inverse], values)


# ------------------------------------------------------------------------------------------ NeMo-RL's names


def nemo_style(n: int = 4, **kw) -> KVBatchMeta:
    "A receipt built the way NeMo-RL code builds one: keywords, no schema."
    return KVBatchMeta(partition_id="train", task_name="train", sample_ids=[f"s{i}" for i in range(n)],
                       fields=["input_ids", "advantages"], sequence_lengths=[10 + i for i in range(n)], **kw)


def test_receipt_has_nemo_rl_attributes_and_defaults():
    bare = KVBatchMeta(partition_id="p", task_name="t", sample_ids=[])
    assert (bare.size, bare.fields, bare.sequence_lengths, bare.extra_info, bare.tags) == (0, None, None, {}, None)
    assert bare.extra_info is not KVBatchMeta(partition_id="p", task_name="t", sample_ids=[]).extra_info
    with pytest.raises(TypeError):
        KVBatchMeta(task_name="t", sample_ids=[])   # the partition is required
    meta = nemo_style(extra_info={"step": 5})
    assert pickle.loads(pickle.dumps(meta)) == meta and meta.size == 4
    with pytest.raises(ValueError, match="align 1:1"):
        nemo_style(tags=[{"x": 1}])
    with pytest.raises(ValueError, match="duplicates"):   # ours: a key twice is refused when the receipt is built
        KVBatchMeta(partition_id="p", task_name="t", sample_ids=["a", "a"])


def test_receipt_operations_carry_tags_and_lengths():
    meta = nemo_style(tags=[{"std": 0.1}, {"std": 0.0}, {"std": 0.3}, {"std": 0.0}])
    kept = meta.subset([0, 2])
    assert (kept.sample_ids, kept.sequence_lengths, kept.tags) == (["s0", "s2"], [10, 12], [{"std": 0.1}, {"std": 0.3}])
    joined = meta.slice(0, 2).concat(meta.slice(2, 4))
    assert (joined.sample_ids, joined.tags, joined.sequence_lengths) == (meta.sample_ids, meta.tags, meta.sequence_lengths)
    assert meta.slice(0, 1).concat(nemo_style(2).slice(1, 2)).tags is None   # one side without tags: none
    left = meta.drop([3, 1, 1])
    assert (left.sample_ids, left.sequence_lengths, left.tags) == (["s0", "s2"], [10, 12], [{"std": 0.1}, {"std": 0.3}])
    assert meta.drop(range(4)) is None and meta.drop([]) == meta and meta.drop([]) is not meta
    other = KVBatchMeta(partition_id="other", task_name="train", sample_ids=["x"])
    with pytest.raises(ValueError, match="partition_ids must match"):
        meta.concat(other)


def test_with_fields_adds_names_to_an_independent_copy():
    meta = nemo_style(2, extra_info={"step": 0}, tags=[{"x": 1}, {"x": 2}])
    out = meta.with_fields(["advantages", "logprobs", "logprobs"])
    assert out.fields == ["input_ids", "advantages", "logprobs"]
    out.sample_ids.append("s9"); out.sequence_lengths.append(3); out.extra_info["step"] = 9; out.tags[0]["x"] = 99
    assert (meta.sample_ids, meta.sequence_lengths, meta.extra_info, meta.tags) == (
        ["s0", "s1"], [10, 11], {"step": 0}, [{"x": 1}, {"x": 2}])
    assert KVBatchMeta(partition_id="p", task_name=None, sample_ids=["a"]).with_fields(["y", "x", "y"]).fields == ["y", "x"]


def test_stamp_tags_writes_in_place():
    meta = nemo_style(3)
    assert meta.stamp_tags({"std": torch.tensor([0.0, 0.5, 1.0]), "version": [1, 1, 2]}) is None
    assert meta.tags == [{"std": 0.0, "version": 1}, {"std": 0.5, "version": 1}, {"std": 1.0, "version": 2}]
    with pytest.raises(ValueError, match="expected 3 values"):
        meta.stamp_tags({"std": [1.0]})


def test_errors_are_what_nemo_rl_callers_catch(plane, partition):
    plane.put_samples(["a"], partition, TensorDict({"x": torch.arange(1)}, batch_size=[1]))
    for read in (lambda: plane.get_samples(["a", "zz"], partition, ["x"]), lambda: plane.get_samples(["a"], partition, ["y"], timeout_s=0)):
        with pytest.raises(KeyError):
            read()
    with pytest.raises(ValueError):
        plane.put_samples(["a", "a"], partition, TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    with pytest.raises(FieldSelectionError) as e:
        plane.get_samples(["a"], partition, None)
    assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)
    assert str(e.value).startswith("select_fields")   # our message, not a KeyError's quoted repr


def test_object_columns_are_carried():
    "NeMo-RL refuses non-tensor leaves; the wire format here carries object columns as they are."
    with InProcessDataPlane() as plane:
        plane.register_partition("p")
        plane.put_samples(["a"], "p", TensorDict({"note": NonTensorData("hello")}, batch_size=[1]))
        assert plane.get_samples(["a"], "p", ["note"])["note"].tolist() == ["hello"]


def test_build_data_plane_client():
    with pytest.raises(ValueError, match="enabled=True"):
        build_data_plane_client({"enabled": False, "impl": "transfer_queue"})
    with pytest.raises(ValueError, match="enabled=True"):
        build_data_plane_client(None)
    with pytest.raises(ValueError, match="impl: expected 'transfer_queue' or 'in_process', got 'noop'"):
        build_data_plane_client({"enabled": True, "impl": "noop"})
    with pytest.raises(ValueError, match=r"unknown config keys \['storage_capacty'\]"):
        build_data_plane_client({"enabled": True, "impl": "in_process", "storage_capacty": 8})
    seen = []
    cfg = {"enabled": True, "impl": "in_process", "backend": "simple", "storage_capacity": 1024, "num_storage_units": 1,
           "claim_meta_poll_interval_s": 0.25, "global_segment_size": 1, "local_buffer_size": 1, "timeout_s": 2.0,
           "observability": {"enabled": True, "callback": seen.append}}
    with build_data_plane_client(cfg) as client:
        client.register_partition("p", fields=["x"], num_samples=1, consumer_tasks=["read"])
        client.put_samples(["a"], "p", TensorDict({"x": torch.ones(1)}, batch_size=[1]))
    assert isinstance(client, InProcessDataPlane) and (client.poll_s, client.timeout_s) == (0.25, 2.0)
    assert [op.op for op in seen] == ["put"]


def test_build_data_plane_client_attaches_to_the_running_store(tq_plane):
    partition = f"cfg_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    tq_plane.put_samples(["a", "b"], partition, TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    with build_data_plane_client({"enabled": True, "impl": "transfer_queue"}, bootstrap=False) as worker:
        assert isinstance(worker, TransferQueueDataPlane) and not worker.bootstrap
        assert worker.get_samples(["b", "a"], partition, ["x"])["x"].tolist() == [1, 0]
    assert tq_plane.get_samples(["a"], partition, ["x"])["x"].tolist() == [0]   # the worker's close left the store running
    tq_plane.clear_samples(["a", "b"], partition)


def test_shard_meta_for_dp_returns_metas_and_an_inverse_or_none():
    meta = nemo_style(8)
    metas, inverse = shard_meta_for_dp(meta, dp_world=4, batch_size=8)
    assert [m.size for m in metas] == [2] * 4 and all(m.partition_id == "train" for m in metas)
    flat = [k for m in metas for k in m.sample_ids]
    assert sorted(flat) == sorted(meta.sample_ids)
    restored = torch.tensor([meta.sample_ids.index(k) for k in flat])[torch.tensor(inverse)]
    assert restored.tolist() == list(range(8))
    assert shard_meta_for_dp(meta.slice(0, 1), dp_world=2).inverse is None   # nothing moved
    per_step = shard_meta_for_dp(meta, dp_world=2, batch_size=4).metas
    assert all(set(m.sample_ids[:2]) <= {"s0", "s1", "s2", "s3"} for m in per_step)   # the first global batch first
    with pytest.raises(ValueError, match="a divisor of the 8 rows"):
        shard_meta_for_dp(meta, dp_world=2, batch_size=3)


def test_column_io_under_nemo_rl_argument_names(plane, partition):
    meta = plane.put_samples(["a", "b"], partition, pack_jagged_fields({"ids": torch.tensor([[1, 2], [3, 0]])},
                                                                        lengths=torch.tensor([2, 1])))
    meta = write_columns(plane, meta, fields={"adv": torch.tensor([[.5, .5], [1., 0.]])})
    cols = read_columns(plane, meta, select_fields=["ids", "adv"])
    assert cols["adv"].tolist() == [[.5, .5], [1., 0.]] and cols["ids"].tolist() == [[1, 2], [3, 0]]
    names_only = KVBatchMeta(partition_id=partition, task_name="train", sample_ids=["b"], fields=["adv"])
    assert read_columns(plane, names_only, select_fields=["adv"])["adv"].tolist() == [[1.0]]


# ------------------------------------------------------------------------------------------ the forms before this release


def deprecated(match: str):
    "Expect one DeprecationWarning whose text shows the call to write instead, pointing at the caller's line."
    return pytest.warns(DeprecationWarning, match=match)


def test_old_calls_warn_and_still_work(plane, partition):
    wire = pack_jagged_fields({"ids": torch.tensor([[1, 2, 3], [4, 0, 0]])}, lengths=torch.tensor([3, 1]))
    with deprecated(r"write put_samples\(keys, '" + partition + r"', wire_td\)") as rec:
        meta = plane.put_samples(partition, ["a", "b"], wire, [{"r": 1}, {"r": 2}])
    assert rec[0].filename == __file__   # the warning names the caller's line, not the library's
    assert (meta.sample_ids, meta.tags) == (["a", "b"], [{"r": 1}, {"r": 2}])
    with deprecated(r"write put_samples\(keys,"):
        plane.put_samples(partition_id=partition, keys=["c"], wire_td=wire[:1])
    with deprecated(r"write get_by_meta\(meta, select_fields\)") as rec:
        got = plane.get_samples(meta, ["ids"])
    assert rec[0].filename == __file__ and got["ids"].offsets().tolist() == [0, 3, 4]
    with deprecated(r"write meta.sample_ids"):
        assert meta.keys == ("a", "b")
    with deprecated(r"write meta.group_lengths"):
        assert meta.seqlens == {"default": (3, 1)}
    with deprecated(r"write clear_samples\(meta.sample_ids, meta.partition_id\)"):
        plane.clear_samples(meta)
    with pytest.raises(KeyError):
        plane.get_samples(["a"], partition, ["ids"])


def test_old_receipt_forms_warn_and_still_work():
    schema = Schema([FieldSpec("ids", "token", torch.int64)])
    new = KVBatchMeta("p", "train", ["a", "b"], schema=schema, group_lengths={"default": [3, 1]}, tags=[{"r": 1}, {"r": 2}],
                      extra_info={"e": 1})
    with deprecated(r"write KVBatchMeta\(partition_id, task_name, sample_ids, schema=..., group_lengths=...\)") as rec:
        old = KVBatchMeta("p", ["a", "b"], schema, {"default": [3, 1]}, [{"r": 1}, {"r": 2}], "train", {"e": 1})
    assert rec[0].filename == __file__ and old == new
    with deprecated("write KVBatchMeta"):
        assert KVBatchMeta("p", keys=["a", "b"], schema=schema, seqlens={"default": [3, 1]}).group_lengths == new.group_lengths
    other = KVBatchMeta("p", "train", ["c"], schema=schema, group_lengths={"default": [2]})
    with deprecated(r"write a.concat\(b, ...\) or concat_metas"):
        assert KVBatchMeta.concat([new, other]) == new.concat(other)
    adv = KVBatchMeta("p", "train", ["b", "a"], schema=Schema([FieldSpec("adv", "sample", torch.float32)]))
    with deprecated(r"write meta.merge_written\(written\)"):
        assert new.with_fields(adv) == new.merge_written(adv)
    with deprecated(r"write meta.drop_fields\('adv'\)"):
        assert new.merge_written(adv).drop("adv") == new
    with deprecated(r"write meta.with_tags\(name=values\)"):
        assert new.stamp_tags(step=3) == new.with_tags(step=3)
    assert new.tags == [{"r": 1}, {"r": 2}]   # the old form returned a copy, and still does


def test_old_sharding_and_column_forms_warn_and_still_work(plane, partition):
    meta = plane.put_samples(["a", "b", "c"], partition, pack_jagged_fields(
        {"ids": torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]])}, lengths=torch.tensor([3, 1, 2])))
    with deprecated(r"write shard_meta_for_dp\(meta, dp_world=2\)") as rec:
        old = shard_meta_for_dp(meta, 2)
    assert rec[0].filename == __file__
    new = shard_meta_for_dp(meta, dp_world=2)
    assert old.metas == new.metas and isinstance(old.inverse, torch.Tensor)
    assert old.inverse.tolist() == (new.inverse if new.inverse is not None else [0, 1, 2])   # None: the order was kept
    with deprecated(r"write read_columns\(..., select_fields=...\)") as rec:
        assert read_columns(plane, meta, fields=["ids"])["ids"].shape == (3, 3)
    assert rec[0].filename == __file__
    with deprecated(r"write write_columns\(..., fields=...\)"):
        assert write_columns(plane, meta, columns={"r": torch.ones(3)}).fields == ["ids", "r"]


def test_test_helpers_resolve_to_this_folder():
    "TransferQueue installs top-level `tests`/`scripts` packages: our helper modules must still be ours."
    import conftest
    import losses_helpers
    assert Path(conftest.__file__).resolve().parent == TESTS
    assert Path(losses_helpers.__file__).resolve().parent == TESTS

# ------------------------------------------------------------------------------------------ TransferQueue only


def _driver_batch(plane, partition: str, n: int):
    wire, schema = every_kind_batch(n)
    return plane.put_samples(keys_for(n), partition, wire, schema=schema), wire


def test_workers_attach_read_their_shard_and_write_back(tq_plane, tmp_path):
    partition = f"w_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    meta, wire = _driver_batch(tq_plane, partition, 12)
    shards, inverse = shard_meta_for_dp(meta, dp_world=2, group="student")
    assert not set(shards[0].sample_ids) & set(shards[1].sample_ids)
    tasks = [WorkerTask(tq_plane.ray_address, s, str(tmp_path / f"rank{r}"), source="zeta_ids", target="doubled", steps=2)
             for r, s in enumerate(shards)]
    procs = [spawn_worker(t, stdout=-1, stderr=-1) for t in tasks]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-3000:]
    written = [concat_metas(read_acks(t.workdir)) for t in tasks]
    assert [w.sample_ids for w in written] == [s.sample_ids for s in shards]
    gathered = meta.merge_written(concat_metas(written).subset(inverse))
    back = tq_plane.get_by_meta(gathered, ["zeta_ids", "doubled"])
    assert torch.equal(back["doubled"].values(), wire["zeta_ids"].values() * 2)
    assert back["doubled"].offsets() is back["zeta_ids"].offsets()
    tq_plane.clear_samples(meta.sample_ids, partition)


def test_a_killed_worker_loses_nothing_it_acknowledged(tq_plane, tmp_path):
    partition = f"kill_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    meta, wire = _driver_batch(tq_plane, partition, 8)
    task = WorkerTask(tq_plane.ray_address, meta, str(tmp_path / "w"), source="zeta_ids", target="doubled", steps=2, hold_after=0)
    proc = spawn_worker(task, stdout=-1, stderr=-1)
    try:
        deadline = time.monotonic() + 180
        while not (Path(task.workdir) / "ack_0.pkl").exists():
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the worker never acknowledged its first put"
            time.sleep(0.1)
    finally:
        proc.kill()   # mid-step: after acknowledging one put, before its next
        proc.wait(timeout=60)
    acked = read_acks(task.workdir)
    assert len(acked) == 1 and acked[0].sample_ids == meta.sample_ids[:4]
    back = tq_plane.get_by_meta(acked[0], ["zeta_ids", "doubled"])
    assert torch.equal(back["doubled"].values(), back["zeta_ids"].values() * 2)
    rest = meta.slice(4).merge_written(KVBatchMeta(partition, None, meta.sample_ids[4:], schema=Schema([acked[0].schema["doubled"]]),
                                                   group_lengths={"student": meta.group_lengths["student"][4:]}))
    with pytest.raises(MissingFieldsError, match=r"'doubled' missing for keys \['k4', 'k5', 'k6', 'k7'\]"):
        tq_plane.get_by_meta(rest, ["doubled"], timeout_s=0.2)
    tq_plane.clear_samples(meta.sample_ids, partition)


def test_a_second_bootstrap_is_refused(tq_plane):
    with pytest.raises(DataPlaneError, match="already runs on this Ray: attach with bootstrap=False"):
        TransferQueueDataPlane(bootstrap=True)


def test_a_store_that_does_not_answer_is_a_timeout_error(tq_plane):
    partition = f"slow_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    wire, schema = every_kind_batch(4)
    saved, tq_plane.request_timeout_s = tq_plane.request_timeout_s, 1e-6
    try:
        with pytest.raises(DataPlaneError, match=r"did not answer (kv_retrieve_meta|kv_batch_put) within 1e-06 s"):
            tq_plane.put_samples(keys_for(4), partition, wire, schema=schema)
    finally:
        tq_plane.request_timeout_s = saved
    meta = tq_plane.put_samples(keys_for(4), partition, wire, schema=schema)   # the client still works afterwards
    assert_same_wire(tq_plane.get_by_meta(meta, schema.names), wire, schema)
    tq_plane.clear_samples(meta.sample_ids, partition)


def test_a_hand_made_receipt_with_other_lengths_is_refused(plane, partition):
    "A receipt without generations is still checked against what the store holds: other row lengths are refused."
    meta = plane.put_samples(["x", "y"], partition, pack_jagged_fields({"ids": torch.ones(2, 3, dtype=torch.int64)},
                                                                       lengths=torch.tensor([3, 1])))
    wrong = KVBatchMeta(partition, None, ["x", "y"], schema=meta.schema, group_lengths={"default": [1, 3]})
    with pytest.raises(DataPlaneError, match="row lengths differ from the receipt's group 'default'"):
        plane.get_by_meta(wrong, ["ids"])


# ------------------------------------------------------------------------------------------ policies that catch mistakes


def ids_batch(values, lengths):
    return pack_jagged_fields({"ids": torch.tensor(values)}, lengths=torch.tensor(lengths))


def test_writing_over_existing_fields_needs_overwrite(plane, partition):
    meta = plane.put_samples(["x", "y"], partition, ids_batch([[1, 2, 3], [4, 0, 0]], [3, 1]))
    with pytest.raises(OverwriteError, match=r"'ids' is already held by keys \['y'\]; pass overwrite=True") as e:
        plane.put_samples(["y", "z"], partition, ids_batch([[7, 0], [8, 8]], [1, 2]))
    assert (e.value.fields, e.value.keys) == (("ids",), ("y",))
    assert plane.get_by_meta(meta, ["ids"])["ids"].values().tolist() == [1, 2, 3, 4]   # nothing was written
    with pytest.raises(KeyError):
        plane.get_samples(["z"], partition, ["ids"])
    with pytest.raises(OverwriteError, match="token group 'default' has other row lengths for keys"):   # a new field, other lengths
        plane.put_samples(["x"], partition, pack_jagged_fields({"m": torch.ones(1, 2, dtype=torch.bool)},
                                                               lengths=torch.tensor([2]), token_aligned_fields=["m"]))
    back = write_columns(plane, meta, {"score": torch.tensor([0.5, 1.5])})   # new fields on existing keys: no overwrite
    assert plane.get_by_meta(back, ["ids", "score"])["score"].tolist() == [0.5, 1.5]


def test_a_receipt_read_after_an_overwrite_is_stale(plane, partition):
    "Same lengths, new values: without generations the old receipt would silently read the new values."
    old = plane.put_samples(["x", "y"], partition, ids_batch([[1, 2], [3, 4]], [2, 2]))
    new = plane.put_samples(["y"], partition, ids_batch([[30, 40]], [2]), overwrite=True)
    with pytest.raises(StaleReceiptError, match=r"sample ids \['y'\] in partition '.*' were written again") as e:
        plane.get_by_meta(old, ["ids"])
    assert e.value.keys == ("y",)
    with pytest.raises(StaleReceiptError):
        read_columns(plane, old, ["ids"])
    assert plane.get_by_meta(new, ["ids"])["ids"].values().tolist() == [30, 40]
    assert plane.get_by_meta(old.subset([0]), ["ids"])["ids"].values().tolist() == [1, 2]   # 'x' was not written again
    assert plane.get_samples(["x", "y"], partition, ["ids"])["ids"].values().tolist() == [1, 2, 30, 40]
    with pytest.raises(StaleReceiptError):   # two generations of 'y' do not merge
        old.subset([1]).merge_written(new)
    plane.clear_samples(["x"], partition)   # cleared and written again: also a new generation
    again = plane.put_samples(["x"], partition, ids_batch([[5, 6]], [2]))
    with pytest.raises(StaleReceiptError):
        plane.get_by_meta(old.subset([0]), ["ids"])
    assert again.generations != old.subset([0]).generations


def test_an_unknown_partition_is_an_immediate_typed_error(plane, partition):
    unknown = f"nope_{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    with pytest.raises(UnknownPartitionError, match=f"partition '{unknown}' is unknown") as e:
        plane.get_samples(["a"], unknown, ["x"], timeout_s=60)
    assert isinstance(e.value, KeyError) and e.value.partition_id == unknown
    receipt = KVBatchMeta(unknown, None, ["a"], schema=Schema([FieldSpec("x", "sample", torch.int64)]))
    with pytest.raises(UnknownPartitionError):
        plane.get_by_meta(receipt, ["x"], timeout_s=60)
    for clear in (lambda: plane.clear_samples(["a"], unknown), lambda: plane.clear_samples(None, unknown),
                  lambda: plane.clear_samples(["a"], unknown, missing_ok=True)):
        with pytest.raises(UnknownPartitionError):
            clear()
    assert time.monotonic() - start < 30   # none of them waited for the 60 s timeout
    with pytest.raises(MissingKeysError) as e:   # a partition that exists, keys that do not: not a partition error
        plane.get_samples(["a"], partition, ["x"])
    assert not isinstance(e.value, UnknownPartitionError)
    with pytest.raises(UnknownPartitionError, match="call register_partition first"):
        plane.put_samples(["a"], unknown, TensorDict({"x": torch.arange(1)}, batch_size=[1]))


def test_clearing_keys_that_are_not_there(plane, partition):
    plane.put_samples(["a", "b"], partition, TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    with pytest.raises(MissingKeysError, match=r"sample ids \['zz'\] are not in the store") as e:
        plane.clear_samples(["a", "zz"], partition)
    assert e.value.keys == ("zz",)
    assert plane.get_samples(["a"], partition, ["x"])["x"].tolist() == [0]   # a refused clear frees nothing
    plane.clear_samples(["a", "zz"], partition, missing_ok=True)   # frees 'a', skips 'zz'
    with pytest.raises(MissingKeysError):
        plane.get_samples(["a"], partition, ["x"])
    assert plane.get_samples(["b"], partition, ["x"])["x"].tolist() == [1]
    plane.clear_samples(["b"], partition)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attaching_where_nothing_listens_fails_with_the_address():
    "Run in a fresh interpreter: this test session's Ray is already connected, and a connected process never attaches."
    address = f"127.0.0.1:{free_port()}"
    code = ("from xtoken_dp.dataplane import AttachError, TransferQueueDataPlane\n"
            "try: TransferQueueDataPlane(bootstrap=False, ray_address=%r, attach_timeout_s=5)\n"
            "except AttachError as e: print('AttachError:', e)\n" % address)
    pytest.importorskip("transfer_queue")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"AttachError: ray_address='{address}': nothing answers at {address} within 5 s" in out.stdout
    with pytest.raises(ValueError, match="attach_timeout_s: expected a number > 0, got 0"):
        TransferQueueDataPlane(bootstrap=False, attach_timeout_s=0)


def test_rows_travel_as_raw_bytes_and_reads_accept_either_format(tq_plane):
    "Tensor fields are stored as one bytes object per row (raw values); rows stored as tensors are read back too."
    partition = f"fmt_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    wire, schema = every_kind_batch(6)
    meta = tq_plane.put_samples(keys_for(6), partition, wire, schema=schema)
    raw = tq_plane.tq.kv_batch_get(keys=keys_for(6), partition_id=partition, select_fields=["zeta_ids", "reward"])
    rows = raw.get("zeta_ids").tolist()
    lengths = wire["zeta_ids"].offsets().diff().tolist()
    assert [len(r) for r in rows] == [8 * n for n in lengths]
    assert b"".join(rows) == wire["zeta_ids"].values().numpy().tobytes()
    assert [len(r) for r in raw.get("reward").tolist()] == [4] * 6
    saved = tq_plane.row_format
    try:
        tq_plane.row_format = "tensors"
        tensor_meta = tq_plane.put_samples(keys_for(6, "t"), partition, wire, schema=schema)
    finally:
        tq_plane.row_format = saved
    assert isinstance(tq_plane.tq.kv_batch_get(keys=keys_for(6, "t"), partition_id=partition,
                                               select_fields=["zeta_ids"]).get("zeta_ids"), torch.Tensor)
    assert_same_wire(tq_plane.get_by_meta(tensor_meta, schema.names), wire, schema)
    assert_same_wire(tq_plane.get_samples(keys_for(6, "t"), partition, schema.names), wire, schema)
    tq_plane.clear_samples(meta.sample_ids, partition)
    tq_plane.clear_samples(tensor_meta.sample_ids, partition)


def test_row_format_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match=r"row_format: expected one of \('bytes', 'tensors'\), got 'pickle'"):
        TransferQueueDataPlane(row_format="pickle")
