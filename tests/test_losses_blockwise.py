"""The blockwise loss (`XTokenLossConfig.block_size`) and the fused lm_head form (`xtoken_kd_loss_fused`) equal the
whole-microbatch computation: loss, every metric and every gradient, for every mode and aggregation, every block size
from one position to the whole sequence, microbatches (gradient accumulation), top-k teacher records, masked and
empty microbatches, and chunk ids out of order (where blocks must grow).

float64 agrees to 1e-10 relative; float32 to 1e-5 (the blocks sum in another order); bf16 logits give bf16
gradients that agree to one bf16 rounding step (2**-8 relative), since both paths compute in fp32 and round once.
"""
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from xtoken_dp import losses as L
# the submodules whose globals a test sets, and the internals a test calls, where they live
from xtoken_dp.losses import blocks as LB, chunks as LC, fused as LF, modes as LM, uld_routes as LU
from losses_helpers import config_names, HIDDEN, V_S, V_T, W_S, W_T, data_for, every_config, rows_of, write_projections, spec

BLOCK_SIZES = (1, 2, 3, 7, "T")


@pytest.fixture(scope="module")
def dense(tmp_path_factory): return write_projections(tmp_path_factory.mktemp("blockwise_projections"))[0]


configs = every_config
NAMES = config_names()


def loss_grad_metrics(config, student, batch, teachers, normalizers=None, block_size=None):
    config = dataclasses.replace(config, block_size=block_size)
    normalizers = normalizers or L.compute_global_normalizers(batch, config)
    logits = student.detach().clone().requires_grad_()
    loss, metrics = L.xtoken_kd_loss(logits, batch, teachers, config=config, normalizers=normalizers)
    loss.backward()
    return loss.detach(), logits.grad, metrics


def assert_equal_results(got, expected, rtol, what):
    (loss, grad, metrics), (loss_e, grad_e, metrics_e) = got, expected
    assert loss.dtype == loss_e.dtype and grad.dtype == grad_e.dtype, what
    assert abs(loss.item() - loss_e.item()) <= rtol * max(1.0, abs(loss_e.item())), (what, loss.item(), loss_e.item())
    scale = max(grad_e.abs().max().item(), 1e-30)
    assert (grad.double() - grad_e.double()).abs().max().item() <= rtol * scale, what
    assert set(metrics) == set(metrics_e), (what, set(metrics) ^ set(metrics_e))
    for name, value in metrics_e.items():
        v, e = float(metrics[name]), float(value)
        assert abs(v - e) <= rtol * max(1.0, abs(e)), (what, name, v, e)


@pytest.mark.parametrize("name", NAMES)
def test_blocks_equal_the_whole_microbatch_in_fp64(dense, name):
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, 31)
    whole = loss_grad_metrics(config, student, batch, teachers)
    assert whole[0].item() != 0 and whole[1].abs().sum() > 0  # a real loss with a real gradient
    T = student.shape[1]
    for size in BLOCK_SIZES:
        size = T if size == "T" else size
        assert_equal_results(loss_grad_metrics(config, student, batch, teachers, block_size=size), whole, 1e-10,
                             f"{name}, block_size={size}")


@pytest.mark.parametrize("name", NAMES)
def test_terms_on_the_valid_chunks_rows_equal_the_full_pass(dense, name, monkeypatch):
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, 47, masked=(1, 2))
    results = {}
    for share in (0.0, 1.0):  # 0: every term reads every row; 1: terms drop the rows of gated-off chunks whenever any exist
        monkeypatch.setattr(LM, "KEEP_SHARE", share)
        results[share] = [loss_grad_metrics(config, student, batch, teachers, block_size=size) for size in (None, 3)]
        results[share, "per_chunk"] = L.per_chunk_losses(student, batch, teachers, config=config)
    if config.teachers[0].mode not in ("topk_kl", "alm"):  # the fixture has gated-off chunks: the rows are really dropped
        chunks = LC.Microbatch(student, batch, config).chunks(0, teachers[0].shape[1])
        assert LM.kept_positions(chunks.sigma, chunks.tau, chunks.valid).s_index.numel() < chunks.sigma.numel()
    for full, kept, size in zip(results[0.0], results[1.0], (None, 3)):
        assert_equal_results(kept, full, 1e-12, f"{name}, block_size={size}")
    full, kept = results[0.0, "per_chunk"], results[1.0, "per_chunk"]
    assert torch.equal(kept.valid, full.valid)
    torch.testing.assert_close(kept.per_unit, full.per_unit, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ("pkl", "gold", "topk_kl", "alm", "uld", "sum_dynamic_weights", "averaged_logits"))
