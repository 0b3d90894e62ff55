"""Task-mediated reads (`claim_meta`, `get_data`, `ack_meta`, `release_claims`, `check_consumption_status`) on both stores.

The in-process store is tested with threads; TransferQueue with the session's store (`tq_plane`) and consumers in Ray
actors (`TaskConsumer`), which claim through the one claim-book actor every client of the store shares.
"""
import threading
import uuid

import pytest
import torch

from xtoken_dp.codec import pack_jagged_fields
from xtoken_dp.dataplane import (ClaimTimeoutError, InProcessDataPlane, LeaseLostError, TaskConsumer, claim_ids,
                                 drain_task)

WAIT_S = 0.4


def rows(n: int, start: int = 0):
    "n one-token rows whose value is their index (start, start+1, ...)."
    return pack_jagged_fields({"x": torch.arange(start, start + n).view(n, 1)}, lengths=torch.ones(n, dtype=torch.int64))


def keys(n: int, start: int = 0, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(start, start + n)]


@pytest.fixture(params=["in_process", "transfer_queue"])
def plane(request):
    if request.param == "in_process":
        with InProcessDataPlane(timeout_s=WAIT_S, poll_s=0.01) as p: yield p
        return
    yield request.getfixturevalue("tq_plane")


@pytest.fixture
def partition(plane):
    return f"c_{uuid.uuid4().hex[:10]}"


def test_claims_hand_each_sample_to_a_task_once(plane, partition):
    plane.register_partition(partition, num_samples=6, consumer_tasks=["score", "train"])
    plane.put_samples(keys(6), partition, rows(6))
    first = plane.claim_meta(partition, "train", ["x"], 4)
    second = plane.claim_meta(partition, "train", ["x"], 4)   # the partition's last two: the remainder, not a wait
    assert first.sample_ids == keys(4) and second.sample_ids == keys(2, 4)
    assert plane.get_data(first)["x"].values().tolist() == [0, 1, 2, 3]
    assert plane.claim_meta(partition, "score", ["x"], 6).sample_ids == keys(6)   # another task gets every sample
    assert plane.claim_meta(partition, "train", ["x"], 4, blocking=False).size == 0
    with pytest.raises(ClaimTimeoutError):   # held, not acknowledged: a blocking claim waits for them, then gives up
        plane.claim_meta(partition, "train", ["x"], 4)
    assert (plane.ack_meta(first), plane.ack_meta(second)) == (4, 2)
    assert plane.claim_meta(partition, "train", ["x"], 4).size == 0   # every sample acknowledged: the end


def test_claim_waits_for_required_fields_a_producer_writes_later(plane, partition):
    plane.register_partition(partition)
    plane.put_samples(keys(3), partition, rows(3))
    later = pack_jagged_fields({"signal": torch.tensor([[10], [11], [12]])}, lengths=torch.ones(3, dtype=torch.int64))
    writer = threading.Timer(0.2, lambda: plane.put_samples(keys(3), partition, later))
    writer.start()
    try: meta = plane.claim_meta(partition, "train", ["x", "signal"], 3, timeout_s=30)
    finally: writer.join()
    assert meta.sample_ids == keys(3)
    batch = plane.get_data(meta)
    assert batch["signal"].values().tolist() == [10, 11, 12] and batch["x"].values().tolist() == [0, 1, 2]


def test_a_claim_that_cannot_be_served_is_a_typed_timeout(plane, partition):
    plane.register_partition(partition)
    plane.put_samples(keys(1), partition, rows(1))
    with pytest.raises(ClaimTimeoutError) as caught:
        plane.claim_meta(partition, "train", ["x"], 2, timeout_s=0.2)
    err = caught.value
    assert isinstance(err, TimeoutError)
    assert (err.partition_id, err.task_name, err.required_fields, err.ready) == (partition, "train", ("x",), 1)
    assert "only 1 samples were ready" in str(err)


def test_consumption_status_counts_acknowledgements(plane, partition):
    plane.register_partition(partition, consumer_tasks=["score", "train"])
    plane.put_samples(keys(4), partition, rows(4), tags=[{"w": i} for i in range(4)])
    assert plane.check_consumption_status(partition, ["score", "train"]) is False
    meta = plane.claim_meta(partition, "score", ["x"], 4)
    assert [t["w"] for t in meta.tags] == [0, 1, 2, 3]
    assert plane.check_consumption_status(partition, ["score"]) is False   # claimed is not consumed
    plane.ack_meta(meta)
    assert plane.check_consumption_status(partition, ["score"]) is True
    assert plane.check_consumption_status(partition, ["score", "train"]) is False
    assert plane.consumption_report(partition, ["score", "train"]) == {
        "score": {"acked": 4, "leased": 0, "expected": 4, "consumed": True},
        "train": {"acked": 0, "leased": 0, "expected": 4, "consumed": False}}


