"""Vocabulary-parallel student logits (`tp_group=`): with the logits' columns (or the lm_head's rows) split over two
gloo processes, every rank gets the unsharded loss and metrics, and its own columns (rows) of the gradient; the fused
form's hidden-state gradient is the full one on both ranks. Every mode and aggregation, blocks of 2 positions (also
with the gradient written over the logits) and whole samples, against one process holding everything (float64, 1e-10 relative).
"""
import pytest
import torch

from losses_helpers import config_names, TP_WIDTH, every_config, run_spawned, tp_data, tp_run, write_projections

NAMES = config_names()
BLOCK_SIZES = (2, None, "overwrite")  # "overwrite": blocks of 2 with overwrite_logits=True


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("losses_tp")
    write_projections(directory)
    return directory


@pytest.fixture(scope="module")
def two_ranks(data_dir):
    return run_spawned("tp_worker", (str(data_dir), NAMES, BLOCK_SIZES), timeout=300)


def close(a, b): return abs(a - b) <= 1e-10 * max(1.0, abs(b))


@pytest.mark.parametrize("name", NAMES)
def test_two_tensor_parallel_ranks_equal_one_process(data_dir, two_ranks, name):
    config = every_config(data_dir / "dense_projection.pt")[name]
    data = tp_data(config)
    (loss, grad, metrics), (fused, fused_grads) = tp_run(config, data, None)
    half = TP_WIDTH // 2
    for size in BLOCK_SIZES:
        for rank, result in enumerate(two_ranks):
            (loss_r, grad_r, metrics_r), (fused_r, (hidden_r, weight_r, bias_r)) = result[name, size]
            assert close(loss_r, loss) and close(fused_r, fused), (name, size, rank, loss_r, loss, fused_r, fused)
            assert set(metrics_r) == set(metrics) and all(close(metrics_r[k], v) for k, v in metrics.items()), (name, size)
            cols = slice(rank * half, (rank + 1) * half)
            torch.testing.assert_close(grad_r, grad[..., cols], rtol=1e-10, atol=1e-14)
            torch.testing.assert_close(hidden_r, fused_grads[0], rtol=1e-10, atol=1e-14)
            torch.testing.assert_close(weight_r, fused_grads[1][cols], rtol=1e-10, atol=1e-14)
            torch.testing.assert_close(bias_r, fused_grads[2][cols], rtol=1e-10, atol=1e-14)