def test_blocks_equal_the_whole_microbatch_in_fp32_and_bf16(dense, name):
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, 37, dtype=torch.float32)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -8)):
        x, ts = student.to(dtype), {i: t.to(dtype) for i, t in teachers.items()}
        whole = loss_grad_metrics(config, x, batch, ts)
        for size in (1, 3, student.shape[1]):
            assert_equal_results(loss_grad_metrics(config, x, batch, ts, block_size=size), whole, rtol, f"{name} {dtype} {size}")


@pytest.mark.parametrize("name", ("pkl", "hkl", "topk_kl", "uld", "sum_pkl_gold_kappa", "select_teacher"))
def test_gradient_accumulation_over_microbatches_matches(dense, name):
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, 41, B=5, masked=(1,))
    parts = [[0, 1], [2], [3, 4]]
    microbatches = [rows_of(batch, rows) for rows in parts]
    norms = L.compute_global_normalizers(microbatches, config)
    results = {}
    for size in (None, 2):
        total, grad = 0.0, torch.zeros_like(student)
        for rows, mb in zip(parts, microbatches):
            loss, g, _ = loss_grad_metrics(config, student[rows], mb, {i: t[rows] for i, t in teachers.items()}, norms, size)
            total += loss.item()
            grad[rows] = g
        results[size] = total, grad
    whole_loss = loss_grad_metrics(config, student, batch, teachers)[0].item()
    assert abs(results[2][0] - results[None][0]) <= 1e-10 * abs(results[None][0])
    if not config.needs_scores:  # with fixed weights the split does not change the step's loss
        assert abs(results[2][0] - whole_loss) <= 1e-10 * abs(whole_loss)
    torch.testing.assert_close(results[2][1], results[None][1], rtol=1e-10, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), name=st.sampled_from(NAMES), size=st.integers(1, 40))
def test_blocks_equal_the_whole_microbatch_on_random_fixtures(dense, seed, name, size):
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, seed, B=3, masked=(seed % 4,), chunks=(1, 9))
    whole = loss_grad_metrics(config, student, batch, teachers)
    assert_equal_results(loss_grad_metrics(config, student, batch, teachers, block_size=size), whole, 1e-10, f"{name} {size}")


def test_chunk_ids_out_of_order_make_blocks_grow_and_still_match(dense):
    config = configs(dense)["gold"]
    batch, student, teachers = data_for(config, 43, B=2, masked=())
    for key in ("alignment_0_student_chunk_id", "alignment_0_teacher_chunk_id"):  # reverse each row's real ids
        ids = batch[key].clone()
        for b in range(ids.shape[0]):
            real = (ids[b] >= 0).nonzero().flatten()
            ids[b, real] = ids[b, real].flip(0)
        batch[key] = ids
    whole = loss_grad_metrics(config, student, batch, teachers)
    assert whole[2]["num_valid_chunks_t0"] > 0
    for size in (1, 2, 5):
        assert_equal_results(loss_grad_metrics(config, student, batch, teachers, block_size=size), whole, 1e-10, f"size {size}")


@pytest.mark.parametrize("name", ("pkl", "alm", "sum_dynamic_weights", "select_teacher", "averaged_logits"))
def test_masked_and_empty_microbatches_give_a_connected_zero(dense, name):
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, 47)
    masked = dict(batch, sample_mask=torch.zeros_like(batch["sample_mask"]))
    empty = rows_of(batch, slice(0, 0))
    for mb, x, ts in ((masked, student, teachers), (empty, student[:0], {i: t[:0] for i, t in teachers.items()})):
        norms = L.GlobalNormalizers(1.0, {i: 1.0 for i in range(len(config.teachers))})
        for size in (None, 2):
            loss, grad, metrics = loss_grad_metrics(config, x, mb, ts, norms, size)
            assert loss.item() == 0 and grad.abs().sum() == 0 and metrics["num_valid_tokens"] == 0


