"""`XTokenLossConfig.overwrite_logits`: the blockwise loss writes the logits' gradient over the student logits instead of
into a buffer of their size. The loss, every metric and the gradient are exactly (bit for bit) those of the buffered
path with the same blocks, for every mode and aggregation; the returned gradient is the logits' own memory; a call
without a gradient leaves the logits alone; masked samples get a zero gradient; an op that kept the logits for its own
backward makes autograd refuse; and the peak memory of a real forward + backward drops by the buffer.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from xtoken_dp import losses as L
from xtoken_dp.losses import fused as LF  # the module whose blockwise_loss the fused entry point calls
from losses_helpers import config_names, HIDDEN, V_S, V_T, W_S, data_for, every_config, write_projections

NAMES = config_names()


@pytest.fixture(scope="module")
def dense(tmp_path_factory): return write_projections(tmp_path_factory.mktemp("overwrite_projections"))[0]


def run(config, student, batch, teachers, *, overwrite, size, scale=1.0):
    "`(loss, gradient, metrics, the logits tensor afterwards)` of one call and `(scale * loss).backward()`."
    config = dataclasses.replace(config, block_size=size, overwrite_logits=overwrite)
    x = student.detach().clone().requires_grad_()
    loss, metrics = L.xtoken_kd_loss(x, batch, teachers, config=config, normalizers=L.compute_global_normalizers(batch, config))
    (grad,) = torch.autograd.grad(scale * loss, [x])
    return loss.detach(), grad, {k: float(v) for k, v in metrics.items()}, x.detach()


@pytest.mark.parametrize("name", NAMES)
def test_overwriting_equals_the_buffered_gradient_bit_for_bit(dense, name):
    config = every_config(dense)[name]
    batch, student, teachers = data_for(config, 131)
    for size in (1, 3, student.shape[1]):
        loss_b, grad_b, metrics_b, logits_b = run(config, student, batch, teachers, overwrite=False, size=size, scale=0.5)
        loss_o, grad_o, metrics_o, logits_o = run(config, student, batch, teachers, overwrite=True, size=size, scale=0.5)
        assert grad_b.abs().sum() > 0, name  # a real gradient
        assert torch.equal(logits_b, student), name  # the buffered path leaves the logits alone
        assert loss_o.item() == loss_b.item() and metrics_o == metrics_b, (name, size)
        assert torch.equal(grad_o, grad_b), (name, size)
        assert grad_o.data_ptr() == logits_o.data_ptr() and torch.equal(logits_o, grad_o), (name, size)  # in the logits


@pytest.mark.parametrize("name", ("pkl", "uld", "sum_dynamic_weights", "dynamic_loss_scaling"))
def test_overwriting_a_whole_microbatch_is_one_block_equal_to_the_whole_path(dense, name):
    config = every_config(dense)[name]
    batch, student, teachers = data_for(config, 137)
    loss_w, grad_w, metrics_w, _ = run(config, student, batch, teachers, overwrite=False, size=None)
    loss_o, grad_o, metrics_o, logits_o = run(config, student, batch, teachers, overwrite=True, size=None)
    assert abs(loss_o.item() - loss_w.item()) <= 1e-10 * abs(loss_w.item())
    torch.testing.assert_close(grad_o, grad_w, rtol=1e-10, atol=1e-14)
    assert all(abs(metrics_o[k] - v) <= 1e-10 * max(1.0, abs(v)) for k, v in metrics_w.items())
    assert grad_o.data_ptr() == logits_o.data_ptr()


def test_overwriting_bf16_logits_gives_the_buffered_bf16_gradient(dense):
    config = every_config(dense)["gold"]
    batch, student, teachers = data_for(config, 139, dtype=torch.bfloat16)
    buffered = run(config, student, batch, teachers, overwrite=False, size=4)
    over = run(config, student, batch, teachers, overwrite=True, size=4)
    assert over[1].dtype == torch.bfloat16 and torch.equal(over[1], buffered[1])


def test_masked_samples_get_a_zero_gradient_over_their_logits(dense):
    config = every_config(dense)["alm"]
    batch, student, teachers = data_for(config, 149, B=4, masked=(0, 2))
    _, grad, _, logits = run(config, student, batch, teachers, overwrite=True, size=2)
    assert torch.equal(logits, grad)
    assert grad[[0, 2]].abs().sum() == 0 and grad[[1, 3]].abs().sum() > 0
    assert torch.equal(grad, run(config, student, batch, teachers, overwrite=False, size=2)[1])


def test_without_a_gradient_the_logits_are_left_alone(dense):
    config = dataclasses.replace(every_config(dense)["pkl"], block_size=2, overwrite_logits=True)
    batch, student, teachers = data_for(config, 151)
    norms = L.compute_global_normalizers(batch, config)
    x = student.clone().requires_grad_()
    with torch.no_grad(): L.xtoken_kd_loss(x, batch, teachers, config=config, normalizers=norms)
    L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)  # no input requires a gradient
    assert torch.equal(x.detach(), student) and torch.equal(student, data_for(config, 151)[1])


def test_the_gradient_flows_on_through_an_lm_head(dense):
    "The usual case: logits made by an lm_head; its weight and the hidden states get the buffered path's gradients."
    config = every_config(dense)["hkl"]
    batch, _, teachers = data_for(config, 157)
    g = torch.Generator().manual_seed(158)
    B, T = batch["input_ids"].shape
    hidden, weight = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64), torch.randn(W_S, HIDDEN, generator=g, dtype=torch.float64)
    grads = {}
    for overwrite in (False, True):
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        c = dataclasses.replace(config, block_size=3, overwrite_logits=overwrite)
        loss, _ = L.xtoken_kd_loss(leaves[0] @ leaves[1].T, batch, teachers, config=c, normalizers=L.compute_global_normalizers(batch, c))
        (2.0 * loss).backward()
        grads[overwrite] = [t.grad for t in leaves]
    for got, expected in zip(grads[True], grads[False]): assert torch.equal(got, expected)


def test_a_backward_that_needs_the_overwritten_logits_is_refused(dense):
    config = dataclasses.replace(every_config(dense)["gold"], block_size=2, overwrite_logits=True)
    batch, student, teachers = data_for(config, 163)
    logits = student.clone().requires_grad_() * 1.0
    z_loss = logits.logsumexp(-1).pow(2).mean()  # keeps the logits for its backward
    loss, _ = L.xtoken_kd_loss(logits, batch, teachers, config=config, normalizers=L.compute_global_normalizers(batch, config))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"): (loss + z_loss).backward()


def test_the_fused_path_ignores_the_flag(dense):
    config = dataclasses.replace(every_config(dense)["pkl"], block_size=2)
    batch, _, teachers = data_for(config, 167)
    g = torch.Generator().manual_seed(168)
    B, T = batch["input_ids"].shape
    hidden, weight = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64), torch.randn(W_S, HIDDEN, generator=g, dtype=torch.float64)
    out = []
    for overwrite in (False, True):
        c = dataclasses.replace(config, overwrite_logits=overwrite)
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        loss, _ = L.xtoken_kd_loss_fused(*leaves, batch, teachers, config=c, normalizers=L.compute_global_normalizers(batch, c))
        out.append((loss.item(), torch.autograd.grad(loss, leaves)))
    assert out[0][0] == out[1][0] and all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


def test_overwrite_logits_is_validated_and_sets_its_own_block_count(dense):
    with pytest.raises(TypeError, match="overwrite_logits: expected a bool"):
        L.XTokenLossConfig(5, [L.TeacherLossSpec("alm", None, 5)], overwrite_logits="yes")
    config = L.XTokenLossConfig(V_S, [L.TeacherLossSpec("pkl", dense, V_T), L.TeacherLossSpec("uld", None, V_T)], overwrite_logits=True)
    assert L.auto_blocks(config) == L.AUTO_BLOCKS_OVERWRITE + L.AUTO_BLOCKS_OVERWRITE_BY_MODE["uld"]
    assert L.auto_blocks(config, overwrite=False) == L.AUTO_BLOCKS + L.AUTO_BLOCKS_BY_MODE["uld"]
    assert L.auto_blocks(config) < L.auto_blocks(config, overwrite=False)
    assert L.auto_blocks(config, fused=True) == L.AUTO_BLOCKS_FUSED + L.AUTO_BLOCKS_FUSED_BY_MODE["uld"]


def test_fused_auto_takes_the_fused_count_whatever_the_flag(monkeypatch):
    "Above AUTO_WHOLE_BYTES the fused entry point cuts `auto_blocks(config, fused=True)` blocks, with or without the flag."
    seen = []
    monkeypatch.setattr(LF, "blockwise_loss", lambda source, batch, t, config, n, g: seen.append(config.block_size))
    T, V, H = 2048, 16384, 8  # bf16 logits of 64 MiB + 32 KiB: just above AUTO_WHOLE_BYTES
    hidden, weight = torch.zeros(1, T, H, dtype=torch.bfloat16), torch.zeros(V + 8, H, dtype=torch.bfloat16)
    batch = {"input_ids": torch.zeros(1, T, dtype=torch.long), "token_mask": torch.ones(1, T, dtype=torch.bool),
             "sample_mask": torch.ones(1)}
    for overwrite in (False, True):
        config = L.XTokenLossConfig(V, [L.TeacherLossSpec("alm", None, V)], overwrite_logits=overwrite)
        norms = L.GlobalNormalizers(n_tok=1.0, n_chunks={0: 1.0})
        L.xtoken_kd_loss_fused(hidden, weight, batch, {}, config=config, normalizers=norms)
    n = L.AUTO_BLOCKS_FUSED_BY_MODE["alm"]
    assert seen == [-(-T // n)] * 2 and n != L.AUTO_BLOCKS


PEAK_SCRIPT = r'''
import json, sys, torch
from xtoken_dp.bench import scale as S
from xtoken_dp.losses import blocks as losses  # auto_blocks reads its counts there
torch.set_num_threads(1)
losses.AUTO_BLOCKS = losses.AUTO_BLOCKS_OVERWRITE = 16  # the same blocks on both paths: only the buffer differs
losses.AUTO_BLOCKS_BY_MODE = losses.AUTO_BLOCKS_OVERWRITE_BY_MODE = {}
row = sys.argv[1]
r = S.measure_row(row, S.Scale(T_s=1024, V_s=4096, V_t=3072, hidden=64), repeats=1)
print(json.dumps({"row": row, "peak_x": r["peak_extra_bytes"] / r["logits_bytes"]}))
'''


def test_overwriting_saves_the_gradient_buffer_in_a_real_process():
    "Peak resident memory of one forward + backward in fresh processes (fp32, 1024 x 4096 logits, 16 blocks each)."
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": "1"}
    peaks = {}
    for row in ("gold/blocked", "gold/overwrite"):
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, row], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[row] = json.loads(out.stdout.strip().splitlines()[-1])["peak_x"]
    assert peaks["gold/blocked"] > 1.0  # the buffer (1x) plus a block's working memory
    assert peaks["gold/overwrite"] < peaks["gold/blocked"] - 0.6, peaks  # about one logits' worth less
