"""Acceptance tests of `xtoken_dp.losses` that run in one process: primitives (L1-L3, L4 local, L5),
inputs (L6), every mode against a loop reference (L7-L14), aggregation (L15-L18), normalisation and metrics
(L21, L22). The multi-process tests (L4, L16, L19, L20) are in `test_losses_dist.py`, I11 in `test_losses_ipc.py`.
"""
import dataclasses
import math

import pytest
import torch

from xtoken_dp import losses as L
from xtoken_dp.bench.chunks import one_hot_chunk_average as one_hot_average  # the reference loss implementation's one-hot bmm route
from xtoken_dp.schema import AlignmentBatch, make_jagged, lengths_to_offsets
from losses_helpers import (V_S, V_T, W_S, W_T, dense_matrix, exact_map_loop, make_batch, make_logits, ref_alm, ref_ce,
                            ref_counts, ref_gold, ref_pkl, ref_topk_kl, ref_uld, rows_of, write_projections)


@pytest.fixture(scope="module")
def projections(tmp_path_factory):
    return write_projections(tmp_path_factory.mktemp("projections"))


@pytest.fixture(scope="module")
def dense(projections): return projections[0]


def spec(mode, path=None, **kw):
    return L.TeacherLossSpec(mode, path if mode in L.PROJECTION_MODES else None, V_S if mode == "topk_kl" else V_T, **kw)


def config_for(mode, path=None, **kw):
    return L.XTokenLossConfig(V_S, [spec(mode, path)], **kw)


def kd_total(student, batch, teachers, config, teacher=0):
    return L.per_chunk_losses(student, batch, teachers, config=config, teacher=teacher).total.item()


def lists(student, teachers, i=0): return student.tolist(), teachers[i].tolist()


def close(a, b, tol): assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)

# ------------------------------------------------------------------------------------------------ L1-L3 primitives


def test_L1_chunk_average_log_probs_means_sizes_errors_and_reference():
    values = torch.tensor([[[1., 2.], [3., 4.], [5., 6.], [7., 8.]]])
    avg, sizes = L.chunk_average_log_probs(values, torch.tensor([[0, -1, 1, 1]]), 3)
    assert sizes.tolist() == [[1., 2., 0.]]
    assert avg[0, 0].tolist() == [1., 2.] and avg[0, 1].tolist() == [6., 7.]  # -1 ignored, exact means
    torch.testing.assert_close(avg[0, 2], torch.zeros(2), atol=1e-5, rtol=0)  # empty chunk: 0 with size 0
    for bad in ([[0, -2, 1, 1]], [[0, 3, 1, 1]]):
        with pytest.raises(ValueError, match="max_chunks=3"): L.chunk_average_log_probs(values, torch.tensor(bad), 3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 6, generator=g, requires_grad=True)
    ids = torch.randint(-1, 9, (3, 40), generator=g)  # non-monotone
    ours, our_sizes = L.chunk_average_log_probs(x, ids, 9)
    ref, ref_sizes = one_hot_average(x, ids, 9)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(our_sizes, ref_sizes)
    upstream = torch.randn(3, 9, 6, generator=g)
    grad_ours, = torch.autograd.grad(ours, x, upstream)
    grad_ref, = torch.autograd.grad(ref, x, upstream)
    torch.testing.assert_close(grad_ours, grad_ref, atol=1e-6, rtol=1e-6)


def _largest_allocation(fn):
    "Bytes of the largest single CPU allocation event recorded by the profiler while `fn` runs."
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def test_L1_no_T_by_C_allocation_in_a_profiler_memory_trace():
    T, C, V = 4096, 3000, 64
    ids = (torch.arange(T) * C // T)[None]
    x = torch.randn(1, T, V, requires_grad=True)
    grad = torch.randn(1, C, V)

    def ours():
        avg, _ = L.chunk_average_log_probs(x, ids, C)
        avg.backward(grad)

    def one_hot():
        avg, _ = one_hot_average(x, ids, C)
        avg.backward(grad)

    t_by_c = T * C  # a [T, C] bool one-hot; a float one would be 4x
    assert _largest_allocation(one_hot) >= t_by_c  # the trace does see a [T, C] term where there is one
    assert _largest_allocation(ours) < t_by_c // 4, "chunk_average_log_probs allocated a [T, C]-sized buffer"


def test_L1_chunk_first_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 3, generator=g)
    ids = torch.randint(-1, 4, (2, 9), generator=g)
    first, sizes = L.chunk_first(x, ids, 4)
    for b in range(2):
        for c in range(4):
            positions = [p for p in range(9) if ids[b, p] == c]
            assert sizes[b, c] == len(positions)
            expected = x[b, positions[0]] if positions else torch.zeros(3)
            assert torch.equal(first[b, c], expected)


def test_L2_valid_chunk_mask_needs_all_three():
    s = torch.tensor([[1., 0., 1., 1.]])
    t = torch.tensor([[1., 1., 0., 1.]])
    pv = torch.tensor([[True, True, True, False]])
    assert L.valid_chunk_mask(s, t, pv).tolist() == [[True, False, False, False]]
    with pytest.raises(ValueError, match="one shape"): L.valid_chunk_mask(s, t[:, :3], pv)
    with pytest.raises(ValueError, match="one shape"): L.valid_chunk_mask(s, t, pv.T)


def _sparse(seed=0, shape=(6, 5)):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(*shape, generator=g) * (torch.rand(*shape, generator=g) < 0.5)
    return dense.to_sparse().coalesce(), dense