def test_without_a_gradient_only_the_value_is_computed(dense):
    config = dataclasses.replace(configs(dense)["dynamic_loss_scaling"], block_size=2)
    batch, student, teachers = data_for(config, 53)
    norms = L.compute_global_normalizers(batch, config)
    with_grad = loss_grad_metrics(config, student, batch, teachers, norms, 2)
    with torch.no_grad():
        loss, metrics = L.xtoken_kd_loss(student.requires_grad_(), batch, teachers, config=config, normalizers=norms)
    assert not loss.requires_grad and loss.item() == with_grad[0].item()
    plain, _ = L.xtoken_kd_loss(student.detach(), batch, teachers, config=config, normalizers=norms)
    assert not plain.requires_grad and plain.item() == with_grad[0].item()


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_logits_already_in_the_compute_dtype_are_left_alone(dense, dtype):
    "Such a block is the logits' own memory, which the CE computed in place must not touch (a value pass, then the gradient)."
    config = dataclasses.replace(configs(dense)["dynamic_loss_scaling"], block_size=2)
    batch, student, teachers = data_for(config, 61)
    x = student.to(dtype).requires_grad_()
    before = x.detach().clone()
    loss, _ = L.xtoken_kd_loss(x, batch, teachers, config=config, normalizers=L.compute_global_normalizers(batch, config))
    loss.backward()
    assert torch.equal(x.detach(), before) and x.grad.abs().sum() > 0


def test_the_incoming_gradient_scales_the_stored_one(dense):
    config = configs(dense)["gold"]
    batch, student, teachers = data_for(config, 59)
    x = student.clone().requires_grad_()
    loss, _ = L.xtoken_kd_loss(x, batch, teachers, config=dataclasses.replace(config, block_size=3),
                               normalizers=L.compute_global_normalizers(batch, config))
    (2.5 * loss).backward()
    expected = loss_grad_metrics(config, student, batch, teachers)[1]
    torch.testing.assert_close(x.grad, 2.5 * expected, rtol=1e-10, atol=1e-14)


def test_block_size_is_validated(dense):
    with pytest.raises(ValueError, match="block_size: expected an int >= 1 or None, got 0"):
        L.XTokenLossConfig(V_S, [spec("alm", dense)], block_size=0)
    assert L.XTokenLossConfig(V_S, [spec("alm", dense)]).block_size == L.XTokenLossConfig.block_size

# --------------------------------------------------------------------------------------------- fused with the lm_head


def fused_inputs(seed, batch, dtype=torch.float64, width=W_S):
    g = torch.Generator().manual_seed(seed)
    B, T = batch["input_ids"].shape
    hidden = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(width, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    bias = torch.randn(width, generator=g, dtype=torch.float64).to(dtype)
    return hidden, weight, bias


def fused_and_plain(config, batch, teachers, hidden, weight, bias, size):
    norms = L.compute_global_normalizers(batch, config)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    loss, metrics = L.xtoken_kd_loss_fused(leaves[0], leaves[1], batch, teachers, config=dataclasses.replace(config, block_size=size),
                                           normalizers=norms, bias=leaves[2] if bias is not None else None)
    fused = (loss.detach(), torch.autograd.grad(loss, leaves), metrics)
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    logits = leaves[0] @ leaves[1].T + (leaves[2] if bias is not None else 0)
    loss, metrics = L.xtoken_kd_loss(logits, batch, teachers, config=dataclasses.replace(config, block_size=None), normalizers=norms)
    return fused, (loss.detach(), torch.autograd.grad(loss, leaves), metrics)


@pytest.mark.parametrize("name", ("pkl", "gold", "hkl", "topk_kl", "alm", "uld", "sum_dynamic_weights", "dynamic_loss_scaling"))
@pytest.mark.parametrize("with_bias", (True, False))
def test_fused_lm_head_equals_the_logits_path(dense, name, with_bias):
    config = configs(dense)[name]
    batch, _, teachers = data_for(config, 61)
    hidden, weight, bias = fused_inputs(62, batch)
    for size in (1, 4, None):
        (loss, grads, metrics), (loss_e, grads_e, metrics_e) = fused_and_plain(config, batch, teachers, hidden, weight,
                                                                               bias if with_bias else None, size)
        assert abs(loss.item() - loss_e.item()) <= 1e-10 * abs(loss_e.item()), (name, size)
        for got, expected in zip(grads, grads_e): torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)
        for key, value in metrics_e.items(): assert abs(float(metrics[key]) - float(value)) <= 1e-10 * max(1, abs(float(value))), key


