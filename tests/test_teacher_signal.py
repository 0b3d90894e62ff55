"""TeacherSignal and SparseTeacher: conversions, the dense meaning of a sparse teacher, travel and persistence."""
import math

import numpy as np
import pytest
import torch

from xtoken_dp.ipc import TopKTeacherLogits
from xtoken_dp.teacher_signal import SparseTeacher, TeacherSignal, as_sparse_teacher, support_and_tail
from xtoken_dp.tokenizers import load_tokenizer, token_byte_spans

TEXTS = ["Hello world! naïve café 東京 🙂", "def f(x):\n    return x ** 2", ""]


@pytest.fixture(scope="module")
def teacher_tok():
    return load_tokenizer("mistral_spm")


def _signal(tok, k, dtype=torch.float64, seed=0):
    spans = [token_byte_spans(tok, t) for t in TEXTS]
    g = torch.Generator().manual_seed(seed)
    T = max(len(s) for s in spans)
    logits = torch.randn(len(TEXTS), T, len(tok) + 3, generator=g, dtype=torch.float64) * 3  # 3 lm_head padding columns
    return TeacherSignal.from_logits(logits, spans, k=k, vocab_size=len(tok), texts=TEXTS, dtype=dtype), logits, spans


def test_k_equal_to_the_vocabulary_densifies_back_to_the_teacher(teacher_tok):
    V = len(teacher_tok)
    signal, logits, spans = _signal(teacher_tok, V)
    dense = signal.sparse().densify()
    for i, sp in enumerate(spans):
        torch.testing.assert_close(dense[i, :len(sp)], torch.log_softmax(logits[i, :len(sp), :V], -1), rtol=0, atol=1e-12)
    assert bool((signal.rest_logmass.values() == -math.inf).all())


def test_small_k_keeps_the_support_exact_and_the_rest_mass(teacher_tok):
    signal, logits, spans = _signal(teacher_tok, 16)
    V = len(teacher_tok)
    lp = torch.log_softmax(logits[0, :len(spans[0]), :V], -1)
    ids = signal.topk_ids[0].long()
    torch.testing.assert_close(signal.topk_logprobs[0], lp.gather(-1, ids), rtol=0, atol=1e-12)
    off = lp.scatter(-1, ids, -math.inf).logsumexp(-1)
    torch.testing.assert_close(signal.rest_logmass[0], off, rtol=0, atol=1e-12)
    targets = torch.from_numpy(spans[0].ids[1:])
    torch.testing.assert_close(signal.target_logprob[0][:-1], lp[:-1].gather(-1, targets[:, None]).squeeze(-1))
    dense = signal.sparse().densify()[0, :len(spans[0])]
    torch.testing.assert_close(dense.exp().sum(-1), torch.ones(len(spans[0]), dtype=torch.float64))
    torch.testing.assert_close(dense.gather(-1, ids), lp.gather(-1, ids))  # the support is exact


def test_a_topk_record_converts_like_its_densify():
    torch.manual_seed(1)
    y = torch.randn(2, 6, 40) * 2
    shifted = y - y.amax(-1, keepdim=True)
    top = shifted.topk(7, -1)
    record = TopKTeacherLogits(top.values.bfloat16(), top.indices.int(), shifted.logsumexp(-1), torch.zeros(2, 6), 40)
    sparse = as_sparse_teacher(record)
    torch.testing.assert_close(sparse.densify(), record.densify(), rtol=0, atol=1e-5)
    from xtoken_dp.tokenizers import new_spans
    spans = [new_spans(np.arange(n), np.arange(n), np.arange(n) + 1, np.ones(n, bool), np.zeros(n, np.int8),
                       np.full(n, -1, np.int32), n) for n in (6, 2)]
    signal = record.to_signal(spans)
    torch.testing.assert_close(signal.sparse(6).densify()[0], record.densify()[0], rtol=0, atol=1e-5)


def test_travel_and_persistence_are_bitwise(teacher_tok, tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        signal = _signal(teacher_tok, 8, dtype)[0]
        assert TeacherSignal.decode(*signal.encode()).same_as(signal)
        loaded = TeacherSignal.load(signal.save(tmp_path / str(dtype)))
        assert loaded.same_as(signal) and loaded.texts() == TEXTS
        assert [a == b for a, b in zip(loaded.token_spans(), signal.token_spans())] == [True] * len(TEXTS)


def test_indexing_and_concatenation_keep_the_rows(teacher_tok):
    signal = _signal(teacher_tok, 4)[0]
    picked = signal[torch.tensor([2, 0])]
    assert picked.texts() == [TEXTS[2], TEXTS[0]] and picked.lengths.tolist() == signal.lengths[[2, 0]].tolist()
    assert picked.token_spans() == [signal.token_spans()[2], signal.token_spans()[0]]
    both = torch.cat([signal, signal])
    assert both.texts() == TEXTS * 2 and both.offsets is both.topk_logprobs.offsets()


def test_bad_inputs_are_refused(teacher_tok):
    spans = [token_byte_spans(teacher_tok, TEXTS[0])]
    logits = torch.zeros(1, len(spans[0]), 10)
    with pytest.raises(ValueError, match="k must be <= the teacher's vocabulary size 10, got k=11"):
        TeacherSignal.from_logits(logits, spans, k=11)
    with pytest.raises(ValueError, match="text 0 holds teacher token id"):
        TeacherSignal.from_logits(logits, spans, k=2)
    logits = torch.zeros(1, len(spans[0]), len(teacher_tok))
    with pytest.raises(ValueError, match=r"logits of text 0 must be \[T >= "):
        TeacherSignal.from_logits(logits[:, :2], spans, k=2)
    signal = TeacherSignal.from_logits(logits, spans, k=2)
    with pytest.raises(ValueError, match="width=1 is narrower"):
        signal.sparse(1)
    with pytest.raises(ValueError, match="exceed vocab_size=3"):
        SparseTeacher(torch.zeros(1, 1, 4, dtype=torch.long), torch.zeros(1, 1, 4), torch.zeros(1, 1), None, 3)


def test_support_and_tail_floors_an_empty_rest():
    support, tail = support_and_tail(torch.tensor([[0.0]]), torch.tensor([-math.inf]), 3)
    assert tail.exp().item() == pytest.approx(1e-30, rel=1e-6)
    assert support.exp().item() == pytest.approx(1.0)
