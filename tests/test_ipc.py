"""Acceptance tests I1-I10 of ipc_distill.md A7 for `xtoken_dp.ipc`, with real processes.

The consumer (or, in one test, the producer) runs in a process started with `torch.multiprocessing`'s `spawn`
context. It is driven through the probe workers of `xtoken_dp.ipc` and reports what it observes inside its own
address space: values, whether the result shares storage with the imported base at the expected offset, the import
cache, and its memory growth. Spawning costs a few seconds, so one consumer process serves the whole module (its
import cache is emptied between tests) and only the producer-exit test starts a second process.

Every test uses its own `shm_dir` under /dev/shm and the fixture fails a test that leaves a file behind.
I10 (CUDA IPC) runs only where a GPU exists.
"""
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from xtoken_dp.ipc import (DEFAULT_KEY, HANDLE_FIELDS, StaleHandleError, TeacherLogitsProducer, check_handles_fresh,
                           consumer_probe_worker, imported_keys, producer_probe_worker,
                           rebuild_teacher_full_logits_from_ipc, release_imported, remove_orphaned_shm)

SPAWN = mp.get_context("spawn")
REPLY_TIMEOUT = 120


class ProbeError(Exception):
    "An exception raised inside a probe process, carried back by name and message."
    def __init__(self, name, message):
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


class Probe:
    "A spawned probe process and its request/reply queues."
    def __init__(self, target, *args):
        self.requests, self.replies = SPAWN.Queue(), SPAWN.Queue()
        self.process = SPAWN.Process(target=target, args=(self.requests, self.replies, *args), daemon=True)
        self.process.start()

    def reply(self):
        deadline = time.monotonic() + REPLY_TIMEOUT
        while time.monotonic() < deadline:
            try: reply = self.replies.get(timeout=0.5)
            except Exception:
                if not self.process.is_alive(): raise RuntimeError(f"probe exited with code {self.process.exitcode}")
                continue
            if reply[0] == "error": raise ProbeError(*reply[1:])
            return reply[1]
        raise TimeoutError("no reply from the probe process")

    def call(self, op, **kwargs):
        self.requests.put((op, kwargs))
        return self.reply()

    def fails(self, op, name, contains, **kwargs):
        with pytest.raises(ProbeError) as info: self.call(op, **kwargs)
        assert info.value.name == name and contains in info.value.message, str(info.value)

    def close(self, **kwargs):
        if self.process.is_alive(): self.requests.put(("exit", kwargs))
        self.process.join(REPLY_TIMEOUT)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()


@pytest.fixture
def shm_dir():
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = root / f"xtoken_dp_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    release_imported()
    leftovers = sorted(os.listdir(path))
    shutil.rmtree(path, ignore_errors=True)
    assert not leftovers, f"files left in shm_dir: {leftovers}"


@pytest.fixture(scope="module")
def consumer_process():
    probe = Probe(consumer_probe_worker)
    yield probe
    probe.close()


@pytest.fixture
def consumer(consumer_process):
    consumer_process.call("release_imported")
    yield consumer_process
    consumer_process.call("release_imported")


def values(reply, name="values"):
    return torch.from_numpy(reply[name])


def assert_zero_copy(facts):
    assert facts["same_storage"], facts
    assert facts["expected_offset"], facts
    assert facts["is_view"], facts


def producer(shm_dir, **kwargs):
    kwargs = {"max_batch": 4, "max_seq_len": 5, "vocab_width": 7, **kwargs}
    return TeacherLogitsProducer(shm_dir=shm_dir, **kwargs)