@pytest.mark.parametrize("rows", (1, 7, 10 ** 9))
def test_fused_lm_head_gradient_summed_over_queued_blocks_matches(dense, rows, monkeypatch):
    monkeypatch.setattr(LF, "FUSED_WEIGHT_ROWS", rows)  # 1: after every block; 7: queues of 3-4 blocks of 2; 10**9: at the end
    config = configs(dense)["pkl"]
    batch, _, teachers = data_for(config, 63)
    hidden, weight, bias = fused_inputs(64, batch)
    (loss, grads, _), (loss_e, grads_e, _) = fused_and_plain(config, batch, teachers, hidden, weight, bias, 2)
    assert abs(loss.item() - loss_e.item()) <= 1e-10 * abs(loss_e.item())
    for got, expected in zip(grads, grads_e): torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)


def test_fused_lm_head_in_fp32(dense):
    config = configs(dense)["gold"]
    batch, _, teachers = data_for(config, 67, dtype=torch.float32)
    hidden, weight, bias = fused_inputs(68, batch, torch.float32)
    (loss, grads, _), (loss_e, grads_e, _) = fused_and_plain(config, batch, teachers, hidden, weight, bias, 3)
    assert loss.dtype == torch.float32 and abs(loss.item() - loss_e.item()) <= 1e-5 * abs(loss_e.item())
    for got, expected in zip(grads, grads_e):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)

def test_fused_forward_keeps_no_graph_of_its_blocks(dense):
    "The gradients the fused forward keeps for backward are plain tensors: no autograd graph holds a block's logits."
    config = configs(dense)["gold"]
    batch, _, teachers = data_for(config, 73)
    hidden, weight, bias = (t.requires_grad_() for t in fused_inputs(74, batch))
    loss, _ = L.xtoken_kd_loss_fused(hidden, weight, batch, teachers, config=dataclasses.replace(config, block_size=2),
                                     normalizers=L.compute_global_normalizers(batch, config), bias=bias)
    kept = loss.grad_fn.grads  # the custom function's context holds them until backward
    assert len(kept) == 3 and all(g.grad_fn is None and not g.requires_grad for g in kept)


def test_fused_grad_accumulation_dtype(dense):
    "bf16 weights: summing the lm_head gradient in fp32 rounds once; the default sums in bf16, one rounding per block."
    config = configs(dense)["pkl"]
    batch, _, teachers = data_for(config, 75, dtype=torch.float32)
    hidden, weight, bias = fused_inputs(76, batch, torch.bfloat16)
    norms = L.compute_global_normalizers(batch, config)
    def grads(**kw):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, _ = L.xtoken_kd_loss_fused(*leaves[:2], batch, teachers, config=dataclasses.replace(config, block_size=1),
                                         normalizers=norms, bias=leaves[2], **kw)
        return torch.autograd.grad(loss, leaves)
    exact = [g.float() for g in grads(grad_accum_dtype=torch.float64)]
    fp32, default = grads(grad_accum_dtype=torch.float32), grads()
    assert all(g.dtype == torch.bfloat16 for g in fp32 + default)
    for g, e in zip(fp32[1:], exact[1:]): torch.testing.assert_close(g.float(), e.to(torch.bfloat16).float(), rtol=0, atol=0)
    T = batch["input_ids"].shape[1]  # one bf16 rounding per block (T blocks) at most
    for g, e in zip(default[1:], exact[1:]): assert (g.float() - e).abs().max() <= T * 2 ** -8 * e.abs().max()
    with pytest.raises(TypeError, match="grad_accum_dtype"): grads(grad_accum_dtype="float32")

# ------------------------------------------------------------------------------------------------------ on a GPU


