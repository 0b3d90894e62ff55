"""`XTokenLossConfig.beta`, the generalised Jensen-Shannon divergence between the forward and the reverse KL.

`beta=0` and `beta=1` are the forward and the reverse KL (values, gradients and metrics to 1e-10 in fp64, every
supported mode and aggregation, dense and sparse teachers, on the plain, blockwise, overwrite and fused paths); a
`beta` in between equals a plain-Python JSD of the same distributions (the per-chunk loops of `losses_helpers` with
their KL replaced by the JSD written below), is the same on every path and for a sparse teacher as for its densified
logits, is symmetric under swapping the two sides (with `beta -> 1 - beta`), `>= 0`, 0 when the student equals the
teacher, and passes `gradcheck`; `alm`, `uld` and `reference_formulas` refuse it.
"""
import dataclasses
import math

import pytest
import torch

import losses_helpers as H
from losses_helpers import (V_S, V_T, assert_same, data_for, dense_matrix, exact_map_loop, make_batch, make_logits, ref_gold,
                            ref_pkl, ref_topk_kl, run_on_path as run, spec, write_projections)
from xtoken_dp import losses as L
from xtoken_dp.losses import jsd as J
from xtoken_dp.schema import AlignmentBatch
from xtoken_dp.teacher_signal import SparseTeacher


@pytest.fixture(scope="module")
def projections(tmp_path_factory): return write_projections(tmp_path_factory.mktemp("jsd_projections"))


def supported_configs(dense, sparse=None):
    "Every mode and aggregation that has a JSD, with the switches that change which distributions it compares."
    one = lambda mode, path=dense, **kw: L.XTokenLossConfig(V_S, [spec(mode, path)], **kw)
    two = lambda a, b, **kw: L.XTokenLossConfig(V_S, [spec(a, dense, weight=0.7), spec(b, dense, weight=1.3)], **kw)
    out = {"pkl_topk": one("pkl", vocab_topk=4), "pkl_every_column": one("pkl"),
           "pkl_renormalize_first_kappa": one("pkl", pkl_unseen="renormalize", chunk_reduce="first", temperature=1.7, vocab_topk=5),
           "pkl_geometric_all_chunks": one("pkl", chunk_target="geometric", chunk_pairs="all"),
           "gold": one("gold"), "gold_residual_kappa": one("gold", common_renormalize=False, temperature=0.8),
           "hkl_all_chunks_geometric": one("hkl", chunk_pairs="all", chunk_target="geometric"),
           "topk_kl_topk": one("topk_kl", vocab_topk=4), "topk_kl_every_column_kappa": one("topk_kl", temperature=2.0),
           "averaged_logits": L.XTokenLossConfig(V_S, [spec("topk_kl", None, weight=0.7), spec("topk_kl", None, weight=1.3)],
                                                 kd_loss_mode="averaged_logits"),
           "sum_pkl_gold": two("pkl", "gold", vocab_topk=4), "select_teacher_hkl_pkl": two("hkl", "pkl", kd_loss_mode="select_teacher")}
    if sparse is not None: out["pkl_sparse_file"] = one("pkl", sparse)
    return out


NAMES = tuple(supported_configs(*write_projections(__import__("tempfile").mkdtemp())))
PATHS = ("plain", "blockwise", "overwrite", "fused")


def configs(projections): return supported_configs(*projections)


def with_beta(config, beta, **kw): return dataclasses.replace(config, beta=beta, **kw)

# ------------------------------------------------------------------------------------------------------- running


def sparse_teacher(y, ids, vocab, k):
    "The top-`k` sparse teacher of dense logits `y` (first `vocab` columns), its exact rest and target log-probs."
    lp = torch.log_softmax(y[..., :vocab].double(), -1)
    top = lp.topk(k, -1)
    rest = lp.scatter(-1, top.indices, -math.inf).logsumexp(-1) if k < vocab else torch.full(lp.shape[:2], -math.inf, dtype=lp.dtype)
    target = torch.full(lp.shape[:2], math.nan, dtype=lp.dtype)
    target[:, :-1] = lp[:, :-1].gather(-1, ids[:, 1:, None].clamp_min(0)).squeeze(-1)
    return SparseTeacher(top.indices, top.values, rest, target, vocab)


