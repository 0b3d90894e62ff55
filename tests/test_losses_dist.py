"""Acceptance tests of `xtoken_dp.losses` with real `torch.distributed` gloo processes: L4 and L16
(reductions over the DP group), L19 (invariance of loss totals and gradients across microbatches and ranks, every
mode and a two-teacher sum, fp64, with the loss computed whole and in blocks of 2 positions) and L20 (no deadlock
with a fully masked and an empty microbatch, within 60 s).

One spawned pair runs L4, L16 and every case of L19, another L20: the file starts four processes in all.
"""
import dataclasses

import pytest
import torch

from losses_helpers import INVARIANCE_BLOCK_SIZES, invariance_setup, run_microbatches, run_spawned, write_projections

MODES = ("pkl", "gold", "hkl", "topk_kl", "alm", "uld", "sum_pkl_alm")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("losses_dist")
    write_projections(directory)
    return directory


@pytest.fixture(scope="module")
def spawned_invariance(data_dir):
    return run_spawned("invariance_worker", (str(data_dir),), timeout=120)


def test_L4_L16_reductions_over_gloo(spawned_invariance):
    for rank, r in enumerate(result["primitives"] for result in spawned_invariance):
        assert (r["sum"], r["dtype"], r["local_after"]) == (7.0, "torch.float32", 3 + rank)  # 3 + 4 on both ranks
        assert r["own_group_sum"] == 3.0 + rank and r["own_world_size"] == 1  # per-rank DP groups do not sum across
        assert r["world_size"] == 2
        assert abs(r["masked_mean"] - 13 / 3) < 1e-6  # (1 + 2 + 10) / 3 on both ranks


@pytest.fixture(scope="module")
def single_process(data_dir):
    batch, features, head, teachers, same_vocab, configs = invariance_setup(data_dir)
    out = {}
    for name, config in configs.items():
        for size in INVARIANCE_BLOCK_SIZES:
            sized = dataclasses.replace(config, block_size=size)
            for split, parts in (("a", [[0, 1, 2, 3]]), ("b", [[0, 1], [2, 3]])):
                out[name, split, size] = run_microbatches(sized, batch, features, head, teachers, same_vocab, parts)
    return out


def assert_same(a, b, name):
    total_a, grads_a, head_a = a
    total_b, grads_b, head_b = b
    assert abs(total_a - total_b) <= 1e-9 * max(1.0, abs(total_a)), (name, total_a, total_b)
    for r in range(4):
        torch.testing.assert_close(grads_a[r], grads_b[r], rtol=1e-9, atol=1e-12, msg=f"{name}: logits grad, sample {r}")
    torch.testing.assert_close(head_a, head_b, rtol=1e-9, atol=1e-12, msg=f"{name}: head grad")


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("size", INVARIANCE_BLOCK_SIZES)
def test_L19_invariance_across_microbatches_and_ranks(name, size, single_process, spawned_invariance):
    "Every split equals one process with one microbatch computed whole, with the loss computed whole or in blocks."
    reference = single_process[name, "a", None]
    total = reference[0].item()
    assert total > 0 and reference[2].abs().sum() > 0  # a real loss with real gradients
    as_float = lambda t: (t[0].item() if torch.is_tensor(t[0]) else t[0], t[1], t[2])
    assert_same(as_float(reference), as_float(single_process[name, "a", size]), f"{name} 1x1 block_size={size}")
    assert_same(as_float(reference), as_float(single_process[name, "b", size]), f"{name} 1x2 block_size={size}")
    for split in ("c", "d"):
        grads = {**spawned_invariance[0][name, split, size][1], **spawned_invariance[1][name, split, size][1]}
        for rank in range(2):  # totals and the head gradient were all-reduced: every rank holds the global values
            total_r, _, head_r = spawned_invariance[rank][name, split, size]
            assert_same(as_float(reference), (total_r, grads, head_r), f"{name} {split} rank {rank} block_size={size}")


def test_L20_masked_and_empty_microbatches_finish_and_match_one_process(data_dir):
    results = run_spawned("deadlock_worker", (str(data_dir),), timeout=60)  # a hang fails after 60 s
    batch, features, head, teachers, same_vocab, configs = invariance_setup(data_dir)
    for name in ("pkl", "alm", "sum_pkl_alm"):
        total, _, head_grad = run_microbatches(configs[name], batch, features, head, teachers, same_vocab,
                                               [[0, 1], [3], [2], []])
        for rank in range(2):
            got_total, got_head = results[rank][name]
            assert abs(got_total - total.item()) <= 1e-9 * abs(total.item()), (name, rank, got_total, total.item())
            torch.testing.assert_close(got_head, head_grad, rtol=1e-9, atol=1e-12)
    for rank in range(2):  # configs whose every call issues the scores' all-reduce also finish, with finite losses
        assert all(torch.isfinite(torch.tensor(results[rank][name])) for name in ("scored", "selected"))
    assert results[0]["scored"] == results[1]["scored"] and results[0]["selected"] == results[1]["selected"]