def _to(obj, device):
    if isinstance(obj, torch.Tensor): return obj.to(device)
    return {k: _to(v, device) for k, v in obj.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_blocks_and_fused_on_cuda_equal_the_cpu_whole_microbatch(dense, name):
    "On a GPU, every configuration's blocked and fused forms give the CPU's whole-microbatch loss and gradients (fp64)."
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, 71)
    whole = loss_grad_metrics(config, student, batch, teachers)
    on = lambda x: _to(x, "cuda")
    got = loss_grad_metrics(config, on(student), on(batch), on(teachers), L.compute_global_normalizers(batch, config), 3)
    assert_equal_results((got[0].cpu(), got[1].cpu(), got[2]), whole, 1e-9, f"{name} on cuda, block_size=3")
    if config.teachers[0].mode == "topk_kl": return  # the fused form is checked on the cross-vocabulary modes
    hidden, weight, bias = fused_inputs(72, batch)
    (loss, grads, _), (loss_e, grads_e, _) = fused_and_plain(config, on(batch), on(teachers), on(hidden), on(weight),
                                                             on(bias), 3)
    assert abs(loss.item() - loss_e.item()) <= 1e-9 * max(1.0, abs(loss_e.item())), name
    for g, e in zip(grads, grads_e): torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("block_size", (None, 2))
def test_a_target_id_past_the_logits_width_is_refused(dense, block_size):
    "An input id the student logits cannot score is refused once per microbatch, blocked or not, naming the vocabulary size."
    config = dataclasses.replace(configs(dense)["alm"], block_size=block_size)
    batch, student, teachers = data_for(config, 79)
    batch["input_ids"] = batch["input_ids"].clone()
    batch["input_ids"][0, 1] = student.shape[-1] + 3
    with pytest.raises(ValueError, match=f"input_ids holds id {student.shape[-1] + 3} at a real token; expected ids < {V_S}"):
        L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=L.compute_global_normalizers(batch, config))


# ------------------------------------------------------------------------------------------ host syncs per block

# ops that make the host wait for a CUDA device (a value read back, or an output size that depends on the data);
# on a CPU they run like any other op, so they are counted where they are called
DEVICE_SYNCS = {"_local_scalar_dense", "equal", "nonzero", "masked_select", "bincount", "is_nonzero", "unique", "_unique2",
                "unique_consecutive", "histc", "masked_scatter"}
# the plan of the blocks reads its chunk ids on the CPU on purpose: its values never wait for a device
PLANNING = "_plan_blocks"


def device_syncs(run):
    "How many ops of `run()` would wait for a CUDA device, outside the CPU planning of the blocks."
    import traceback
    from torch.utils._python_dispatch import TorchDispatchMode
    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
            if name in DEVICE_SYNCS or bool_index:
                ours = [f.name for f in traceback.extract_stack() if "xtoken_dp" in f.filename]
                if ours and PLANNING not in ours: count[0] += 1
            return func(*args, **(kwargs or {}))

    with Count(): run()
    return count[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_blockwise_pass_waits_for_the_device_no_more_with_more_blocks(dense, name, monkeypatch):
    "The loss's device syncs are per microbatch: cutting it into 3x as many blocks adds none (a GPU never idles per block)."
    config = configs(dense)[name]
    batch, student, teachers = data_for(config, 5, dtype=torch.float32, chunks=(14, 20))
    blocks, block_parts = [0], LB._block_parts
    monkeypatch.setattr(LB, "_block_parts", lambda *a: (blocks.__setitem__(0, blocks[0] + 1), block_parts(*a))[1])
    loss_grad_metrics(config, student, batch, teachers, block_size=12)  # loads the projection files into their caches
    counts = {}
    for size in (12, 3):
        blocks[0] = 0
        syncs = device_syncs(lambda: loss_grad_metrics(config, student, batch, teachers, block_size=size))
        counts[size] = (syncs, blocks[0])
    assert counts[3][1] >= 3 * counts[12][1], counts
    assert counts[3][0] == counts[12][0], counts


def distinct_bf16(g, shape):
    "Values exact in bf16 and distinct within each row (n/16 for distinct integers n), so no sort meets a tie."
    *lead, V = shape
    n = torch.stack([torch.randperm(256, generator=g)[:V] for _ in range(math.prod(lead))])
    return ((n.float() - 128) / 16).reshape(*lead, V)


@pytest.mark.parametrize("k, kappas", [(9, (1.0, 1.0)), (3, (2.0, 0.5)), (5, (0.7, 1.0))])
def test_uld_sorts_16_bit_logits_as_their_probabilities(k, kappas):
    "ULD's sort of 16-bit logits (softmax keeps their order) gives the sort of their probabilities: values and gradient."
    g = torch.Generator().manual_seed(k)
    a, b, w = distinct_bf16(g, (3, 4, 11)).requires_grad_(), distinct_bf16(g, (3, 4, 9)), torch.randn(3, 4, generator=g)
    ours = LU._SortedSoftmaxL1.apply(a, b, *kappas, k, torch.bfloat16, torch.bfloat16)
    ref = LU.sorted_l1(torch.softmax(a / kappas[0], -1), torch.softmax(b / kappas[1], -1), k)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)  # fp32: the probabilities round in another order
    (grad,), (grad_ref,) = (torch.autograd.grad((x * w).sum(), a) for x in (ours, ref))
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)


