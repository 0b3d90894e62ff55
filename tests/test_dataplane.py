"""The data plane: one battery run against both adapters (the in-process reference and TransferQueue on the test
session's local Ray), plus what only the real store can show: worker processes that attach, read their shard by key
and write back, and a worker killed between two writes.

TransferQueue starts once per test session (`tq_plane`) and is stopped at the end, with a check that none of its
services is left running. Every test uses its own partition.
"""
import pickle
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from xtoken_dp.codec import long_tail_lengths, pack_jagged_fields
from xtoken_dp.dataplane import (DataPlaneError, DataPlaneOp, InProcessDataPlane, KVBatchMeta, MissingFieldsError,
                                 TransferQueueDataPlane, WorkerTask, read_acks, read_columns, shard_balance,
                                 shard_meta_for_dp, spawn_worker, write_columns)
from xtoken_dp.schema import FieldSpec, Schema

TESTS = Path(__file__).resolve().parent
WAIT_S = 0.4  # the bounded wait of the clients under test


@pytest.fixture(scope="session")
def tq_plane(ray_session):
    pytest.importorskip("transfer_queue")
    plane = TransferQueueDataPlane(bootstrap=True, timeout_s=WAIT_S)
    yield plane
    plane.close()
    left = [a for a in ray_session.util.list_named_actors(all_namespaces=True) if a.get("namespace") == "transfer_queue"]
    assert not left, f"TransferQueue services still running after close(): {left}"


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
    meta = plane.put_samples(partition, keys_for(9), wire, tags=[{"i": i} for i in range(9)], schema=schema)
    assert meta.fields == schema.names and meta.seqlens["student"][0] == 0
    got = plane.get_samples(meta, list(reversed(schema.names)))   # asked in another order: returned as written
    assert_same_wire(got, wire, schema)


def test_rows_by_key_in_any_order(plane, partition):
    wire, schema = every_kind_batch(9)
    meta = plane.put_samples(partition, keys_for(9), wire, schema=schema)
    rows = [8, 0, 4]
    want, _ = every_kind_batch(9, rows)
    assert_same_wire(plane.get_samples(meta.subset(rows), schema.names), want, schema)
    one = plane.get_samples(meta.subset([2]), ["teacher_ids", "meta"])
    assert list(one.keys()) == ["teacher_ids", "meta"]


def test_empty_batch_and_empty_rows(plane, partition):
    wire, schema = every_kind_batch(0)
    meta = plane.put_samples(partition, [], wire, schema=schema)
    assert len(meta) == 0
    assert_same_wire(plane.get_samples(meta, schema.names), wire, schema)
    zeros = pack_jagged_fields({"ids": torch.zeros(3, 4, dtype=torch.int64), "w": torch.ones(3, 4, dtype=torch.bool)},
                               lengths=torch.zeros(3, dtype=torch.int64), token_aligned_fields=["ids", "w"])
    meta = plane.put_samples(partition, keys_for(3, "z"), zeros)
    got = plane.get_samples(meta, ["ids", "w"])
    assert_same_wire(got, zeros, meta.schema)
    assert got["ids"]._max_seqlen == 0


def test_field_nobody_wrote_is_a_typed_error(plane, partition):
    wire, schema = every_kind_batch(4)
    meta = plane.put_samples(partition, keys_for(4), wire, schema=schema)
    with pytest.raises(MissingFieldsError, match=r"\['advantage'\] are not in the receipt of keys \['k0', 'k1', 'k2', 'k3'\]") as e:
        plane.get_samples(meta, ["reward", "advantage"])
    assert e.value.fields == ("advantage",) and e.value.keys == tuple(keys_for(4))
    with pytest.raises(TypeError, match="fetching every field is refused"):
        plane.get_samples(meta, None)
    # a receipt that promises a field the store never got: a bounded wait, then the field and the keys
    promised = KVBatchMeta(partition, keys_for(2, "ghost"), Schema([FieldSpec("reward", "sample", torch.float32)]))
    start = time.monotonic()
    with pytest.raises(MissingFieldsError, match=r"after waiting 0.4 s, 'reward' missing for keys \['ghost0', 'ghost1'\]"):
        plane.get_samples(promised, ["reward"])
    assert time.monotonic() - start < 30   # bounded (a hang would never get here)


def test_clearing_frees_the_keys(plane, partition):
    wire, schema = every_kind_batch(5)
    meta = plane.put_samples(partition, keys_for(5), wire, schema=schema)
    plane.clear_samples(meta.slice(0, 2))
    with pytest.raises(MissingFieldsError, match=r"'reward' missing for keys \['k0', 'k1'\]"):
        plane.get_samples(meta, ["reward"], timeout_s=0.1)
    assert plane.get_samples(meta.slice(2), ["reward"])["reward"].shape == (3,)
    again, _ = every_kind_batch(2, seed=1)
    meta2 = plane.put_samples(partition, keys_for(2), again, schema=schema)   # freed keys can be written afresh
    assert_same_wire(plane.get_samples(meta2, schema.names), again, schema)
    plane.clear_samples(meta)
    with pytest.raises(MissingFieldsError):
        plane.get_samples(meta, ["reward"], timeout_s=0)