# I1, I2
def test_round_trip_is_a_view_in_another_process_and_the_import_is_cached(shm_dir, consumer):
    strategy = mp.get_sharing_strategy()
    logits = torch.randn(4, 5, 7)
    with producer(shm_dir) as p:
        handles = p.publish(logits)
        first = consumer.call("rebuild", handles=handles[1:3])
        assert torch.equal(values(first), logits[1:3])
        assert first["shape"] == [2, 5, 7] and first["dtype"] == "float32"
        assert_zero_copy(first["zero_copy"])
        assert first["cache"] == [(p.buffer_id, 1)]
        second = consumer.call("rebuild", handles=handles[1:3])
        assert second["zero_copy"]["storage_ptr"] == first["zero_copy"]["storage_ptr"]   # one import, reused
        assert second["cache"] == [(p.buffer_id, 1)]

        padded = p.publish(logits, vocab_size=6)                                      # I2: lm_head padding
        narrow = consumer.call("rebuild", handles=padded, key="teacher_1_full_logits_ipc")
        assert narrow["shape"] == [4, 5, 6]
        assert torch.equal(values(narrow), logits[..., :6])
        assert_zero_copy(narrow["zero_copy"])
        assert narrow["zero_copy"]["storage_ptr"] == first["zero_copy"]["storage_ptr"]  # same base across steps
    assert consumer.call("pid") != os.getpid()
    assert mp.get_sharing_strategy() == strategy


# I3
def test_views_see_later_writes_and_old_handles_are_stale(shm_dir, consumer):
    step1, step2 = torch.randn(4, 5, 7), torch.randn(4, 5, 7)
    with producer(shm_dir) as p:
        h1 = p.publish(step1)
        assert torch.equal(values(consumer.call("rebuild", handles=h1, hold="step1")), step1)
        h2 = p.publish(step2)
        assert torch.equal(values(consumer.call("read", name="step1")), step2)          # shared pages
        consumer.fails("fresh", "StaleHandleError", "handle of step 1, but the producer has published step 2", handles=h1)
        consumer.fails("rebuild", "StaleHandleError", "step", handles=h1)
        consumer.call("fresh", handles=h2)
        consumer.call("write", name="step1", value=1234.5)                              # and the other way round
        assert p._res.parts["logits"][0, 0, 0].item() == 1234.5
        with pytest.raises(StaleHandleError):                                             # also in this process
            check_handles_fresh(h1)


# I4 (consumer in another process)
def test_release_makes_handles_stale_keeps_views_and_removes_files(shm_dir, consumer):
    logits = torch.randn(4, 5, 7)
    p = producer(shm_dir)
    try:
        handles = p.publish(logits)
        consumer.call("rebuild", handles=handles, hold="kept")
        assert len(os.listdir(shm_dir)) == 2
        p.release()
        p.release()
        assert p.released and os.listdir(shm_dir) == []
        consumer.fails("rebuild", "StaleHandleError", "released", handles=handles)
        assert torch.equal(values(consumer.call("read", name="kept")), logits)
    finally:
        p.release()
    with pytest.raises(RuntimeError, match="inside the with block"):
        with producer(shm_dir) as q:
            late = q.publish(logits)
            raise RuntimeError("inside the with block")
    assert q.released and os.listdir(shm_dir) == []
    consumer.fails("fresh", "StaleHandleError", "released", handles=late)


# I4 (producer in another process, cleaned up by its finalizer at interpreter exit)
def test_producer_process_exit_leaves_no_file(shm_dir):
    child = Probe(producer_probe_worker, {"max_batch": 2, "max_seq_len": 3, "vocab_width": 4, "shm_dir": str(shm_dir)})
    try:
        info = child.reply()
        logits = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
        handles = child.call("publish", logits=logits)
        view = rebuild_teacher_full_logits_from_ipc({DEFAULT_KEY: handles})
        assert torch.equal(view, torch.from_numpy(logits))
        assert len(os.listdir(shm_dir)) == 2
    finally:
        child.close(release=False)
    assert child.process.exitcode == 0
    assert os.listdir(shm_dir) == []
    assert torch.equal(view, torch.from_numpy(logits))
    with pytest.raises(StaleHandleError, match="released"):
        rebuild_teacher_full_logits_from_ipc({DEFAULT_KEY: handles})
    orphan = shm_dir / f"xtdp_{info['pid']}_{uuid.uuid4().hex}_control"   # as if the child had been killed
    orphan.touch()
    with producer(shm_dir) as live:
        assert remove_orphaned_shm(shm_dir) == [str(orphan)]
        assert len(os.listdir(shm_dir)) == 2 and all(live.buffer_id in name for name in os.listdir(shm_dir))