def tied_16_bit(g, shape, scale, dtype):
    "Normal logits on a grid of quarters, exact in a 16-bit `dtype`, as fp32: many values repeat within each row."
    return (torch.randn(shape, generator=g) * scale * 4).round().div(4).to(dtype).float()


def run_sums(values, logits):
    "Per row, the sum of `values` over each run of equal `logits` (float64), and each element's run."
    ids = torch.unique(logits, return_inverse=True)[1]
    width = int(ids.max()) + 1
    runs = ids + torch.arange(logits.shape[0])[:, None] * width
    sums = torch.zeros(logits.shape[0] * width, dtype=torch.float64)
    return sums.index_add_(0, runs.view(-1), values.double().view(-1)), runs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, kappas, scale", [(30, (1.0, 1.0), 3.0), (20, (1.5, 0.7), 2.0), (150, (1.0, 1.0), 0.3),
                                              (7, (2.0, 1.0), 8.0)])
def test_uld_counts_16_bit_logits_as_a_sort_of_their_probabilities(dtype, k, kappas, scale):
    """ULD's counting route on rows full of ties: the loss of a float64 sort of the probabilities, and per run of tied
    logits the same gradient in sum, shared evenly within the run."""
    g = torch.Generator().manual_seed(k)
    a, b, w = tied_16_bit(g, (70, 200), scale, dtype), tied_16_bit(g, (70, 150), scale, dtype), torch.randn(70, generator=g)
    a64 = a.double().requires_grad_()
    ref = LU.sorted_l1(torch.softmax(a64 / kappas[0], -1), torch.softmax(b.double() / kappas[1], -1), k)
    ours = LU._CountedSoftmaxL1.apply(a.requires_grad_(), b, *kappas, k, dtype, dtype)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=1e-7)
    (grad,), (grad_ref,) = torch.autograd.grad((ours * w).sum(), a), torch.autograd.grad((ref * w.double()).sum(), a64)
    (sums, runs), (sums_ref, _) = run_sums(grad, a.detach()), run_sums(grad_ref, a.detach())
    sizes = torch.bincount(runs.view(-1), minlength=sums.numel())
    assert sizes.max() > 5 and grad_ref.abs().max() > 0
    torch.testing.assert_close(sums, sums_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), (sums / sizes.clamp(min=1))[runs], rtol=1e-6, atol=1e-9)


def test_uld_counting_waits_for_no_device_and_counts_the_same():
    "Where reading values would wait for a device, the counting route counts every bin by `index_add_`, waiting for none: same results."
    g = torch.Generator().manual_seed(5)
    a, b = tied_16_bit(g, (70, 300), 3.0, torch.bfloat16), tied_16_bit(g, (70, 250), 3.0, torch.bfloat16)

    def loss_grad():
        x = a.clone().requires_grad_()
        loss = LU._CountedSoftmaxL1.apply(x, b, 1.5, 1.0, 200, torch.bfloat16, torch.bfloat16)
        return loss, torch.autograd.grad(loss.sum(), x)[0]

    on_host = loss_grad()
    assert device_syncs(loss_grad) > 0  # the host picks the held bins
    with pytest.MonkeyPatch.context() as m:
        m.setattr(LU, "HOST_DEVICES", ())
        on_device = loss_grad()
        assert device_syncs(loss_grad) == 0
    for got, expected in zip(on_device, on_host): torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def test_uld_counting_keeps_softmax_on_infinities_and_nan():
    "A NaN or +inf logit makes its row's loss and gradient NaN, as softmax does; -inf logits (masked) have probability 0."
    g = torch.Generator().manual_seed(6)
    a, b = tied_16_bit(g, (4, 60), 2.0, torch.bfloat16), tied_16_bit(g, (4, 50), 2.0, torch.bfloat16)
    a[0, 3], b[1, 7], a[2, :20], b[3, 10:] = math.nan, math.inf, -math.inf, -math.inf
    ours = LU._CountedSoftmaxL1.apply(a.requires_grad_(), b, 1.0, 1.0, 40, torch.bfloat16, torch.bfloat16)
    ref = LU.sorted_l1(torch.softmax(a.detach().double(), -1), torch.softmax(b.double(), -1), 40)
    assert ours[:2].isnan().all() and ref[:2].isnan().all()
    torch.testing.assert_close(ours[2:].double(), ref[2:], rtol=1e-6, atol=1e-7)
    grad = torch.autograd.grad(ours.sum(), a)[0]
    assert grad[:2].isnan().all() and grad[2:].isfinite().all() and (grad[2, :20] == 0).all()


