"""On-policy stages through the data plane on TransferQueue: a rollout producer (the driver), two teacher scorers in Ray
actors (`ScorerPool`) and the trainer side run on-policy batches end to end with the demo's tiny teacher; the same run in
one process (in-process data plane, teacher in process) gives the same KD losses; a scorer killed while it holds a claim
loses no sample and duplicates none; with no scorer alive the trainer's claim fails with `NoScorerError`.

The tests share one pool and run in file order: the kill test kills one of its scorers, the last test the other."""
import os
from pathlib import Path

import pytest
import torch

from xtoken_dp.aligner import TokenAligner
from xtoken_dp.dataplane import InProcessDataPlane
from xtoken_dp.distill import TinyGPT, load_corpus, student_config, train_teacher, train_tokenizers
from xtoken_dp.losses import TeacherLossSpec, XTokenLossConfig, compute_global_normalizers, xtoken_kd_loss
from xtoken_dp.onpolicy.generate import collate_completions, generate_completions
from xtoken_dp.onpolicy.scorers import (LocalScorers, ModuleTeacher, NoScorerError, OnPolicyFeed, ScorerPool, claim_scored,
                                        put_rollout, rollout_partition)
from xtoken_dp.teacher_store import SignalPacking

CACHE = Path(os.environ["XTOKEN_DP_CACHE"]) / "distill"
PROMPTS = ["The function returns", "import os", "def main(", "class Config:", "Raises an error", "The default value",
           "for i in range(", "# Copyright"]
EXACT = SignalPacking("exact")


@pytest.fixture(scope="module")
def demo():
    corpus = load_corpus()
    toks = train_tokenizers(corpus, CACHE)
    teacher = train_teacher(corpus, toks, steps=150, cache_dir=CACHE, progress=False).model
    torch.manual_seed(0)
    student = TinyGPT(student_config(len(toks.student))).eval()   # untrained: the losses only read its logits
    config = XTokenLossConfig(student_vocab_size=len(toks.student), block_size=None,
                              teachers=(TeacherLossSpec("uld", vocab_size=len(toks.teacher)),))
    return toks, teacher, student, TokenAligner(toks.student, toks.teacher), config


def produce_for(demo, per_step=4):
    toks, _, student, _, _ = demo
    return lambda n: generate_completions(student, toks.student, PROMPTS[(per_step * n) % 8:(per_step * n) % 8 + per_step],
                                          max_new_tokens=10, seed=n)


def kd_losses(demo, client, run, scorers, steps=2):
    "The trainer's loop: one KD loss per step on the claimed batch and signals; the batches' keys; the waits."
    _, _, student, aligner, config = demo
    feed = OnPolicyFeed(client, run, produce_for(demo), aligner, scorers, steps=steps, score_batch_size=2, prefetch=1,
                        timeout_s=120)
    losses, keys, lags = [], [], []
    for scored in feed:
        lags.append(scored.policy_lag)
        with torch.no_grad():
            loss, _ = xtoken_kd_loss(student(scored.batch["input_ids"]), scored.batch, scored.teachers, config=config,
                                     normalizers=compute_global_normalizers(scored.batch, config))
        assert scored.teachers[0].lengths.tolist() == scored.batch["teacher_0_input_lengths"].tolist()
        losses.append(loss.item()); keys.append(list(scored.meta.sample_ids))
        client.ack_meta(scored.meta)
    assert lags == [min(1, n) for n in range(steps)]  # batch 0 was sampled before any update; later ones one update early
    return losses, keys, feed


@pytest.fixture(scope="module")
def pool(tq_plane, demo):
    with ScorerPool(ModuleTeacher.of(demo[1]), tq_plane, replicas=2, k=16, packing=EXACT) as scorers:
        yield scorers


def test_two_scorer_actors_feed_the_trainer_the_same_losses_as_one_process(tq_plane, pool, demo):
    losses, keys, feed = kd_losses(demo, tq_plane, "e2e", pool)
    assert [len(k) for k in keys] == [4, 4] and len(feed.waits) == 2
    for n in range(2):
        pid = rollout_partition("e2e", n)
        assert tq_plane.consumption_report(pid, ["score", "train"]) == {
            t: {"acked": 4, "leased": 0, "expected": 4, "consumed": True} for t in ("score", "train")}
    with InProcessDataPlane() as plane:   # the same seed in one process: teacher here, in-process data plane
        local_losses, local_keys, _ = kd_losses(demo, plane, "e2e", LocalScorers(ModuleTeacher.of(demo[1]), plane, k=16, packing=EXACT))
    assert [sorted(k) for k in keys] == [sorted(k) for k in local_keys]
    assert losses == pytest.approx(local_losses, abs=1e-6, rel=0)


def test_a_scorer_killed_while_it_holds_a_claim_loses_and_duplicates_nothing(tq_plane, pool, demo):
    rows = produce_for(demo, per_step=6)(0)
    receipt = put_rollout(tq_plane, "kill", 0, rows, demo[3])
    pid = rollout_partition("kill", 0)
    doomed = pool.owners[0]
    held = pool.ray.get(pool.actors[doomed].claim.remote(pid, 3))
    assert held.size == 3
    pool.ray.kill(pool.actors[doomed])   # dies holding 3 unscored samples
    pool.serve("kill", 2, steps=1)
    scored = claim_scored(tq_plane, pid, 6, scorers=pool, timeout_s=120)
    assert sorted(scored.meta.sample_ids) == sorted(receipt.sample_ids)   # every sample, once
    assert pool.alive() == 1 and pool.released[doomed] == 3
    assert tq_plane.consumption_report(pid, ["score"])["score"] == {"acked": 6, "leased": 0, "expected": 6, "consumed": True}
    order = [receipt.sample_ids.index(k) for k in scored.meta.sample_ids]
    want = collate_completions([rows[i] for i in order], demo[3])
    for key, value in want.items(): assert torch.equal(scored.batch[key], value), key
    tq_plane.ack_meta(scored.meta)


def test_no_scorer_alive_is_a_typed_error_not_a_hang(tq_plane, pool, demo):
    for owner in pool.owners:
        if owner not in pool.dead: pool.ray.kill(pool.actors[owner])
    put_rollout(tq_plane, "orphan", 0, produce_for(demo, per_step=2)(0), demo[3])
    pool.serve("orphan", 2, steps=1)
    with pytest.raises(NoScorerError, match="no scorer is alive"):
        claim_scored(tq_plane, rollout_partition("orphan", 0), 2, scorers=pool, timeout_s=120)
    assert pool.alive() == 0