def test_L3_fp32_sparse_mm_under_cpu_bf16_autocast():
    M, dense = _sparse()
    g = torch.Generator().manual_seed(1)
    D = torch.randn(6, 4, generator=g, requires_grad=True)
    upstream = torch.randn(5, 4, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = L.Fp32SparseMM.apply(M, D)
        assert out.dtype == torch.float32
        grad, = torch.autograd.grad(out, D, upstream)
    assert grad.dtype == torch.float32
    exact = dense.double()
    torch.testing.assert_close(out, (exact.T @ D.double()).float(), atol=1e-6, rtol=1e-6)  # bf16 would miss by ~1e-2
    torch.testing.assert_close(grad, (exact @ upstream.double()).float(), atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_L3_fp32_sparse_mm_under_cuda_bf16_autocast():
    M, dense = _sparse()
    M = M.cuda()
    D = torch.randn(6, 4, device="cuda", requires_grad=True)
    upstream = torch.randn(5, 4, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = L.Fp32SparseMM.apply(M, D)
        grad, = torch.autograd.grad(out, D, upstream)
    assert out.dtype == grad.dtype == torch.float32
    torch.testing.assert_close(out, dense.cuda().T @ D, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, dense.cuda() @ upstream, atol=1e-6, rtol=1e-6)


def test_L3_gradcheck_fp64_no_grad_for_M_and_slice_then_project():
    M, dense = _sparse()
    D = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda d: L.Fp32SparseMM.apply(M, d), D)
    M_leaf = M.clone().requires_grad_()
    out = L.Fp32SparseMM.apply(M_leaf, D)
    out.sum().backward()
    assert M_leaf.grad is None and D.grad is not None
    cols = torch.tensor([0, 2, 3])
    sliced = L.select_projection_columns(M, cols)
    assert sliced.is_coalesced() and torch.equal(sliced.to_dense(), dense[:, cols])
    torch.testing.assert_close(L.Fp32SparseMM.apply(sliced, D.detach().float()),
                               L.Fp32SparseMM.apply(M, D.detach().float())[cols], atol=1e-6, rtol=1e-6)
    for bad, message in ((torch.tensor([3, 1]), "sorted and unique"), (torch.tensor([1, 1]), "sorted and unique"),
                         (torch.tensor([], dtype=torch.int64), "non-empty"), (torch.tensor([0, 5]), r"\[0, 5\)")):
        with pytest.raises(ValueError, match=message): L.select_projection_columns(M, bad)

# --------------------------------------------------------------------------------------------- L4 local, L5, L6


def test_L4_dp_all_reduce_sum_without_distributed_is_a_fresh_fp32_copy():
    for local in (torch.tensor(5, dtype=torch.int64), torch.tensor([2.5], dtype=torch.float64)):
        before = local.clone()
        total = L.dp_all_reduce_sum(local)
        assert total.dtype == torch.float32 and total.dim() == 0 and total.item() == before.item()
        assert torch.equal(local, before) and total.data_ptr() != local.data_ptr() and not total.requires_grad
    with pytest.raises(ValueError, match="one element"): L.dp_all_reduce_sum(torch.ones(3))


def test_L5_alignment_from_flat_batch():
    batch = make_batch(5, B=3, teachers=2)
    seen = []

    class Recording(dict):
        def __getitem__(self, key):
            seen.append(key)
            return super().__getitem__(key)

    alignment = L.alignment_from_flat_batch(Recording(batch), prefix="alignment_1_")
    assert tuple(k.removeprefix("alignment_1_") for k in seen) == AlignmentBatch.field_names()  # schema-driven
    for name in AlignmentBatch.field_names():
        assert getattr(alignment, name) is batch[f"alignment_1_{name}"]  # dense fields by identity
    unnumbered = {k.replace("alignment_0_", "alignment_"): v for k, v in batch.items()}
    assert L.alignment_from_flat_batch(unnumbered).student_chunk_id is batch["alignment_0_student_chunk_id"]
    missing = {k: v for k, v in batch.items() if k != "alignment_1_num_chunks"}
    with pytest.raises(KeyError, match="alignment_1_num_chunks"): L.alignment_from_flat_batch(missing, prefix="alignment_1_")
    padded = AlignmentBatch.from_flat(batch, prefix="alignment_0_")
    jagged = padded.to_jagged(batch["input_lengths"], batch["teacher_0_input_lengths"]).as_flat("alignment_0_")
    back = L.alignment_from_flat_batch(jagged, prefix="alignment_0_")
    assert back.layout == "padded"
    width = back.student_chunk_id.shape[1]
    assert torch.equal(back.student_chunk_id, padded.student_chunk_id[:, :width])
    assert (back.student_chunk_id[torch.arange(width) >= batch["input_lengths"][:, None]] == -1).all()  # padded with -1


def _jagged_batch(batch):
    "The same batch with jagged alignment and student token fields."
    out = dict(batch)
    alignment = AlignmentBatch.from_flat(batch, prefix="alignment_0_")
    out.update(alignment.to_jagged(batch["input_lengths"], batch["teacher_0_input_lengths"]).as_flat("alignment_0_"))
    offsets = lengths_to_offsets(batch["input_lengths"])
    for key in ("input_ids", "token_mask"):
        rows = [batch[key][b, :n] for b, n in enumerate(batch["input_lengths"].tolist())]
        out[key] = make_jagged(torch.cat(rows), offsets)
    return out


@pytest.mark.parametrize("mode", ["pkl", "gold", "alm", "uld"])
def test_L6_padded_jagged_and_non_contiguous_inputs_agree(dense, mode):
    batch = make_batch(7)
    student, teachers = make_logits(7, batch)
    config = config_for(mode, dense, vocab_topk=4)
    norms = L.compute_global_normalizers(batch, config)
    expected, _ = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    jagged = _jagged_batch(batch)
    assert L.compute_global_normalizers(jagged, config) == norms
    assert L.xtoken_kd_loss(student, jagged, teachers, config=config, normalizers=norms)[0].item() == expected.item()
    transposed = dict(batch, alignment_0_student_chunk_id=batch["alignment_0_student_chunk_id"].T.contiguous().T,
                      alignment_0_teacher_chunk_id=batch["alignment_0_teacher_chunk_id"].T.contiguous().T)
    assert not transposed["alignment_0_student_chunk_id"].is_contiguous()
    assert L.xtoken_kd_loss(student, transposed, teachers, config=config, normalizers=norms)[0].item() == expected.item()


def test_L6_a_distill_batch_is_read_through_to_flat(dense):
    batch_module = pytest.importorskip("xtoken_dp.batch")
    batch = make_batch(8)
    student, teachers = make_logits(8, batch)
    config = config_for("gold", dense)
    norms = L.compute_global_normalizers(batch, config)
    distill = batch_module.DistillBatch.from_flat(batch, teacher_layout=(True,))
    assert not isinstance(distill, dict) and hasattr(distill, "to_flat")
    assert L.compute_global_normalizers(distill, config) == norms
    expected = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)[0]
    assert L.xtoken_kd_loss(student, distill, teachers, config=config, normalizers=norms)[0].item() == expected.item()


def test_L6_a_tensordict_batch_and_a_long_teacher(dense, projections):
    from tensordict import TensorDict
    batch = make_batch(9)
    student, teachers = make_logits(9, batch)
    config = config_for("pkl", dense, vocab_topk=3)
    norms = L.compute_global_normalizers(batch, config)
    expected = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)[0]
    td = TensorDict(batch, batch_size=[4])
    assert L.xtoken_kd_loss(student, td, teachers, config=config, normalizers=norms)[0].item() == expected.item()
    with pytest.raises(ValueError, match="dense"):  # gold needs the dense top-k format (its exact map)
        L.per_chunk_losses(student, batch, teachers, config=config_for("gold", projections[1]))


def test_L9_loss_under_bf16_autocast_is_computed_in_fp32(dense):
    batch = make_batch(13)
    student, teachers = make_logits(13, batch, dtype=torch.float32)
    for mode in ("pkl", "gold", "alm", "uld"):
        config = config_for(mode, dense)
        norms = L.compute_global_normalizers(batch, config)
        plain, _ = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under, _ = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
        assert under.dtype == torch.float32 and under.item() == plain.item(), mode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["pkl", "gold", "hkl", "alm", "uld", "topk_kl"])