# I5
def test_growth_reallocates_once_and_stales_old_handles(shm_dir, consumer):
    with producer(shm_dir, max_batch=2, max_seq_len=3, vocab_width=5) as p:
        h1 = p.publish(torch.randn(2, 3, 5))
        assert consumer.call("rebuild", handles=h1)["cache"] == [(p.buffer_id, 1)]
        path = next(shm_dir.glob("*_g1_logits"))
        inode, ptr = path.stat().st_ino, p._res.parts["logits"].data_ptr()
        for _ in range(3):                                 # same-size and smaller steps reuse the buffer in place
            p.publish(torch.randn(1, 2, 5))
        assert p.generation == 1 and path.stat().st_ino == inode and p._res.parts["logits"].data_ptr() == ptr
        big = torch.randn(3, 4, 6)
        h2 = p.publish(big)
        assert (p.generation, p.capacity, p.step) == (2, (3, 4, 6), 5)
        consumer.fails("rebuild", "StaleHandleError", "reallocated (generation 2)", handles=h1)
        grown = consumer.call("rebuild", handles=h2)
        assert torch.equal(values(grown), big)
        assert_zero_copy(grown["zero_copy"])
        assert grown["cache"] == [(p.buffer_id, 2)]       # the old generation left the cache
        assert sorted(os.listdir(shm_dir)) == sorted(f"xtdp_{os.getpid()}_{p.buffer_id}_{s}" for s in ("control", "g2_logits"))


# I6
def test_validation_errors(shm_dir, consumer):
    logits = torch.randn(4, 5, 7)
    with producer(shm_dir) as p, producer(shm_dir) as other:
        h, g = p.publish(logits), other.publish(logits)
        consumer.fails("rebuild", "ValueError", "buffer_id: handles disagree", handles=[h[0], g[1]])
        consumer.fails("rebuild", "ValueError", "does not belong to buffer",      # checked when first imported
                       handles=[{**h[0], "payload": g[0]["payload"]}])
        consumer.fails("rebuild", "ValueError", "sample_index: [0, 2] is not a consecutive", handles=[h[0], h[2]])
        consumer.fails("rebuild", "ValueError", "allow_copy=True", handles=[h[1], h[0]])
        copied = consumer.call("rebuild", handles=[h[3], h[0], h[2]], allow_copy=True)
        assert torch.equal(values(copied), logits[[3, 0, 2]])
        assert not copied["zero_copy"]["same_storage"] and not copied["zero_copy"]["is_view"]
        consumer.fails("rebuild", "ValueError", "shape: handles disagree", handles=[h[0], {**h[1], "shape": [5, 6]}])
        consumer.fails("rebuild", "ValueError", "shape: the handles say [4, 7], but step 1 published [5, 7]",
                       handles=[{**x, "shape": [4, 7]} for x in h])
        consumer.fails("rebuild", "ValueError", "does not fit the buffer's storage_shape",
                       handles=[{**x, "shape": [5, 8]} for x in h])
        consumer.fails("rebuild", "ValueError", "node: the handle comes from 'other-host/1234'",
                       handles=[{**x, "node": "other-host/1234"} for x in h])
        consumer.fails("rebuild", "ValueError", "empty", handles=[])
        consumer.fails("rebuild", "ValueError", "xtdp_ipc_version: expected 1, got 2", handles=[{**h[0], "xtdp_ipc_version": 2}])
        consumer.fails("rebuild", "ValueError", "device: the buffer lives on cpu", handles=h, device="cuda:0")
        short = p.publish(logits[:2])
        consumer.fails("rebuild", "ValueError", "sample_index: 3 >= the 2 samples published", handles=[{**short[1], "sample_index": 3}])
        with pytest.raises(KeyError, match="teacher_3_full_logits_ipc"):
            rebuild_teacher_full_logits_from_ipc({DEFAULT_KEY: short}, key="teacher_3_full_logits_ipc")
        with pytest.raises(TypeError, match="expected a list of handle dicts"):
            rebuild_teacher_full_logits_from_ipc({DEFAULT_KEY: "not handles"})
        with pytest.raises(ValueError, match="vocab_size: expected an int >= 1 and <= 7, got 9"):
            p.publish(logits, vocab_size=9)
        with pytest.raises(TypeError, match="logits: expected a torch.Tensor"):
            p.publish(logits.numpy())
    with pytest.raises(ValueError, match="topk: storage='topk' needs topk=k"):
        producer(shm_dir, storage="topk")
    with pytest.raises(FileNotFoundError, match="shm_dir"):
        producer(shm_dir / "missing")