def test_a_lapsed_lease_goes_to_the_next_consumer_and_its_late_ack_is_refused(plane, partition):
    plane.register_partition(partition, num_samples=4)
    plane.put_samples(keys(4), partition, rows(4))
    slow_done = plane.claim_meta(partition, "train", ["x"], 2, owner="slow", lease_s=30)
    plane.ack_meta(slow_done)
    slow = plane.claim_meta(partition, "train", ["x"], 2, owner="slow", lease_s=0.05)
    fast = plane.claim_meta(partition, "train", ["x"], 2, owner="fast", timeout_s=30)
    assert fast.sample_ids == slow.sample_ids == keys(2, 2)
    with pytest.raises(LeaseLostError) as caught: plane.ack_meta(slow)
    assert caught.value.keys == tuple(keys(2, 2))
    assert plane.ack_meta(fast) == 2
    assert plane.check_consumption_status(partition, ["train"]) is True


def test_threads_of_one_task_never_share_a_sample():
    plane = InProcessDataPlane(timeout_s=10, poll_s=0.002)
    plane.register_partition("p", num_samples=120, consumer_tasks=["train", "score"])
    got = {}
    def consume(owner, task): got[owner] = drain_task(plane, "p", task, ["x"], 4, owner=owner)
    threads = [threading.Thread(target=consume, args=(f"t{i}", task)) for i, task in enumerate(["train"] * 3 + ["score"])]
    for t in threads: t.start()
    for start in range(0, 120, 10): plane.put_samples(keys(10, start), "p", rows(10, start))
    for t in threads: t.join()
    train = got["t0"] + got["t1"] + got["t2"]
    assert sorted(train) == keys(120) and len(set(train)) == 120
    assert sorted(got["t3"]) == keys(120)
    assert plane.check_consumption_status("p", ["train", "score"])


@pytest.fixture(scope="module")
def consumers(tq_plane):
    "Two consumer actors attached to the session's store."
    ray = tq_plane.ray
    actor = ray.remote(num_cpus=0)(TaskConsumer)
    made = [actor.remote(f"consumer-{i}") for i in range(2)]
    yield made
    for a in made:
        try: ray.get(a.close.remote(), timeout=30)
        except Exception: pass
        ray.kill(a)


def test_two_processes_of_one_task_never_share_a_sample(tq_plane, consumers):
    ray, partition = tq_plane.ray, f"c_{uuid.uuid4().hex[:10]}"
    tq_plane.register_partition(partition, num_samples=40, consumer_tasks=["train"])
    ray.get([c.register.remote(partition, num_samples=40, consumer_tasks=["train"]) for c in consumers])
    running = [c.drain.remote(partition, "train", ["x"], 3, timeout_s=60) for c in consumers]
    for start in range(0, 40, 8): tq_plane.put_samples(keys(8, start), partition, rows(8, start))
    got = ray.get(running, timeout=120)
    union = got[0] + got[1]
    assert sorted(union) == keys(40) and len(set(union)) == 40
    assert tq_plane.check_consumption_status(partition, ["train"])


def test_a_killed_consumer_loses_nothing_it_acknowledged(tq_plane, consumers):
    ray, partition = tq_plane.ray, f"c_{uuid.uuid4().hex[:10]}"
    tq_plane.register_partition(partition, num_samples=12)
    tq_plane.put_samples(keys(12), partition, rows(12))
    doomed = ray.remote(num_cpus=0)(TaskConsumer).remote("doomed")
    ray.get(doomed.register.remote(partition))
    acked = ray.get(doomed.claim.remote(partition, "train", ["x"], 4))
    assert ray.get(doomed.ack.remote(acked)) == 4
    held = ray.get(doomed.claim.remote(partition, "train", ["x"], 4))
    assert list(claim_ids(held).values()) == ["doomed"]
    ray.kill(doomed)   # dies holding 4 unacknowledged samples
    assert tq_plane.consumption_report(partition, ["train"])["train"] == {"acked": 4, "leased": 4, "expected": 12, "consumed": False}
    assert tq_plane.release_claims(partition, "train", "doomed") == 4
    ray.get(consumers[0].register.remote(partition))
    rest = ray.get(consumers[0].drain.remote(partition, "train", ["x"], 3, timeout_s=30))
    assert sorted(rest) == sorted(set(keys(12)) - set(acked.sample_ids))   # the held ones again, the acknowledged ones never
    assert sorted(acked.sample_ids + rest) == keys(12)
    with pytest.raises(LeaseLostError): tq_plane.ack_meta(held)
    assert tq_plane.check_consumption_status(partition, ["train"])