def sparse_teachers(config, batch, teachers, k=None):
    out = {}
    for i, y in teachers.items():
        same = config.teachers[i].mode == "topk_kl"
        V = V_S if same else V_T
        out[i] = sparse_teacher(y, batch["input_ids"] if same else batch[f"teacher_{i}_input_ids"], V, min(k or V, V))
    return out

# ------------------------------------------------------------------------------------------ the ends are the KLs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", NAMES)
def test_beta_0_and_1_are_the_forward_and_the_reverse_kl(projections, name, path):
    config = configs(projections)[name]
    batch, student, teachers = data_for(config, 65)
    for teacher_inputs in (teachers, sparse_teachers(config, batch, teachers, 3)):
        for beta, reverse in ((0.0, False), (1.0, True), (1, True)):
            want = run(dataclasses.replace(config, reverse_kl=reverse), student, batch, teacher_inputs, path)
            assert want[2]["kl_loss"].item() > 0 and want[1][0].abs().sum() > 0
            assert_same(run(with_beta(config, beta), student, batch, teacher_inputs, path), want, 1e-10, (name, path, beta))
    assert_same(run(with_beta(config, 1.0, reverse_kl=True), student, batch, teachers, path),
                run(with_beta(config, None, reverse_kl=True), student, batch, teachers, path), 1e-10, (name, path))


def test_the_jsd_differs_from_both_kls(projections):
    config = configs(projections)["pkl_topk"]
    batch, student, teachers = data_for(config, 74)
    forward, jsd, reverse = [run(with_beta(config, beta), student, batch, teachers, "plain")[2]["kl_loss_t0"].item()
                             for beta in (0.0, 0.5, 1.0)]
    assert 0 < jsd <= 0.25 * (forward + reverse)  # per chunk, KL(P ‖ M) <= (1 − β)·KL(P ‖ Q) and KL(Q ‖ M) <= β·KL(Q ‖ P)

# ------------------------------------------------------------------------ a beta in between: a plain reference


def jsd(p, q, beta):
    "The generalised JSD of teacher `p` and student `q` (lists), mixture `beta·p + (1 − beta)·q`, by a loop."
    total = 0.0
    for a, b in zip(p, q):
        m = beta * a + (1 - beta) * b
        if a > 0: total += beta * a * math.log(a / m)
        if b > 0: total += (1 - beta) * b * math.log(b / m)
    return total


PKL_CASES = [dict(), dict(vocab_topk=3), dict(vocab_topk=3, temperature=2.0), dict(chunk_target="geometric"),
             dict(chunk_reduce="first", vocab_topk=5), dict(pkl_unseen="renormalize"), dict(pkl_unseen="renormalize", vocab_topk=3),
             dict(chunk_pairs="all", exact_token_match_only=True)]
GOLD_CASES = [dict(), dict(common_renormalize=False), dict(chunk_target="geometric", temperature=1.5),
              dict(chunk_reduce="first", uncommon_weight=0.0), dict(chunk_pairs="all", common_renormalize=False)]
BETAS = (0.5, 0.3)


def ids_of(kw): return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


def check_per_chunk(config, student, batch, teachers, total, per, tol=1e-10):
    term = L.per_chunk_losses(student, batch, teachers, config=config)
    assert abs(term.total.item() - total) <= tol * max(1.0, abs(total)), (term.total.item(), total)
    for (b, c), value in per.items(): assert abs(term.per_unit[b, c].item() - value) <= tol * max(1.0, abs(value))
    assert term.valid.sum().item() == len(per)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("kw", PKL_CASES, ids=ids_of)