# I7
def test_bf16_view_keeps_its_dtype_and_halves_memory(shm_dir, consumer):
    logits = torch.randn(4, 5, 7) * 5
    with producer(shm_dir, storage="bf16") as p16, producer(shm_dir) as p32:
        reply = consumer.call("rebuild", handles=p16.publish(logits)[2:])
        assert reply["dtype"] == "bfloat16"
        assert torch.equal(values(reply), logits[2:].bfloat16().float())
        assert_zero_copy(reply["zero_copy"])
        assert p32.nbytes == 2 * p16.nbytes == 4 * 5 * 7 * 4


# I8
def test_topk_matches_the_full_log_softmax_on_its_support(shm_dir, consumer):
    B, T, V, k = 3, 6, 256, 32                                  # k = V / 8
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=gen) * 4
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0] = logits[0].argmin(-1)                           # certainly off the support
    targets[:, -1] = -1                                         # the last position has no next token
    log_p = logits.log_softmax(-1)
    with producer(shm_dir, max_batch=B, max_seq_len=T, vocab_width=V, storage="topk", topk=k) as pk, \
         producer(shm_dir, max_batch=B, max_seq_len=T, vocab_width=V) as p32:
        reply = consumer.call("rebuild", handles=pk.publish(logits, target_ids=targets)[1:])
        assert reply["kind"] == "topk" and reply["shape"] == [2, T, V] and reply["vocab_size"] == V
        ids = values(reply, "indices").long()
        assert torch.equal(ids.sort(-1).values, log_p[1:].topk(k, dim=-1).indices.sort(-1).values)
        torch.testing.assert_close(values(reply, "log_probs_on_support"), log_p[1:].gather(-1, ids), rtol=1e-2, atol=1e-6)
        shifted = logits[1:] - logits[1:].amax(-1, keepdim=True)
        torch.testing.assert_close(values(reply), shifted.gather(-1, ids), rtol=1e-2, atol=1e-6)
        torch.testing.assert_close(values(reply, "lse"), shifted.logsumexp(-1), rtol=0, atol=1e-5)
        target = values(reply, "target_logprob")
        expected = log_p[1:].gather(-1, targets[1:, :, None].clamp_min(0)).squeeze(-1)
        torch.testing.assert_close(target[:, :-1], expected[:, :-1], rtol=0, atol=1e-6)
        assert target[:, -1].isnan().all()
        torch.testing.assert_close(values(reply, "densify_row_sums"), torch.ones(2, T), rtol=0, atol=1e-5)
        for name in ("values", "indices", "lse", "target_logprob"):
            assert_zero_copy(reply["zero_copy"][name])
        assert p32.nbytes / pk.nbytes >= 4

        exact_target = pk.publish(logits[:1], target_ids=targets[:1])[0]      # the off-support target stays exact
        first = consumer.call("rebuild", handles=[exact_target])
        torch.testing.assert_close(values(first, "target_logprob")[0, :-1], log_p[0, :-1].min(-1).values, rtol=0, atol=1e-6)

        peaked = torch.full((B, T, V), -1e4)                                   # the support holds all the mass, so
        peaked[..., :k] = torch.randn(B, T, k, generator=gen) * 2             # bf16 rounding alone moves its sum off 1
        full_support = consumer.call("rebuild", handles=pk.publish(peaked))
        support_sums = values(full_support, "log_probs_on_support").exp().sum(-1)
        assert (support_sums - 1).abs().max() > 1e-4                           # densify has to renormalise these rows
        torch.testing.assert_close(values(full_support, "densify_row_sums"), torch.ones(B, T), rtol=0, atol=1e-5)

        narrow = consumer.call("rebuild", handles=pk.publish(logits, vocab_size=V - 6))
        assert narrow["shape"] == [B, T, V - 6] and narrow["target_logprob"] is None
        assert int(values(narrow, "indices").max()) < V - 6
        torch.testing.assert_close(values(narrow, "densify_row_sums"), torch.ones(B, T), rtol=0, atol=1e-5)


