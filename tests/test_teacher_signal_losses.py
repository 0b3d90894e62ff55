"""The losses on sparse teachers: with `k = V_t` every mode and aggregation gives the dense loss (values, gradients and
metrics in fp64 to 1e-10) on the plain, blockwise, overwrite and fused paths; for any `k` it gives the dense loss of
the densified teacher; a `TeacherSignal`, a `SparseTeacher` and a top-k record are all taken as they are; nothing
densifies a sparse teacher."""
import dataclasses
import math

import pytest
import torch

from xtoken_dp import losses as L
from xtoken_dp.teacher_signal import SparseTeacher
from losses_helpers import V_S, V_T, assert_same, data_for, every_config, run_on_path as run, spec, write_projections


@pytest.fixture(scope="module")
def dense(tmp_path_factory): return write_projections(tmp_path_factory.mktemp("sparse_projections"))[0]


def sparse_configs(dense):
    "Every config of the loss tests (their `vocab_topk` choose columns), the same with every column, and the switches of the sparse forms."
    out = dict(every_config(dense))
    out.update({f"{name}_every_column": dataclasses.replace(c, vocab_topk=None) for name, c in every_config(dense).items()
                if c.vocab_topk is not None})
    out.update({
        "pkl_all_chunks_reverse_kappa": L.XTokenLossConfig(V_S, [spec("pkl", dense)], chunk_pairs="all", reverse_kl=True, temperature=1.7),
        "pkl_renormalize_first": L.XTokenLossConfig(V_S, [spec("pkl", dense)], pkl_unseen="renormalize", chunk_reduce="first"),
        "pkl_all_geometric": L.XTokenLossConfig(V_S, [spec("pkl", dense)], chunk_pairs="all", chunk_target="geometric"),
        "gold_all_residual_reverse": L.XTokenLossConfig(V_S, [spec("gold", dense)], chunk_pairs="all", common_renormalize=False,
                                                        reverse_kl=True, temperature=0.8),
        "hkl_all_geometric_mean": L.XTokenLossConfig(V_S, [spec("hkl", dense)], chunk_pairs="all", chunk_target="geometric"),
        "gold_reference_forward": L.XTokenLossConfig(V_S, [spec("gold", dense)], reference_formulas=True),
        "select_teacher_alm_pkl": L.XTokenLossConfig(V_S, [spec("alm", dense), spec("pkl", dense)], kd_loss_mode="select_teacher"),
        "uld_all_topk": L.XTokenLossConfig(V_S, [spec("uld", dense)], uld_topk=None, uld_teacher_temperature=1.3)})
    return out


def _names(): return tuple(sparse_configs(write_projections(__import__("tempfile").mkdtemp())[0]))


NAMES = _names()


def sparse_teacher(y, batch, i, vocab, k, same_vocab):
    "The top-`k` sparse teacher of dense logits `y` (`[B, T, W]`, first `vocab` columns), exact rest and target log-probs."
    lp = torch.log_softmax(y[..., :vocab].double(), -1)
    top = lp.topk(k, -1)
    rest = lp.scatter(-1, top.indices, -math.inf).logsumexp(-1) if k < vocab else torch.full(lp.shape[:2], -math.inf, dtype=lp.dtype)
    ids = batch["input_ids"] if same_vocab else batch[f"teacher_{i}_input_ids"]
    target = torch.full(lp.shape[:2], math.nan, dtype=lp.dtype)
    target[:, :-1] = lp[:, :-1].gather(-1, ids[:, 1:, None].clamp_min(0)).squeeze(-1)
    return SparseTeacher(top.indices, top.values, rest, target, vocab)


def sparse_teachers(config, batch, teachers, k=None):
    out = {}
    for i, t in teachers.items():
        same = config.teachers[i].mode == "topk_kl"
        V = V_S if same else V_T
        out[i] = sparse_teacher(t, batch, i, V, min(k or V, V), same)
    return out


def normalised(config, teachers):
    """The dense teachers with their vocabulary's columns as log-probs (the padding columns as they were): the same
    distributions, and what a sparse teacher keeps. Only `vocab_topk`'s vote reads logits as they come, and a sparse
    teacher, which keeps no logits, votes on its log-probs."""
    out = {}
    for i, y in teachers.items():
        V = V_S if config.teachers[i].mode == "topk_kl" else V_T
        out[i] = torch.cat([torch.log_softmax(y[..., :V], -1), y[..., V:]], -1)
    return out