def test_pkl_jsd_equals_a_per_chunk_loop(projections, monkeypatch, kw, beta):
    monkeypatch.setattr(H, "kl", lambda p, q: jsd(p, q, beta))  # the loops' forward KL(teacher, student), now the JSD
    batch = make_batch(21)
    student, teachers = make_logits(22, batch)
    for path in projections:
        config = L.XTokenLossConfig(V_S, [spec("pkl", path)], beta=beta, **kw)
        total, per = ref_pkl(student.tolist(), teachers[0].tolist(), batch, dense_matrix(path, True), kappa=kw.get("temperature", 1.0),
                             topk=kw.get("vocab_topk"), target=kw.get("chunk_target", "arithmetic"), reduce=kw.get("chunk_reduce", "mean"),
                             exact_only=kw.get("exact_token_match_only", False), pairs=kw.get("chunk_pairs", "one_to_one"),
                             unseen=kw.get("pkl_unseen", "bucket"))
        assert per
        check_per_chunk(config, student, batch, teachers, total, per)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("mode", ("gold", "hkl"))
@pytest.mark.parametrize("kw", GOLD_CASES, ids=ids_of)
def test_gold_and_hkl_jsd_equal_a_per_chunk_loop(projections, monkeypatch, kw, mode, beta):
    monkeypatch.setattr(H, "kl", lambda p, q: jsd(p, q, beta))
    dense = projections[0]
    batch = make_batch(65)
    student, teachers = make_logits(66, batch)
    total, common, tail, per = ref_gold(student.tolist(), teachers[0].tolist(), batch, exact_map_loop(dense, mode == "hkl"),
                                        kappa=kw.get("temperature", 1.0), target=kw.get("chunk_target", "arithmetic"),
                                        reduce=kw.get("chunk_reduce", "mean"), renormalize=kw.get("common_renormalize", True),
                                        uncommon_weight=kw.get("uncommon_weight", 1.0), pairs=kw.get("chunk_pairs", "one_to_one"))
    assert per and common > 0
    config = L.XTokenLossConfig(V_S, [spec(mode, dense)], beta=beta, **kw)
    check_per_chunk(config, student, batch, teachers, total, per)
    norms = L.compute_global_normalizers(batch, config)
    _, metrics = L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)
    assert abs(metrics["kl_common_t0"].item() - common / norms.n_chunks[0]) <= 1e-10


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("kw", [dict(), dict(vocab_topk=4), dict(temperature=2.0, vocab_topk=6)], ids=ids_of)
def test_topk_kl_jsd_equals_a_per_position_loop(monkeypatch, kw, beta):
    monkeypatch.setattr(H, "kl", lambda p, q: jsd(p, q, beta))
    batch = make_batch(67)
    student, teachers = make_logits(68, batch, same_vocab=True)
    config = L.XTokenLossConfig(V_S, [spec("topk_kl", None)], beta=beta, **kw)
    want = ref_topk_kl(student.tolist(), teachers[0].tolist(), batch, kappa=kw.get("temperature", 1.0), topk=kw.get("vocab_topk"))
    got = L.per_chunk_losses(student, batch, teachers, config=config).total.item()
    assert abs(got - want) <= 1e-10 * max(1.0, abs(want)), (got, want)
    got32 = L.per_chunk_losses(student.float(), batch, {0: teachers[0].float()}, config=config).total.item()
    assert abs(got32 - want) <= 1e-5 * max(1.0, abs(want))

# ----------------------------------------------------------------------- a beta in between: paths, sparse teachers


@pytest.mark.parametrize("path", ("blockwise", "overwrite", "fused"))
@pytest.mark.parametrize("name", NAMES)
def test_the_jsd_is_the_same_on_every_path(projections, name, path):
    config = with_beta(configs(projections)[name], 0.4)
    batch, student, teachers = data_for(config, 69)
    for teacher_inputs in (teachers, sparse_teachers(config, batch, teachers, 3)):
        want = run(config, student, batch, teacher_inputs, "plain_of_fused" if path == "fused" else "plain")
        assert want[2]["kl_loss"].item() > 0 and want[1][0].abs().sum() > 0
        assert_same(run(config, student, batch, teacher_inputs, path), want, 1e-10, (name, path))