# I9
def test_handles_come_in_sample_order_and_survive_json(shm_dir, consumer):
    logits = torch.randn(4, 5, 7)
    with producer(shm_dir) as p, producer(shm_dir, storage="topk", topk=3) as pk:
        handles = p.publish(logits)
        assert [h["sample_index"] for h in handles] == [0, 1, 2, 3]
        assert all(set(h) == set(HANDLE_FIELDS) for h in handles)
        assert handles[0]["payload"] is not handles[1]["payload"]                   # independent dicts
        wire = json.loads(json.dumps(handles))
        assert wire == handles
        assert torch.equal(values(consumer.call("rebuild", handles=wire[2:])), logits[2:])
        topk_wire = json.loads(json.dumps(pk.publish(logits)))
        assert consumer.call("rebuild", handles=topk_wire)["shape"] == [4, 5, 7]


# Zero copy, measured: reading a rebuilt view grows the consumer's shared (file) memory, not its private memory.
def test_reading_a_view_allocates_no_private_memory(shm_dir, consumer):
    logits = torch.randn(4, 512, 4096)                      # 32 MiB
    with producer(shm_dir, max_batch=4, max_seq_len=512, vocab_width=4096) as p:
        handles = p.publish(logits)
        view = consumer.call("memory", handles=handles)
        copy = consumer.call("memory", handles=[handles[3], *handles[:3]], allow_copy=True)
    mib = 2 ** 20
    print(f"\nzero-copy read of a {view['view_bytes'] / mib:.0f} MiB view: private +{view['anon_bytes'] / mib:.1f} MiB, "
          f"shared +{view['shmem_bytes'] / mib:.1f} MiB; allow_copy gather: private +{copy['anon_bytes'] / mib:.1f} MiB")
    assert view["view_bytes"] == logits.numel() * 4
    assert abs(view["sum"] - logits.sum().item()) < 1e-2 * logits.abs().sum().item()
    assert view["anon_bytes"] < 0.1 * view["view_bytes"]
    assert view["shmem_bytes"] > 0.9 * view["view_bytes"]
    assert copy["anon_bytes"] > 0.9 * copy["view_bytes"]      # the same probe does see a copy


# I10
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_round_trip_freshness_release_and_synchronised_publish(shm_dir, consumer):
    x1, x2 = torch.randn(4, 5, 7, device="cuda"), torch.randn(4, 5, 7, device="cuda")
    p = producer(shm_dir, device="cuda")
    try:
        h1 = p.publish(x1)
        assert h1[0]["transport"] == "cuda_ipc"
        local = rebuild_teacher_full_logits_from_ipc({DEFAULT_KEY: h1[1:3]}, device="cuda")   # same process
        assert local.data_ptr() == p._res.parts["logits"].data_ptr() + p._res.parts["logits"].stride(0) * 4
        first = consumer.call("rebuild", handles=h1[1:3], hold="c1")
        assert torch.equal(values(first), x1[1:3].cpu())
        assert_zero_copy(first["zero_copy"])
        again = consumer.call("rebuild", handles=h1[1:3])
        assert again["zero_copy"]["storage_ptr"] == first["zero_copy"]["storage_ptr"]
        h2 = p.publish(x2)
        assert torch.equal(values(consumer.call("read", name="c1")), x2[1:3].cpu())
        consumer.fails("fresh", "StaleHandleError", "published step 2", handles=h1)
        consumer.fails("rebuild", "StaleHandleError", "step", handles=h1)
        p.release()
        assert os.listdir(shm_dir) == []
        consumer.fails("rebuild", "StaleHandleError", "released", handles=h2)
        assert torch.equal(values(consumer.call("read", name="c1")), x2[1:3].cpu())
    finally:
        p.release()
    consumer.call("release_imported")
    del local
    B, T, W = 1, 4096, 32768                                     # 512 MiB written by one kernel per step
    with producer(shm_dir, max_batch=B, max_seq_len=T, vocab_width=W, device="cuda") as big:
        for step in (1, 2, 3):
            handles = big.publish(torch.full((B, T, W), float(step), device="cuda"))
            assert consumer.call("checksum", handles=handles) == step * B * T * W