@pytest.mark.parametrize("path", ("plain", "blockwise", "overwrite", "fused"))
@pytest.mark.parametrize("name", NAMES)
def test_sparse_equals_dense_when_k_is_the_vocabulary(dense, name, path):
    config = sparse_configs(dense)[name]
    batch, student, teachers = data_for(config, 53)
    teachers = normalised(config, teachers) if config.vocab_topk is not None else teachers
    want = run(config, student, batch, teachers, path)
    assert want[0].item() != 0 and want[1][0].abs().sum() > 0
    assert_same(run(config, student, batch, sparse_teachers(config, batch, teachers), path), want, 1e-10, (name, path))


@pytest.mark.parametrize("k", (1, 3))
@pytest.mark.parametrize("name", [n for n in NAMES if "dynamic" not in n and "ce_weights" not in n and "select" not in n])
def test_sparse_equals_the_dense_loss_of_the_densified_teacher(dense, name, k):
    "Below `V`, each mode computes exactly the dense formula on the distribution the sparse teacher stands for."
    config = sparse_configs(dense)[name]
    batch, student, teachers = data_for(config, 59)
    sparse = sparse_teachers(config, batch, teachers, k)
    for t in sparse.values():  # the densified teacher's own next-token log-probs, so that ALM reads the same on both sides
        ids = batch["input_ids"] if t.vocab_size == V_S and config.teachers[0].mode == "topk_kl" else next(
            batch[f"teacher_{i}_input_ids"] for i in sparse if sparse[i] is t)
        t.target_logprob[:, :-1] = t.densify()[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    densified = {i: t.densify() for i, t in sparse.items()}
    for path in ("plain", "blockwise"):
        assert_same(run(config, student, batch, sparse, path), run(config, student, batch, densified, path), 1e-10, (name, k, path))


def test_a_signal_a_record_and_a_sparse_teacher_give_one_loss(dense, tmp_path):
    from xtoken_dp.ipc import TopKTeacherLogits
    from xtoken_dp.teacher_signal import TeacherSignal
    from xtoken_dp.tokenizers import new_spans
    import numpy as np
    config = L.XTokenLossConfig(V_S, [spec("gold", dense)])
    batch, student, teachers = data_for(config, 61)
    sparse = sparse_teachers(config, batch, teachers, 4)[0]
    lengths = batch["teacher_0_input_lengths"].tolist()
    spans = [new_spans(batch["teacher_0_input_ids"][b, :n].numpy(), np.arange(n), np.arange(n) + 1, np.ones(n, bool),
                       np.zeros(n, np.int8), np.full(n, -1, np.int32), n) for b, n in enumerate(lengths)]
    rows = lambda x, b: x[b, :lengths[b]]
    signal = TeacherSignal.from_rows(spans, [rows(sparse.ids, b).int() for b in range(len(lengths))],
                                     [rows(sparse.logprobs, b) for b in range(len(lengths))],
                                     [rows(sparse.rest, b) for b in range(len(lengths))],
                                     [rows(sparse.target_logprob, b) for b in range(len(lengths))], vocab_size=V_T)
    record = TopKTeacherLogits(sparse.logprobs, sparse.ids.int(), torch.zeros(sparse.rest.shape), sparse.target_logprob, V_T)
    want = run(config, student, batch, {0: sparse}, "plain")
    assert_same(run(config, student, batch, {0: signal}, "plain"), want, 1e-10, "signal")
    got = run(config, student, batch, {0: record}, "blockwise")  # its rest is log(1 - Σ p): equal up to rounding
    assert_same(got, want, 1e-6, "record")


def test_nothing_densifies_a_sparse_teacher(dense, monkeypatch):
    calls = []
    original = SparseTeacher.densify
    monkeypatch.setattr(SparseTeacher, "densify", lambda self: calls.append(1) or original(self))
    for name, config in sparse_configs(dense).items():
        batch, student, teachers = data_for(config, 67)
        for path in ("plain", "blockwise"):
            run(config, student, batch, sparse_teachers(config, batch, teachers, 3), path)
    assert calls == []


def test_a_sparse_teacher_of_another_vocabulary_is_refused(dense):
    config = L.XTokenLossConfig(V_S, [spec("pkl", dense)])
    batch, student, teachers = data_for(config, 71)
    wrong = sparse_teachers(config, batch, teachers, 3)[0]
    wrong = SparseTeacher(wrong.ids, wrong.logprobs, wrong.rest, wrong.target_logprob, V_T + 1)
    with pytest.raises(ValueError, match="teacher 0: the sparse teacher's vocabulary has 8 ids, TeacherLossSpec.vocab_size is 7"):
        run(config, student, batch, {0: wrong}, "plain")