@pytest.mark.parametrize("name", [n for n in NAMES if "select" not in n])  # a top-k teacher's CE score reads its exact target log-probs
def test_a_sparse_teacher_gives_the_jsd_of_its_densified_logits(projections, name):
    config = with_beta(configs(projections)[name], 0.6)
    batch, student, teachers = data_for(config, 72)
    for k in (1, 3, None):  # None: k = V, the dense teacher itself
        sparse = sparse_teachers(config, batch, teachers, k)
        densified = {i: t.densify() for i, t in sparse.items()}
        for path in ("plain", "blockwise"):
            assert_same(run(config, student, batch, sparse, path), run(config, student, batch, densified, path), 1e-10, (name, k, path))

# ------------------------------------------------------------------------------- properties and gradcheck


@pytest.mark.parametrize("beta", (0.5, 0.2))
def test_swapping_student_and_teacher_mirrors_beta(beta):
    batch = make_batch(73)
    student, teachers = make_logits(74, batch, same_vocab=True)
    config = L.XTokenLossConfig(V_S, [spec("topk_kl", None)], temperature=1.3)
    there = L.per_chunk_losses(student, batch, teachers, config=with_beta(config, beta)).per_unit
    back = L.per_chunk_losses(teachers[0], batch, {0: student}, config=with_beta(config, 1 - beta)).per_unit
    assert (there - back).abs().max().item() <= 1e-12 and there.abs().sum() > 0


def test_the_jsd_is_never_negative(projections):
    dense, sparse = projections
    modes = [("pkl", dense), ("pkl", sparse), ("gold", dense), ("hkl", dense)]
    for seed in range(40):
        batch = make_batch(2000 + seed, B=2, masked=())
        student, teachers = make_logits(3000 + seed, batch, dtype=torch.float32, scale=4.0)
        same = make_logits(4000 + seed, batch, dtype=torch.float32, scale=4.0, same_vocab=True)[1]
        for beta in (0.1, 0.5, 0.9):
            for mode, path in modes:
                config = L.XTokenLossConfig(V_S, [spec(mode, path)], beta=beta, vocab_topk=None if seed % 2 else 4)
                assert L.per_chunk_losses(student, batch, teachers, config=config).per_unit.min().item() >= -1e-6
            config = L.XTokenLossConfig(V_S, [spec("topk_kl", None)], beta=beta)
            assert L.per_chunk_losses(student, batch, same, config=config).per_unit.min().item() >= -1e-6


def identical_pair(tmp_path, V=7, T=4):
    "A batch in which student and teacher read one text with one tokenizer (chunks of one token), and an identity projection."
    path = tmp_path / "identity.pt"
    torch.save({"indices": torch.arange(V)[:, None], "likelihoods": torch.ones(V, 1)}, path)
    ids = torch.arange(T)[None]
    alignment = AlignmentBatch.from_padded(
        pair_valid=torch.ones(1, T, dtype=torch.bool), pair_is_correct=torch.ones(1, T, dtype=torch.bool),
        student_exact_partition_mask=torch.ones(1, T, dtype=torch.bool), teacher_exact_partition_mask=torch.ones(1, T, dtype=torch.bool),
        student_chunk_id=ids, teacher_chunk_id=ids, num_chunks=torch.tensor([T]), validate=True)
    tokens = torch.tensor([[1, 4, 2, 6]])
    batch = {"input_ids": tokens, "token_mask": torch.ones(1, T, dtype=torch.bool), "sample_mask": torch.ones(1),
             "teacher_0_input_ids": tokens, "teacher_0_token_mask": torch.ones(1, T, dtype=torch.bool), **alignment.as_flat("alignment_0_")}
    return path, batch


@pytest.mark.parametrize("mode", ("pkl", "gold", "hkl", "topk_kl"))
def test_the_jsd_is_zero_when_the_student_is_the_teacher(tmp_path, mode):
    path, batch = identical_pair(tmp_path)
    logits = torch.randn(1, 4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(75)) * 3
    config = L.XTokenLossConfig(7, [L.TeacherLossSpec(mode, None if mode == "topk_kl" else path, 7)], beta=0.45)
    term = L.per_chunk_losses(logits, batch, {0: logits.clone()}, config=config)
    assert term.valid.any() and term.per_unit.abs().max().item() <= 1e-14
    other = L.per_chunk_losses(logits, batch, {0: logits.flip(-1)}, config=config)
    assert other.per_unit[other.valid].min().item() > 1e-6