def test_losses_on_cuda_match_cpu(dense, mode):
    batch = make_batch(17)
    student, teachers = make_logits(17, batch, same_vocab=mode == "topk_kl")
    config = config_for(mode, dense, vocab_topk=4)
    norms = L.compute_global_normalizers(batch, config)
    cpu, _ = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    gpu, _ = L.xtoken_kd_loss(student.cuda(), cuda_batch, {0: teachers[0].cuda()}, config=config,
                              normalizers=L.compute_global_normalizers(cuda_batch, config))
    assert abs(gpu.item() - cpu.item()) <= 1e-9 * max(1.0, abs(cpu.item()))


def test_L6_fractional_sample_mask_raises(dense):
    batch = make_batch(7)
    batch["sample_mask"] = torch.tensor([1., 0.5, 1., 0.])
    config = config_for("pkl", dense)
    with pytest.raises(ValueError, match="sample_mask must hold only 0 or 1"): L.compute_global_normalizers(batch, config)
    student, teachers = make_logits(7, batch)
    norms = L.GlobalNormalizers(1.0, {0: 1.0})
    with pytest.raises(ValueError, match="got 0.5 at row 1"):
        L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)

# ------------------------------------------------------------------------------------------------------ L7 CE


def test_L7_ce_uniform_masks_and_all_masked(dense):
    batch = make_batch(3)
    config = config_for("uld")
    norms = L.compute_global_normalizers(batch, config)
    uniform = torch.zeros(4, batch["input_ids"].shape[1], W_S, requires_grad=True)
    _, teachers = make_logits(3, batch)
    _, metrics = L.xtoken_kd_loss(uniform, batch, teachers, config=config, normalizers=norms)
    close(metrics["ce_loss"].item(), math.log(W_S), 1e-5)
    student, _ = make_logits(4, batch)
    n_tok, _ = ref_counts([batch], ["uld"])
    assert norms.n_tok == n_tok
    _, metrics = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    close(metrics["ce_loss"].item(), ref_ce(student.tolist(), batch) / n_tok, 1e-6)  # the masked sample is left out
    masked = dict(batch, sample_mask=torch.zeros(4))
    norms0 = L.compute_global_normalizers(masked, config)
    assert (norms0.n_tok, norms0.n_chunks) == (1.0, {0: 1.0})  # clamped: no targets anywhere
    student = student.clone().requires_grad_()
    loss, metrics = L.xtoken_kd_loss(student, masked, teachers, config=config, normalizers=norms0)
    assert loss.item() == 0.0 and metrics["num_valid_tokens"].item() == 0 and metrics["num_valid_chunks_t0"].item() == 0
    loss.backward()
    assert student.grad is not None and student.grad.abs().sum().item() == 0.0

# ------------------------------------------------------------------------------------------------- L8 P-KL


PKL_CASES = [dict(), dict(reverse_kl=True), dict(chunk_target="geometric"), dict(chunk_target="geometric", reverse_kl=True),
             dict(exact_token_match_only=True), dict(temperature=2.0), dict(temperature=2.0, reverse_kl=True),
             dict(chunk_reduce="first"), dict(vocab_topk=3), dict(vocab_topk=3, topk_scope="microbatch"),
             dict(projection_row_normalize=False), dict(reference_formulas=True), dict(reference_formulas=True, reverse_kl=True),
             dict(vocab_topk=3, reverse_kl=True), dict(vocab_topk=3, chunk_target="geometric"),
             dict(chunk_pairs="all"), dict(chunk_pairs="all", chunk_reduce="first"), dict(pkl_unseen="renormalize"),
             dict(pkl_unseen="renormalize", chunk_pairs="all", vocab_topk=3, reverse_kl=True)]


def _pkl_reference(student, teachers, batch, path, kw):
    reference = kw.get("reference_formulas", False)
    M = dense_matrix(path, row_normalize=kw.get("projection_row_normalize", True) and not reference)
    z, y = lists(student, teachers)
    return ref_pkl(z, y, batch, M, kappa=kw.get("temperature", 1.0), topk=kw.get("vocab_topk"),
                   scope="microbatch" if reference else kw.get("topk_scope", "sample"), reverse=kw.get("reverse_kl", False),
                   target=kw.get("chunk_target", "arithmetic"), reduce=kw.get("chunk_reduce", "mean"),
                   exact_only=kw.get("exact_token_match_only", False), reference=reference,
                   pairs=kw.get("chunk_pairs", "one_to_one"), unseen=kw.get("pkl_unseen", "bucket"))