def test_write_back_and_padded_reads_agree_across_ranks(plane, partition):
    wire, schema = every_kind_batch(10)
    meta = plane.put_samples(partition, keys_for(10), wire, schema=schema)
    shards, inverse = shard_meta_for_dp(meta, 3, group="student", pad_multiple=8)
    cols = [read_columns(plane, s, ["zeta_ids", "mask", "teacher_ids", "box"]) for s in shards]
    assert len({c["zeta_ids"].shape[1:] for c in cols}) == 1 and len({c["teacher_ids"].shape[1:] for c in cols}) == 1
    assert cols[0]["zeta_ids"].shape[1] % 8 == 0 and cols[0]["box"].shape[1:] == (3,)
    written = [write_columns(plane, s, {"adv": c["zeta_ids"].float() * 0.5,
                                        "score": torch.tensor([float(k[1:]) for k in s.keys])}, schema=Schema([
        FieldSpec("adv", "token", torch.float32, group="student"), FieldSpec("score", "sample", torch.float32)]))
        for s, c in zip(shards, cols)]
    gathered = meta.with_fields(KVBatchMeta.concat(written).subset(inverse))
    assert gathered.fields == (*schema.names, "adv", "score")
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
        meta = plane.put_samples(partition, keys_for(6), wire, schema=schema)
        plane.get_samples(meta, ["zeta_ids"])
        plane.clear_samples(meta)
    finally:
        plane.on_op = None
    assert [r.op for r in seen] == ["put", "get", "clear"] and all(isinstance(r, DataPlaneOp) for r in seen)
    assert seen[1].nbytes == wire["zeta_ids"].values().nbytes + wire["zeta_ids"].offsets().nbytes
    assert plane.metrics["put"]["count"] == before.get("put", {}).get("count", 0) + 1
    assert plane.metrics["get"]["rows"] >= 6 and plane.metrics["get"]["seconds"] > 0


def test_puts_are_checked(plane, partition):
    wire, schema = every_kind_batch(3)
    with pytest.raises(DataPlaneError, match="is not registered"):
        plane.put_samples(partition + "_other", keys_for(3), wire)
    with pytest.raises(ValueError, match="expected 3 keys"):
        plane.put_samples(partition, keys_for(2), wire)
    with pytest.raises(ValueError, match="duplicates"):
        plane.put_samples(partition, ["a", "a", "b"], wire)
    with pytest.raises(TypeError, match="wire_td: expected a TensorDict"):
        plane.put_samples(partition, keys_for(3), {"x": torch.zeros(3)})

# ------------------------------------------------------------------------------------------ the receipt alone


def test_receipt_is_small_and_tensor_free():
    meta = KVBatchMeta("p", keys_for(64), Schema([FieldSpec("ids", "token", torch.int64)]),
                       {"default": long_tail_lengths(64, 4096, seed=0)}).stamp_tags(reward=torch.rand(64))
    blob = pickle.dumps(meta)
    assert b"_rebuild_tensor" not in blob and len(blob) < 4096
    assert pickle.loads(blob) == meta


@pytest.mark.parametrize("dp_size", [2, 4, 8])
def test_presharding_balances_tokens_and_inverts_exactly(dp_size):
    n = 512
    meta = KVBatchMeta("p", keys_for(n), Schema([FieldSpec("ids", "token", torch.int64, group="student")]),
                       {"student": long_tail_lengths(n, 4096, seed=0)})
    shards, inverse = shard_meta_for_dp(meta, dp_size)
    balance = shard_balance(shards)
    print(f"dp={dp_size}: tokens per rank {balance['tokens']}, max/mean {balance['max_over_mean']:.5f}")
    assert balance["max_over_mean"] < 1.01
    assert sorted(len(s) for s in shards) == [n // dp_size] * dp_size
    assert sorted(k for s in shards for k in s.keys) == sorted(meta.keys)
    assert KVBatchMeta.concat(shards).subset(inverse) == meta.with_pad_target(1)
    values = torch.arange(n)
    assert torch.equal(torch.cat([values[torch.tensor([int(k[1:]) for k in s.keys])] for s in shards])[inverse], values)


def test_test_helpers_resolve_to_this_folder():
    "TransferQueue installs top-level `tests`/`scripts` packages: our helper modules must still be ours."
    import conftest
    import losses_helpers
    assert Path(conftest.__file__).resolve().parent == TESTS
    assert Path(losses_helpers.__file__).resolve().parent == TESTS

# ------------------------------------------------------------------------------------------ TransferQueue only


def _driver_batch(plane, partition: str, n: int):
    wire, schema = every_kind_batch(n)
    return plane.put_samples(partition, keys_for(n), wire, schema=schema), wire


def test_workers_attach_read_their_shard_and_write_back(tq_plane, tmp_path):
    partition = f"w_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    meta, wire = _driver_batch(tq_plane, partition, 12)
    shards, inverse = shard_meta_for_dp(meta, 2, group="student")
    assert not set(shards[0].keys) & set(shards[1].keys)
    tasks = [WorkerTask(tq_plane.ray_address, s, str(tmp_path / f"rank{r}"), source="zeta_ids", target="doubled", steps=2)
             for r, s in enumerate(shards)]
    procs = [spawn_worker(t, stdout=-1, stderr=-1) for t in tasks]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-3000:]
    written = [KVBatchMeta.concat(read_acks(t.workdir)) for t in tasks]
    assert [w.keys for w in written] == [s.keys for s in shards]
    gathered = meta.with_fields(KVBatchMeta.concat(written).subset(inverse))
    back = tq_plane.get_samples(gathered, ["zeta_ids", "doubled"])
    assert torch.equal(back["doubled"].values(), wire["zeta_ids"].values() * 2)
    assert back["doubled"].offsets() is back["zeta_ids"].offsets()
    tq_plane.clear_samples(meta)


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
    assert len(acked) == 1 and acked[0].keys == meta.keys[:4]
    back = tq_plane.get_samples(acked[0], ["zeta_ids", "doubled"])
    assert torch.equal(back["doubled"].values(), back["zeta_ids"].values() * 2)
    rest = meta.slice(4).with_fields(KVBatchMeta(partition, meta.keys[4:], Schema([acked[0].schema["doubled"]]),
                                                 {"student": meta.seqlens["student"][4:]}))
    with pytest.raises(MissingFieldsError, match=r"'doubled' missing for keys \['k4', 'k5', 'k6', 'k7'\]"):
        tq_plane.get_samples(rest, ["doubled"], timeout_s=0.2)
    tq_plane.clear_samples(meta)