def take_16_bit_route(monkeypatch, route):
    "From here on ULD takes the 16-bit `route` (\"sort\" or \"count\") on CPU, and sorting the probabilities fails the test."
    monkeypatch.setattr(LM, "SIXTEEN_BIT_ULD", {"cpu": route})
    monkeypatch.setattr(LM, "sorted_l1", lambda *a: pytest.fail("the probabilities were sorted"))


ROUTES = ["sort", "count"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("overwrite", [False, True], ids=["blocks", "overwrite"])
def test_uld_of_16_bit_logits_takes_the_16_bit_route_and_keeps_its_results(dense, overwrite, route, monkeypatch):
    "bf16 student and teacher logits: the loss through a 16-bit route equals the probability sort's, whole and in blocks."
    config = dataclasses.replace(configs(dense)["uld"], uld_student_temperature=1.5, overwrite_logits=overwrite)
    batch, student, teachers = data_for(config, 41)
    g = torch.Generator().manual_seed(42)
    student = distinct_bf16(g, student.shape).bfloat16()
    teachers = {i: distinct_bf16(g, t.shape).bfloat16() for i, t in teachers.items()}
    monkeypatch.setattr(LM, "SIXTEEN_BIT_ULD", {})
    ref = loss_grad_metrics(config, student, batch, teachers, block_size=None if not overwrite else 3)
    take_16_bit_route(monkeypatch, route)
    for size in ((None, 3) if not overwrite else (3,)):
        assert_equal_results(loss_grad_metrics(config, student, batch, teachers, block_size=size), ref, 2 ** -7, f"block_size={size}")


@pytest.mark.parametrize("route", ROUTES)
def test_uld_fused_with_16_bit_logits_takes_the_16_bit_route(dense, route, monkeypatch):
    "bf16 hidden states and lm_head (logits distinct within each row): the fused loss is the probability sort's."
    config = configs(dense)["uld"]
    batch, _, teachers = data_for(config, 43)
    g = torch.Generator().manual_seed(44)
    B, T = batch["input_ids"].shape
    hidden = torch.nn.functional.one_hot(torch.randint(0, HIDDEN, (B, T), generator=g), HIDDEN).bfloat16()
    weight = distinct_bf16(g, (HIDDEN, W_S)).T.contiguous().bfloat16()  # each position's logits: one column of it
    teachers = {i: distinct_bf16(g, t.shape).bfloat16() for i, t in teachers.items()}

    def loss_and_grads():
        leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
        loss, _ = L.xtoken_kd_loss_fused(*leaves, batch, teachers, config=dataclasses.replace(config, block_size=3),
                                         normalizers=L.compute_global_normalizers(batch, config))
        return loss.detach(), torch.autograd.grad(loss, leaves)

    monkeypatch.setattr(LM, "SIXTEEN_BIT_ULD", {})
    loss_e, grads_e = loss_and_grads()
    take_16_bit_route(monkeypatch, route)
    loss, grads = loss_and_grads()
    assert loss_e.item() != 0 and abs(loss.item() - loss_e.item()) <= 1e-5 * abs(loss_e.item())
    for got, expected in zip(grads, grads_e):
        assert expected.abs().max() > 0
        assert (got.double() - expected.double()).abs().max() <= 2 ** -7 * expected.abs().max(), (got, expected)