@pytest.mark.parametrize("kw", PKL_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_L8_pkl_equals_a_per_chunk_loop(projections, kw):
    batch = make_batch(21)
    for path in projections:
        config = config_for("pkl", path, **kw)
        student, teachers = make_logits(22, batch)
        ref_total, per = _pkl_reference(student, teachers, batch, path, kw)
        assert per, "the fixture must have valid chunks"
        close(kd_total(student, batch, teachers, config), ref_total, 1e-10)  # fp64
        close(kd_total(student.float(), batch, {0: teachers[0].float()}, config), ref_total, 1e-6)  # fp32
        term = L.per_chunk_losses(student, batch, teachers, config=config)
        for (b, c), value in per.items(): close(term.per_unit[b, c].item(), value, 1e-10)
        assert term.valid.sum().item() == len(per)


def test_L8_pkl_loss_and_metrics_end_to_end(dense):
    batch = make_batch(23)
    config = config_for("pkl", dense, temperature=2.0, ce_loss_scale=0.5, kl_loss_weight=3.0)
    student, teachers = make_logits(24, batch)
    norms = L.compute_global_normalizers(batch, config)
    n_tok, (n_chunks,) = ref_counts([batch], ["pkl"])
    assert (norms.n_tok, norms.n_chunks[0]) == (n_tok, n_chunks)
    loss, metrics = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    kd = _pkl_reference(student, teachers, batch, dense, dict(temperature=2.0))[0] / n_chunks
    ce = ref_ce(student.tolist(), batch) / n_tok
    close(loss.item(), 3.0 * kd + 0.5 * ce, 1e-10)
    close(metrics["kl_loss_t0"].item(), kd, 1e-10)
    assert 0 <= metrics["proj_accuracy_t0"].item() <= 1

# --------------------------------------------------------------------------------------------- L9 gold / H-KL


GOLD_CASES = [dict(), dict(reverse_kl=True), dict(chunk_target="geometric"), dict(temperature=2.0),
              dict(common_renormalize=True), dict(common_renormalize=True, reverse_kl=True), dict(chunk_reduce="first"),
              dict(chunk_reduce="first", uncommon_weight=0.0, common_renormalize=True), dict(uncommon_topk=2),
              dict(uncommon_weight=0.25), dict(exact_token_match_only=True), dict(reference_formulas=True),
              dict(reference_formulas=True, reverse_kl=True), dict(chunk_pairs="all"),
              dict(chunk_pairs="all", chunk_reduce="first", common_renormalize=True)]


@pytest.mark.parametrize("mode", ["gold", "hkl"])
@pytest.mark.parametrize("kw", GOLD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_L9_gold_and_hkl_recomputed_from_the_map(dense, mode, kw):
    token_map = exact_map_loop(dense, mode == "hkl")
    built = L.build_exact_token_map(dense, "cpu", xtoken_loss=mode == "hkl", teacher_vocab_size=V_T, student_vocab_size=V_S)
    assert [built[k].tolist() for k in ("common_student", "common_teacher", "uncommon_student", "uncommon_teacher")] \
        == list(token_map)
    batch = make_batch(31)
    student, teachers = make_logits(32, batch)
    z, y = lists(student, teachers)
    total, common, tail, per = ref_gold(
        z, y, batch, token_map, kappa=kw.get("temperature", 1.0), reverse=kw.get("reverse_kl", False),
        target=kw.get("chunk_target", "arithmetic"), reduce=kw.get("chunk_reduce", "mean"),
        renormalize=kw.get("common_renormalize", True), uncommon_topk=kw.get("uncommon_topk", 8192),
        uncommon_weight=kw.get("uncommon_weight", 1.0), reference=kw.get("reference_formulas", False),
        exact_only=kw.get("exact_token_match_only", False), pairs=kw.get("chunk_pairs", "one_to_one"))
    config = config_for(mode, dense, **kw)
    close(kd_total(student, batch, teachers, config), total, 1e-10)
    close(kd_total(student.float(), batch, {0: teachers[0].float()}, config), total, 1e-6)
    norms = L.compute_global_normalizers(batch, config)
    _, metrics = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    n = norms.n_chunks[0]
    close(metrics["kl_loss_t0"].item(), (common + tail) / n, 1e-10)  # loss = κ²(kl_common + l1)
    close(metrics["kl_common_t0"].item(), common / n, 1e-10)
    close(metrics["l1_uncommon_t0"].item(), tail / n, 1e-10)
    term = L.per_chunk_losses(student, batch, teachers, config=config)
    for (b, c), value in per.items(): close(term.per_unit[b, c].item(), value, 1e-10)

# --------------------------------------------------------------------------------------------------- L10 KL >= 0


def test_L10_default_per_chunk_terms_are_never_negative(projections):
    dense, sparse = projections
    configs = [config_for(m, dense) for m in ("pkl", "gold", "hkl", "alm", "uld")] + [config_for("pkl", sparse)]
    configs += [config_for("pkl", dense, reverse_kl=True, chunk_target="geometric"),
                config_for("gold", dense, common_renormalize=True, reverse_kl=True)]
    for seed in range(200):
        batch = make_batch(1000 + seed, B=2, masked=())
        student, teachers = make_logits(2000 + seed, batch, dtype=torch.float32, scale=4.0)
        for config in configs:
            assert L.per_chunk_losses(student, batch, teachers, config=config).per_unit.min().item() >= -1e-6
        same = make_logits(3000 + seed, batch, dtype=torch.float32, scale=4.0, same_vocab=True)[1]
        assert L.per_chunk_losses(student, batch, same, config=config_for("topk_kl")).per_unit.min().item() >= -1e-6


def test_L10_reference_formulas_are_negative_on_two_disagreeing_teacher_tokens(tmp_path):
    path = tmp_path / "one_hot.pt"  # student token s projects one-hot onto teacher token s
    torch.save({"indices": torch.arange(V_S)[:, None] % V_T, "likelihoods": torch.ones(V_S, 1)}, path)
    alignment = AlignmentBatch.from_padded(  # chunk 1 = one student token, two teacher tokens (ids 1 and 2)
        pair_valid=torch.tensor([[True, True]]), pair_is_correct=torch.tensor([[True, False]]),
        student_exact_partition_mask=torch.tensor([[True, False]]), teacher_exact_partition_mask=torch.tensor([[True, False, False]]),
        student_chunk_id=torch.tensor([[0, 1]]), teacher_chunk_id=torch.tensor([[0, 1, 1]]), num_chunks=torch.tensor([2]),
        validate=True)
    batch = {"input_ids": torch.tensor([[0, 1]]), "token_mask": torch.ones(1, 2, dtype=torch.bool), "sample_mask": torch.ones(1),
             "teacher_0_input_ids": torch.tensor([[0, 1, 2]]), "teacher_0_token_mask": torch.ones(1, 3, dtype=torch.bool),
             **alignment.as_flat("alignment_0_")}
    student = torch.zeros(1, 2, W_S)
    student[0, 0, 1], student[0, 0, 2] = 3.0, 3.0  # the student spreads over both teacher tokens
    teacher = torch.full((1, 3, W_T), -20.0)
    teacher[0, 0, 1] = 20.0  # position 0 is sure of token 1 ...
    teacher[0, 1, 2] = 20.0  # ... position 1 of token 2
    reference = L.per_chunk_losses(student, batch, {0: teacher}, config=config_for("pkl", path, reference_formulas=True))
    default = L.per_chunk_losses(student, batch, {0: teacher}, config=config_for("pkl", path))
    assert reference.valid[0, 1] and reference.per_unit[0, 1].item() < 0  # documented: that "KL" goes negative
    assert default.per_unit[0, 1].item() >= 0

# ------------------------------------------------------------------------------------------------ L11 topk_kl


@pytest.mark.parametrize("kw", [dict(), dict(reverse_kl=True), dict(temperature=2.0), dict(vocab_topk=4)], ids=str)
def test_L11_topk_kl_equals_its_loop(kw):
    batch = make_batch(41)
    student, teachers = make_logits(42, batch, same_vocab=True)
    config = config_for("topk_kl", **kw)
    ref = ref_topk_kl(*lists(student, teachers), batch, kappa=kw.get("temperature", 1.0), topk=kw.get("vocab_topk"),
                      reverse=kw.get("reverse_kl", False))
    close(kd_total(student, batch, teachers, config), ref, 1e-10)


def test_L11_topk_kl_full_k_is_the_full_vocabulary_kl_and_padding_does_not_vote():
    batch = make_batch(43)
    student, teachers = make_logits(44, batch, same_vocab=True)
    config = config_for("topk_kl")
    mask = torch.zeros_like(batch["token_mask"])
    mask[:, :-1] = batch["token_mask"][:, 1:] & (batch["sample_mask"][:, None] == 1)
    lt = torch.log_softmax(teachers[0][..., :V_S], -1)
    ls = torch.log_softmax(student[..., :V_S], -1)
    full = ((lt.exp() * (lt - ls)).sum(-1) * mask).sum()
    close(kd_total(student, batch, teachers, config), full.item(), 1e-10)
    topk = config_for("topk_kl", vocab_topk=4)
    before = L.per_chunk_losses(student, batch, teachers, config=topk).total.item()
    padded = teachers[0].clone()
    padded[~mask] = 1e4  # positions that are not CE targets (padding, the masked sample) do not vote
    assert L.per_chunk_losses(student, batch, {0: padded}, config=topk).total.item() == before

# ---------------------------------------------------------------------------------------------- L12 ALM, L13 ULD


@pytest.mark.parametrize("divergence", ["binary_kl", "binary_ce"])
@pytest.mark.parametrize("tau", [100.0, 3.0])
def test_L12_alm_equals_its_loop(divergence, tau):
    batch = make_batch(51)
    student, teachers = make_logits(52, batch)
    config = config_for("alm", alm_tau=tau, alm_divergence=divergence)
    close(kd_total(student, batch, teachers, config), ref_alm(*lists(student, teachers), batch, tau=tau, divergence=divergence),
          1e-10)


def _one_chunk_alm_batch():
    alignment = AlignmentBatch.from_padded(
        pair_valid=torch.tensor([[True, True]]), pair_is_correct=torch.tensor([[True, False]]),
        student_exact_partition_mask=torch.tensor([[True, False, False]]),
        teacher_exact_partition_mask=torch.tensor([[True, False]]), student_chunk_id=torch.tensor([[0, 1, 1]]),
        teacher_chunk_id=torch.tensor([[0, 1]]), num_chunks=torch.tensor([2]), validate=True)
    return {"input_ids": torch.tensor([[0, 3, 4]]), "token_mask": torch.ones(1, 3, dtype=torch.bool),
            "sample_mask": torch.ones(1), "teacher_0_input_ids": torch.tensor([[0, 5]]),
            "teacher_0_token_mask": torch.ones(1, 2, dtype=torch.bool), **alignment.as_flat("alignment_0_")}


def test_L12_alm_zero_at_equal_likelihoods_equal_gradients_and_finite_near_zero():
    batch = _one_chunk_alm_batch()
    g = torch.Generator().manual_seed(5)
    student = torch.randn(1, 3, W_S, generator=g, dtype=torch.float64, requires_grad=True)
    ls = torch.log_softmax(student.detach()[..., :V_S], -1)   # over the vocabulary: lm_head padding is no token
    L_s = (ls[0, 0, 3] + ls[0, 1, 4]).item()  # the student's chunk log-likelihood
    teacher = torch.zeros(1, 2, W_T, dtype=torch.float64)
    teacher[0, 0, 5] = math.log(math.exp(L_s) * (V_T - 1) / (1 - math.exp(L_s)))  # p_teacher(5) = e^{L_s} over V_T columns
    kl_cfg, ce_cfg = config_for("alm"), config_for("alm", alm_divergence="binary_ce")
    assert abs(L.per_chunk_losses(student, batch, {0: teacher}, config=kl_cfg).total.item()) < 1e-9
    other = torch.randn(1, 2, W_T, generator=g, dtype=torch.float64)
    grads = []
    for cfg in (kl_cfg, ce_cfg):
        total = L.per_chunk_losses(student, batch, {0: other}, config=cfg).total
        grads.append(torch.autograd.grad(total, student)[0])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=1e-10)
    sure = torch.zeros(1, 3, W_S, dtype=torch.float64)
    sure[0, 0, 3] = sure[0, 1, 4] = 200.0  # L_s -> 0
    sure.requires_grad_()
    sure_teacher = torch.zeros(1, 2, W_T, dtype=torch.float64)
    sure_teacher[0, 0, 5] = 200.0
    for cfg in (kl_cfg, ce_cfg):
        total = L.per_chunk_losses(sure, batch, {0: sure_teacher}, config=cfg).total
        grad, = torch.autograd.grad(total, sure)
        assert math.isfinite(total.item()) and torch.isfinite(grad).all()


@pytest.mark.parametrize("kw", [dict(), dict(uld_topk=3), dict(uld_student_temperature=2.0, uld_teacher_temperature=0.5)], ids=str)
def test_L13_uld_equals_its_loop(kw):
    batch = make_batch(61)
    student, teachers = make_logits(62, batch)
    ref = ref_uld(*lists(student, teachers), batch, topk=kw.get("uld_topk"), kappa_s=kw.get("uld_student_temperature", 1.0),
                  kappa_t=kw.get("uld_teacher_temperature", 1.0))
    close(kd_total(student, batch, teachers, config_for("uld", **kw)), ref, 1e-10)


def test_L13_uld_zero_for_equal_sorted_probabilities_and_permutation_invariant():
    batch = make_batch(63)
    student, teachers = make_logits(64, batch)
    config = config_for("uld")
    base = kd_total(student, batch, teachers, config)
    g = torch.Generator().manual_seed(0)
    s_perm, t_perm = torch.randperm(V_S, generator=g), torch.randperm(V_T, generator=g)
    permuted_s = student.clone()
    permuted_s[..., :V_S] = student[..., s_perm]
    permuted_t = teachers[0].clone()
    permuted_t[..., :V_T] = teachers[0][..., t_perm]
    close(kd_total(permuted_s, batch, teachers, config), base, 1e-12)
    close(kd_total(student, batch, {0: permuted_t}, config), base, 1e-12)
    one = _one_chunk_alm_batch()  # chunk 1 starts at student position 0 and teacher position 0
    teacher = torch.randn(1, 2, W_T, generator=g, dtype=torch.float64)
    student = torch.full((1, 3, W_S), -1e9, dtype=torch.float64)
    student[0, 0, s_perm[:V_T]] = teacher[0, 0, :V_T]  # the same probabilities on other ids: equal sorted top-k
    student[0, 1] = torch.randn(W_S, generator=g, dtype=torch.float64)  # later positions do not matter
    close(kd_total(student, one, {0: teacher}, config), 0.0, 1e-12)


# ------------------------------------------------------------------------------------------ L14 lm_head padding


def test_L14_lm_head_padding_columns_change_no_kd_term(dense):
    batch = make_batch(71)
    student, teachers = make_logits(72, batch)
    assert student.shape[-1] == 13 and teachers[0].shape[-1] == 9
    noisy_s, noisy_t = student.clone(), teachers[0].clone()
    noisy_s[..., V_S:] = 50.0
    noisy_t[..., V_T:] = 50.0
    for mode in ("pkl", "gold", "hkl", "uld"):
        config = config_for(mode, dense)
        assert kd_total(student, batch, teachers, config) == kd_total(noisy_s, batch, {0: noisy_t}, config), mode
    same_s, same_t = make_logits(73, batch, same_vocab=True)
    noisy_same = same_t[0].clone()
    noisy_same[..., V_S:] = 50.0
    assert kd_total(same_s, batch, same_t, config_for("topk_kl")) == kd_total(same_s, batch, {0: noisy_same}, config_for("topk_kl"))
    for mode in ("pkl", "gold", "uld"):
        with pytest.raises(ValueError, match=r"student_logits: .*expected a logit width W_s >= 11.*, got 10"):
            L.per_chunk_losses(student[..., :10], batch, teachers, config=config_for(mode, dense))
        with pytest.raises(ValueError, match=r"teacher_logits\[0\]: teacher 0 .* expected a logit width W_t >= 7, got 6"):
            L.per_chunk_losses(student, batch, {0: teachers[0][..., :6]}, config=config_for(mode, dense))

# ------------------------------------------------------------------------------------------------ L15 aggregation


def two_teacher_batch(seed):
    batch = make_batch(seed, teachers=2)
    student, teachers = make_logits(seed + 1, batch, teachers=2)
    return batch, student, teachers


def test_L15_sum_with_static_weights(dense):
    batch, student, teachers = two_teacher_batch(81)
    config = L.XTokenLossConfig(V_S, [spec("pkl", dense, weight=2.0), spec("alm", weight=3.0)])
    norms = L.compute_global_normalizers(batch, config)
    loss, m = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    z, y0 = lists(student, teachers, 0)
    kd0 = ref_pkl(z, y0, batch, dense_matrix(dense, True))[0] / norms.n_chunks[0]
    kd1 = ref_alm(z, teachers[1].tolist(), batch, i=1) / norms.n_chunks[1]
    close(m["kl_loss_t0"].item(), kd0, 1e-10)
    close(m["kl_loss_t1"].item(), kd1, 1e-10)
    close(m["kl_loss"].item(), 2 * kd0 + 3 * kd1, 1e-10)
    assert (m["weight_t0"].item(), m["weight_t1"].item()) == (2.0, 3.0)
    assert L.teacher_weights(config).tolist() == [2.0, 3.0]
    assert (L.teacher_weights(config) * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum().item() == 8.0


def test_L15_normalize_teacher_by_vocab_scales_one_and_two():
    config = L.XTokenLossConfig(V_S, [L.TeacherLossSpec("uld", None, 100), L.TeacherLossSpec("uld", None, 10_000)],
                                normalize_teacher_by_vocab=True)
    torch.testing.assert_close(L.teacher_weights(config), torch.tensor([1.0, 2.0], dtype=torch.float64))


def ref_teacher_ce(y, batch, i, V=V_T):
    "Masked mean of −log p(x_t[q+1]) over the teacher's CE positions, p normalised over its vocabulary (no lm_head padding)."
    total, count = 0.0, 0
    ids, mask, on = batch[f"teacher_{i}_input_ids"].tolist(), batch[f"teacher_{i}_token_mask"].tolist(), batch["sample_mask"].tolist()
    for b in range(len(ids)):
        for q in range(len(ids[b]) - 1):
            if on[b] == 1 and mask[b][q + 1]:
                total -= torch.log_softmax(torch.tensor(y[b][q][:V]), -1)[ids[b][q + 1]].item()
                count += 1
    return total / count


def test_L15_dynamic_weights_are_a_softmax_of_scores_and_alpha_sharpens(dense):
    batch, student, teachers = two_teacher_batch(83)
    teachers[1] = teachers[1] * 0.3  # a flatter teacher: a different CE
    ces = [ref_teacher_ce(teachers[i].tolist(), batch, i) for i in range(2)]
    largest = []
    for alpha in (1.0, 8.0):
        config = L.XTokenLossConfig(V_S, [spec("pkl", dense), spec("uld")], sum_weights_metric="ce", alpha=alpha)
        norms = L.compute_global_normalizers(batch, config)
        _, m = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
        scores = torch.tensor([m["score_t0"].item(), m["score_t1"].item()], dtype=torch.float64)
        torch.testing.assert_close(scores, -torch.tensor(ces, dtype=torch.float64), atol=1e-6, rtol=1e-6)
        weights = torch.tensor([m["weight_t0"].item(), m["weight_t1"].item()], dtype=torch.float64)
        torch.testing.assert_close(weights, torch.softmax(alpha * scores, 0), atol=1e-6, rtol=1e-6)
        close(m["kl_loss"].item(), weights[0].item() * m["kl_loss_t0"].item() + weights[1].item() * m["kl_loss_t1"].item(), 1e-9)
        largest.append(weights.max().item())
    assert largest[1] > largest[0]


def test_L15_select_teacher_takes_the_lowest_ce_and_computes_only_its_kd(tmp_path):
    batch, student, teachers = two_teacher_batch(85)
    better = torch.full_like(teachers[1], -5.0)  # teacher 1 predicts its own next tokens: the lower CE
    ids = batch["teacher_1_input_ids"]
    better.scatter_(-1, torch.cat([ids[:, 1:], ids[:, -1:]], 1)[..., None], 5.0)
    missing = write_projections(tmp_path)[0]  # a real file while the config checks it...
    config = L.XTokenLossConfig(V_S, [L.TeacherLossSpec("pkl", missing, V_T), spec("uld")], kd_loss_mode="select_teacher")
    missing.unlink()  # ...then gone: computing teacher 0's KD would fail
    norms = L.compute_global_normalizers(batch, config)
    loss, m = L.xtoken_kd_loss(student, batch, {0: teachers[0], 1: better}, config=config, normalizers=norms)
    assert m["selected_teacher"].item() == 1 and (m["selected_frac_t0"].item(), m["selected_frac_t1"].item()) == (0.0, 1.0)
    assert m["kl_loss_t0"].item() == 0.0 and m["num_valid_chunks_t0"].item() == 0
    close(m["kl_loss"].item(), m["kl_loss_t1"].item(), 1e-12)
    close(m["kl_loss"].item(), ref_uld(student.tolist(), better.tolist(), batch) / norms.n_chunks[1], 1e-10)  # same tokenization
    tie = L.XTokenLossConfig(V_S, [spec("uld"), spec("uld")], kd_loss_mode="select_teacher")
    _, m = L.xtoken_kd_loss(student, batch, {0: teachers[0], 1: teachers[0]}, config=tie,
                            normalizers=L.compute_global_normalizers(batch, tie))
    assert m["selected_teacher"].item() == 0  # ties go to the lowest index

# ----------------------------------------------------------------------------------------------------- L16 scores


@pytest.mark.parametrize("metric", ["ce", "entropy", "max_prob"])
def test_L16_scores_ignore_padding_and_dropped_samples(dense, metric):
    batch, student, teachers = two_teacher_batch(91)
    config = L.XTokenLossConfig(V_S, [spec("uld"), spec("topk_kl")], sum_weights_metric=metric)
    same = make_logits(92, batch, same_vocab=True)[1][0]
    norms = L.compute_global_normalizers(batch, config)
    scores = lambda t0, t1: [L.xtoken_kd_loss(student, batch, {0: t0, 1: t1}, config=config, normalizers=norms)[1][f"score_t{i}"].item()
                             for i in range(2)]
    before = scores(teachers[0], same)
    t_mask = torch.zeros_like(batch["teacher_0_token_mask"])
    t_mask[:, :-1] = batch["teacher_0_token_mask"][:, 1:] & (batch["sample_mask"][:, None] == 1)
    s_mask = torch.zeros_like(batch["token_mask"])
    s_mask[:, :-1] = batch["token_mask"][:, 1:] & (batch["sample_mask"][:, None] == 1)
    padded_t, padded_s = teachers[0].clone(), same.clone()
    padded_t[~t_mask] = 1e4  # padding, positions without a next token, the dropped sample
    padded_s[~s_mask] = 1e4
    after = scores(padded_t, padded_s)
    torch.testing.assert_close(torch.tensor(after), torch.tensor(before), atol=1e-5, rtol=1e-5)


def test_L16_dp_masked_mean_single_process():
    mean = L.dp_masked_mean(torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([1, 1]))
    assert mean.item() == 1.5 and not mean.requires_grad

# --------------------------------------------------------------------------------------------- L17 errors, L18


def test_L17_construction_errors(dense):
    reference = dict(student_vocab_size=V_S, projection_matrix_paths=[str(dense), str(dense)], teacher_vocab_sizes=[V_T, V_T])
    with pytest.raises(ValueError, match="teacher 0: xtoken_loss=True"):
        L.XTokenLossConfig.from_reference_dict({**reference, "xtoken_loss": True})
    with pytest.raises(ValueError, match="sum_weights_metric='ce' needs kd_loss_mode='sum'"):
        L.XTokenLossConfig(V_S, [spec("uld")], kd_loss_mode="select_teacher", sum_weights_metric="ce")
    with pytest.raises(ValueError, match="normalize_teacher_by_vocab needs kd_loss_mode='sum'"):
        L.XTokenLossConfig(V_S, [spec("topk_kl")], kd_loss_mode="averaged_logits", normalize_teacher_by_vocab=True)
    for weights in ([0.0, 0.0], [1.0, -1.0]):
        with pytest.raises(ValueError, match="non-zero sum of teacher weights"):
            L.XTokenLossConfig(V_S, [spec("topk_kl", weight=w) for w in weights], kd_loss_mode="averaged_logits")
    with pytest.raises(ValueError, match="teacher 1: kd_loss_mode='averaged_logits'"):
        L.XTokenLossConfig(V_S, [spec("topk_kl"), spec("pkl", dense)], kd_loss_mode="averaged_logits")
    with pytest.raises(ValueError, match="equal lengths"):
        L.XTokenLossConfig.from_reference_dict({**reference, "teacher_weights": [1.0]})
    with pytest.raises(ValueError, match="mode must be one of"): L.TeacherLossSpec("kd", None, V_T)
    with pytest.raises(ValueError, match="teacher 0: mode must be one of"): L.XTokenLossConfig(V_S, [dict(mode="x", vocab_size=3)])
    with pytest.raises(ValueError, match="kd_loss_mode must be one of"): L.XTokenLossConfig(V_S, [spec("uld")], kd_loss_mode="mean")
    with pytest.raises(ValueError, match="sum_weights_metric must be one of"):
        L.XTokenLossConfig(V_S, [spec("uld")], sum_weights_metric="kl")
    for field, value, message in (("temperature", 0.0, "temperature must be > 0"), ("vocab_topk", 0, "vocab_topk: expected an int >= 1 or None, got 0"),
                                  ("alm_tau", -1.0, "alm_tau must be > 0")):
        with pytest.raises(ValueError, match=message): L.XTokenLossConfig(V_S, [spec("uld")], **{field: value})
    with pytest.raises(ValueError, match="needs a projection_path"): L.TeacherLossSpec("hkl", None, V_T)
    with pytest.raises(ValueError, match="same-vocab"): L.XTokenLossConfig(V_S, [L.TeacherLossSpec("topk_kl", None, V_S + 1)])
    batch = make_batch(1)
    student, teachers = make_logits(1, batch)
    config = config_for("alm")
    norms = L.compute_global_normalizers(batch, config)
    with pytest.raises(KeyError, match="teacher_0_input_ids"):
        L.xtoken_kd_loss(student, {k: v for k, v in batch.items() if k != "teacher_0_input_ids"}, teachers, config=config,
                         normalizers=norms)


def test_L17_from_reference_dict_mode_table(dense):
    paths = [str(dense), None, str(dense), str(dense)]
    d = dict(student_vocab_size=V_S, projection_matrix_paths=paths, teacher_vocab_sizes=[V_T, V_S, V_T, V_T],
             teacher_weights=[1.0, 2.0, 3.0, 4.0], gold_loss=False, teacher_gold_loss=[None, None, True, True],
             teacher_xtoken_loss=[None, None, False, True], temperature=2.0, vocab_topk=5)
    config = L.XTokenLossConfig.from_reference_dict(d)
    assert [t.mode for t in config.teachers] == ["pkl", "topk_kl", "gold", "hkl"]
    assert [t.weight for t in config.teachers] == [1.0, 2.0, 3.0, 4.0]
    assert (config.temperature, config.vocab_topk) == (2.0, 5)
    with pytest.raises(ValueError, match=r"d: unknown keys \['gold'\]"): L.XTokenLossConfig.from_reference_dict({**d, "gold": True})
    with pytest.warns(DeprecationWarning, match="use from_reference_dict"):
        assert L.XTokenLossConfig.from_anchor_dict(d) == config  # the former name still works


def test_deprecated_anchor_compat_sets_reference_formulas(dense):
    with pytest.warns(DeprecationWarning, match="anchor_compat is deprecated; use reference_formulas"):
        old = config_for("pkl", dense, anchor_compat=True)
    assert old == config_for("pkl", dense, reference_formulas=True)
    with pytest.warns(DeprecationWarning):
        assert old.anchor_compat is True
    with pytest.warns(DeprecationWarning):
        assert dataclasses.replace(old, anchor_compat=False).reference_formulas is False
    with pytest.raises(TypeError, match="reference_formulas: expected a bool"):
        with pytest.warns(DeprecationWarning): config_for("pkl", dense, anchor_compat="yes")


def test_L18_averaged_logits_equals_one_teacher_with_the_averaged_logits():
    batch = make_batch(101)
    student, _ = make_logits(102, batch)
    g = torch.Generator().manual_seed(103)
    y0, y1 = (torch.randn(4, batch["input_ids"].shape[1], W_S, generator=g, dtype=torch.float64) for _ in range(2))
    averaged = L.XTokenLossConfig(V_S, [spec("topk_kl", weight=1.0), spec("topk_kl", weight=3.0)], kd_loss_mode="averaged_logits",
                                  vocab_topk=6)
    single = L.XTokenLossConfig(V_S, [spec("topk_kl")], vocab_topk=6)
    a, ma = L.xtoken_kd_loss(student, batch, {0: y0, 1: y1}, config=averaged,
                             normalizers=L.compute_global_normalizers(batch, averaged))
    b, _ = L.xtoken_kd_loss(student, batch, {0: (y0 + 3 * y1) / 4}, config=single,
                            normalizers=L.compute_global_normalizers(batch, single))
    close(a.item(), b.item(), 1e-12)
    assert (ma["weight_t0"].item(), ma["weight_t1"].item()) == (0.25, 0.75)
    with pytest.raises(ValueError, match="one shape"):
        L.xtoken_kd_loss(student, batch, {0: y0, 1: y1[..., :12]}, config=averaged,
                         normalizers=L.compute_global_normalizers(batch, averaged))

# ------------------------------------------------------------------------------------------------ L21, L22


def test_L21_normalizers_are_required(dense):
    batch = make_batch(1)
    student, teachers = make_logits(1, batch)
    config = config_for("pkl", dense)
    with pytest.raises(TypeError, match="normalizers"): L.xtoken_kd_loss(student, batch, teachers, config=config)
    with pytest.raises(TypeError, match="normalizers"): L.XTokenDistillationLoss(config)(student, batch, teachers)
    with pytest.raises(TypeError, match="GlobalNormalizers"):
        L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=3.0)


def test_L22_metric_reduction(dense):
    reduced = L.reduce_metrics([{"proj_accuracy_t0": 0.5, "num_valid_chunks_t0": 10, "loss": 1.0, "accuracy": 0.2,
                                 "num_valid_tokens": 30, "weight_t0": 0.4, "selected_teacher": 1.0},
                                {"proj_accuracy_t0": 0.7, "num_valid_chunks_t0": 10, "loss": 2.0, "accuracy": 0.6,
                                 "num_valid_tokens": 10, "weight_t0": 0.6, "selected_teacher": 0.0}])
    assert abs(reduced["proj_accuracy_t0"] - 0.6) < 1e-12  # averaged, not summed (1.2)
    assert reduced["num_valid_chunks_t0"] == 20.0 and reduced["loss"] == 3.0
    assert abs(reduced["accuracy"] - 0.3) < 1e-12 and abs(reduced["weight_t0"] - 0.5) < 1e-12
    assert reduced["selected_teacher"] == 0.0
    with pytest.raises(ValueError, match="unknown metric 'top5_t0'"): L.reduce_metrics([{"top5_t0": 1.0}])
    with pytest.raises(ValueError, match="num_valid_chunks_t1"): L.reduce_metrics([{"top1_common_t1": 1.0}])
    batch = make_batch(111)
    student, teachers = make_logits(112, batch)
    config = config_for("gold", dense)
    halves = [rows_of(batch, slice(0, 2)), rows_of(batch, slice(2, 4))]
    norms = L.compute_global_normalizers(halves, config)
    dicts = [L.xtoken_kd_loss(student[r], mb, {0: teachers[0][r]}, config=config, normalizers=norms)[1]
             for r, mb in zip((slice(0, 2), slice(2, 4)), halves)]
    whole = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)[1]
    reduced = L.reduce_metrics(dicts)
    for name in ("loss", "kl_loss_t0", "kl_common_t0", "top1_common_t0", "uncommon_mass_t0", "accuracy", "num_valid_tokens"):
        close(reduced[name], whole[name].item(), 1e-10)