def test_a_second_bootstrap_is_refused(tq_plane):
    with pytest.raises(DataPlaneError, match="already runs on this Ray: attach with bootstrap=False"):
        TransferQueueDataPlane(bootstrap=True)


def test_a_store_that_does_not_answer_is_a_timeout_error(tq_plane):
    partition = f"slow_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    wire, schema = every_kind_batch(4)
    saved, tq_plane.request_timeout_s = tq_plane.request_timeout_s, 1e-6
    try:
        with pytest.raises(DataPlaneError, match=r"did not answer kv_batch_put within 1e-06 s"):
            tq_plane.put_samples(partition, keys_for(4), wire, schema=schema)
    finally:
        tq_plane.request_timeout_s = saved
    meta = tq_plane.put_samples(partition, keys_for(4), wire, schema=schema)   # the client still works afterwards
    assert_same_wire(tq_plane.get_samples(meta, schema.names), wire, schema)
    tq_plane.clear_samples(meta)


def test_a_stale_receipt_is_refused(plane, partition):
    "Rows rewritten with other lengths after the receipt was issued: the old receipt no longer describes them."
    first = pack_jagged_fields({"ids": torch.ones(2, 3, dtype=torch.int64)}, lengths=torch.tensor([3, 1]))
    meta = plane.put_samples(partition, ["x", "y"], first)
    plane.put_samples(partition, ["x", "y"], pack_jagged_fields({"ids": torch.ones(2, 3, dtype=torch.int64)},
                                                                lengths=torch.tensor([1, 3])))
    with pytest.raises(DataPlaneError, match="row lengths differ from the receipt's group 'default'"):
        plane.get_samples(meta, ["ids"])


def test_rows_travel_as_raw_bytes_and_reads_accept_either_format(tq_plane):
    "Tensor fields are stored as one bytes object per row (raw values); rows stored as tensors are read back too."
    partition = f"fmt_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    wire, schema = every_kind_batch(6)
    meta = tq_plane.put_samples(partition, keys_for(6), wire, schema=schema)
    raw = tq_plane.tq.kv_batch_get(keys=keys_for(6), partition_id=partition, select_fields=["zeta_ids", "reward"])
    rows = raw.get("zeta_ids").tolist()
    lengths = wire["zeta_ids"].offsets().diff().tolist()
    assert [len(r) for r in rows] == [8 * n for n in lengths]
    assert b"".join(rows) == wire["zeta_ids"].values().numpy().tobytes()
    assert [len(r) for r in raw.get("reward").tolist()] == [4] * 6
    saved = tq_plane.row_format
    try:
        tq_plane.row_format = "tensors"
        tensor_meta = tq_plane.put_samples(partition, keys_for(6, "t"), wire, schema=schema)
    finally:
        tq_plane.row_format = saved
    assert isinstance(tq_plane.tq.kv_batch_get(keys=keys_for(6, "t"), partition_id=partition,
                                               select_fields=["zeta_ids"]).get("zeta_ids"), torch.Tensor)
    assert_same_wire(tq_plane.get_samples(tensor_meta, schema.names), wire, schema)
    tq_plane.clear_samples(meta)
    tq_plane.clear_samples(tensor_meta)


def test_row_format_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match=r"row_format: expected one of \('bytes', 'tensors'\), got 'pickle'"):
        TransferQueueDataPlane(row_format="pickle")