@pytest.mark.parametrize("name", ("pkl_topk", "pkl_every_column", "gold_residual_kappa", "hkl_all_chunks_geometric",
                                  "topk_kl_topk", "topk_kl_every_column_kappa", "pkl_sparse_file"))
@pytest.mark.parametrize("teacher_kind", ("dense", "sparse"))
def test_gradcheck_of_the_jsd_loss(projections, name, teacher_kind):
    config = with_beta(configs(projections)[name], 0.35, block_size=None)
    batch = make_batch(77, B=1, masked=(), chunks=(3, 4))
    student, teachers = make_logits(78, batch, same_vocab=config.teachers[0].mode == "topk_kl")
    if teacher_kind == "sparse": teachers = sparse_teachers(config, batch, teachers, 3)
    norms = L.compute_global_normalizers(batch, config)
    assert L.xtoken_kd_loss(student, batch, teachers, config=config, normalizers=norms)[1]["kl_loss"].item() > 0
    loss = lambda z: L.xtoken_kd_loss(z, batch, teachers, config=config, normalizers=norms)[0]
    assert torch.autograd.gradcheck(loss, (student.clone().requires_grad_(),))


def test_the_primitives_pass_gradcheck():
    g = torch.Generator().manual_seed(79)
    p, q = torch.softmax(torch.randn(3, 6, generator=g, dtype=torch.float64), -1), torch.softmax(torch.randn(3, 6, generator=g, dtype=torch.float64), -1)
    assert torch.autograd.gradcheck(lambda a, b: J.prob_jsd(a, b, 0.3), (p.requires_grad_(), q.requires_grad_()))
    z, y = torch.randn(2, 3, 6, generator=g, dtype=torch.float64), torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: J.SoftmaxJSD.apply(a, b, 0.7, 0.6), (z.requires_grad_(), y.requires_grad_()))

# ---------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("mode", ("alm", "uld"))
def test_modes_without_a_jsd_refuse_a_beta_in_between(projections, mode):
    with pytest.raises(ValueError, match=f"teacher 1: beta=0.5 \\(the generalised JSD\\) is not defined for mode '{mode}'"):
        L.XTokenLossConfig(V_S, [spec("pkl", projections[0]), spec(mode, None)], beta=0.5)
    for beta, reverse in ((0.0, False), (1.0, True)):  # the ends are what reverse_kl always gave these modes
        config = L.XTokenLossConfig(V_S, [spec(mode, None)], beta=beta)
        batch, student, teachers = data_for(config, 81)
        assert_same(run(config, student, batch, teachers, "plain"),
                    run(L.XTokenLossConfig(V_S, [spec(mode, None)], reverse_kl=reverse), student, batch, teachers, "plain"), 0, mode)


def test_bad_betas_are_refused(projections):
    dense = projections[0]
    make = lambda **kw: L.XTokenLossConfig(V_S, [spec("gold", dense)], **kw)
    for beta, message in ((1.5, "beta must lie in \\[0, 1\\]"), (-0.2, "beta must lie in \\[0, 1\\]"), (math.inf, "finite number"),
                          (math.nan, "finite number"), ("0.5", "finite number"), (False, "finite number")):
        with pytest.raises(ValueError, match=message): make(beta=beta)
    with pytest.raises(ValueError, match="beta=0.0 contradicts reverse_kl=True"): make(beta=0.0, reverse_kl=True)
    with pytest.raises(ValueError, match="no form in reference_formulas"): make(beta=0.5, reference_formulas=True)
    assert make(beta=1.0, reference_formulas=True).effective_reverse_kl
    with pytest.raises(ValueError, match="needs 0 < beta < 1"): J.prob_jsd(torch.ones(2) / 2, torch.ones(2) / 2, 1.0)