# ------------------------------------------------------------------------------------------ lm_head padding columns

@pytest.mark.parametrize("mode", L.LOSS_MODES)
@pytest.mark.parametrize("block_size", (None, 2))
def test_every_mode_ignores_lm_head_padding_columns(dense, mode, block_size):
    "Columns past each side's vocab_size (lm_head padding) change no KD value and get no gradient, in every mode."
    from losses_helpers import data_for, spec
    config = L.XTokenLossConfig(V_S, [spec(mode, dense)], ce_loss_scale=0.0, vocab_topk=4, block_size=block_size)
    batch, student, teachers = data_for(config, 91)
    V_t = V_S if mode == "topk_kl" else V_T
    padded_s, padded_t = student.clone(), {0: teachers[0].clone()}
    padded_s[..., V_S:] = 25.0   # padding columns far above every real logit: any softmax over them would be ruled by them
    padded_t[0][..., V_t:] = 25.0
    norms = L.compute_global_normalizers(batch, config)
    results = []
    for s, t in ((padded_s, padded_t), (student[..., :V_S], {0: teachers[0][..., :V_t]})):
        logits = s.detach().clone().requires_grad_()
        loss, metrics = L.xtoken_kd_loss(logits, batch, t, config=config, normalizers=norms)
        results.append((loss.item(), torch.autograd.grad(loss, logits)[0]))
    (loss_padded, grad_padded), (loss_narrow, grad_narrow) = results
    assert loss_narrow > 0 and abs(loss_padded - loss_narrow) <= 1e-12 * loss_narrow, (mode, loss_padded, loss_narrow)
    torch.testing.assert_close(grad_padded[..., :V_S], grad_narrow, rtol=1e-10, atol=1e-13)
    assert not grad_padded[..., V_S:].any()


def test_ids_past_the_vocabulary_are_refused_at_the_first_call(dense):
    "A teacher vocab_size smaller than the ids the batch holds (e.g. 1,000 for a 151,646-token teacher) is refused, not read."
    from losses_helpers import data_for, spec
    config = L.XTokenLossConfig(V_S, [spec("uld", dense)])
    batch, student, teachers = data_for(config, 92)
    top = int(batch["teacher_0_input_ids"][batch["teacher_0_token_mask"].bool()].max())
    small = L.XTokenLossConfig(V_S, [L.TeacherLossSpec("uld", None, top)])   # one id too few
    with pytest.raises(ValueError, match=f"teacher_0_input_ids holds id {top} at a real token; expected ids < {top} "
                                         r"\(teacher 0's vocab_size\)"):
        L.xtoken_kd_loss(student, batch, teachers, config=small, normalizers=L.compute_global_normalizers(batch, small))
    batch["input_ids"] = batch["input_ids"].clone()
    real = batch["token_mask"].bool() & batch["sample_mask"].bool()[:, None]
    b, p = (int(x) for x in real.nonzero()[0])
    batch["input_ids"][b, p] = V_S   # a padding column's id: the student logits could score it, the vocabulary has no such token
    with pytest.raises(ValueError, match=f"input_ids holds id {V_S} at a real token; expected ids < {V_S} \\(student_vocab_size\\)"):
        L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=L.compute_global_normalizers(batch, config))
