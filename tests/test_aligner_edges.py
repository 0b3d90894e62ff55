"""Edges of the aligner's public surface: an empty batch, texts without chunks, text that is not valid Unicode, an
aligner handed other tokenizers than its own, and the public names `xtoken_dp.aligner` keeps after the alignment
code was split into `chunking`, `alignments`, `truncation` and `id_path`."""
import contextlib, copy, io, math, re, sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import no_network, tok

import xtoken_dp.aligner as aligner_module
from xtoken_dp.aligner import AlignmentStats, TokenAligner, tokenizer_label
from xtoken_dp.cli import main as cli_main
from xtoken_dp.tokenizers import InvalidTextError, batch_token_byte_spans, load_tokenizer

PAIRS = [("qwen2", "mistral_tekken"), ("mistral_spm", "qwen2"), ("mistral_tekken", "mistral_spm"), ("qwen2", "qwen2")]


def finite_floats(d: dict) -> bool:
    return all(isinstance(v, float) and math.isfinite(v) for v in d.values())


@pytest.mark.parametrize("a,b", PAIRS)
def test_empty_batch_is_an_empty_result(a, b):
    res = TokenAligner(tok(a), tok(b)).align_texts([])
    assert len(res) == 0 and res.samples == [] and res.student_ids == [] and res.num_chunks.shape == (0,)
    padded = res.to_padded().validate()
    assert padded.student_chunk_id.shape == (0, 0) and padded.pair_valid.shape == (0, 1)
    assert res.to_jagged().num_chunks.shape == (0,)
    st = res.stats()
    assert (st.samples, st.chunks, st.content_chunks) == (0, 0, 0)
    assert repr(st) == "AlignmentStats(samples=0, no chunks)" and finite_floats(st.to_dict())
    assert (st.byte_coverage, st.exact_share, st.one_to_one_share, st.token_coverage_student) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("a,b", PAIRS)
def test_texts_without_chunks_have_no_nan_stats(a, b):
    al = TokenAligner(tok(a), tok(b))
    for texts in ([""], ["", ""], [" \n"]):
        st = al.align_texts(texts).stats()
        assert finite_floats(st.to_dict()), st.to_dict()
        assert "nan" not in repr(st).lower()
        if st.chunks == 0: assert "no chunks" in repr(st)
        elif st.content_chunks == 0: assert "no content chunks" in repr(st)
        if st.content_chunks == 0: assert st.exact_share == st.one_to_one_share == 0.0
    assert f"{al.align_texts(['']).stats().exact_share:.0%}" == "0%"
    report = al.pair_report({"empty": ""})
    assert "nan" not in report.to_markdown().lower()


def test_stats_with_nothing_to_measure():
    empty = AlignmentStats()
    assert empty.chunks == 0 and finite_floats(empty.to_dict())
    assert sum([empty, empty]) == empty and repr(empty) == "AlignmentStats(samples=0, no chunks)"
    some = TokenAligner(tok("qwen2"), tok("mistral_tekken")).align_texts(["Hello world"]).stats()
    assert repr(some).startswith("AlignmentStats(samples=1, chunks=3: content 2 (exact 100.0%, 1:1 100.0%")
    assert empty + some == some


def test_align_command_on_an_empty_text_prints_no_nan():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["align", "", "--student", "qwen2", "--teacher", "mistral_tekken"]) == 0
    text = out.getvalue()
    assert "nan" not in text.lower() and "exact_share  0" in text and "content_chunks  0" in text


@pytest.mark.parametrize("bad,where,cp,at", [(["ok", "a\ud800b"], "texts[1]", "U+D800", 1),
                                            (["\udcff"], "texts[0]", "U+DCFF", 0),
                                            (["ok", "fine", "x\udfffy\ud800"], "texts[2]", "U+DFFF", 1)])
def test_invalid_unicode_is_named(bad, where, cp, at):
    al = TokenAligner(tok("qwen2"), tok("mistral_spm"))
    with pytest.raises(ValueError, match=re.escape(f"{where}: not valid Unicode: character {at} is the lone surrogate {cp}")) as e:
        al.align_texts(bad)
    assert isinstance(e.value, InvalidTextError)


def test_invalid_unicode_in_texts_read_for_gaps_is_named():
    al = TokenAligner(tok("qwen2"), tok("qwen2"))
    s = batch_token_byte_spans(tok("qwen2"), ["a\tb"])[0]
    gap = type(s)(s.ids[[0, -1]], np.array([0, 2]), np.array([1, 3]), np.ones(2, bool), np.zeros(2, np.int8),
                  np.full(2, -1, np.int32), 3)
    assert al.align_spans(s, gap, text="a\tb").pair_is_correct.all()
    with pytest.raises(InvalidTextError, match=r"texts\[0\]: not valid Unicode: character 1 is the lone surrogate U\+D800"):
        al.align_spans(s, gap, text="a\ud800b")


def test_an_aligner_names_the_tokenizers_it_was_built_for():
    al = TokenAligner(tok("qwen2"), tok("mistral_tekken"))
    al.check_tokenizers(tok("qwen2"), tok("mistral_tekken"))
    with pytest.raises(ValueError) as e: al.check_tokenizers(tok("mistral_spm"), tok("mistral_tekken"), name="aligners[0]")
    msg = str(e.value)
    assert msg.startswith("aligners[0] was built for the student tokenizer 'qwen2' (TokenizersBackend, byte_level_bpe, 151646 ids)")
    assert "got the student tokenizer 'mistral_spm' (TokenizersBackend, sentencepiece_bpe, 32000 ids)" in msg
    named = copy.copy(tok("mistral_spm")); named.name_or_path = "mistralai/Mistral-7B-v0.1"
    assert tokenizer_label(named) == "'mistralai/Mistral-7B-v0.1' (TokenizersBackend, sentencepiece_bpe, 32000 ids)"
    with pytest.raises(ValueError, match="got the teacher tokenizer 'mistralai/Mistral-7B-v0.1'"):
        al.check_tokenizers(tok("qwen2"), named)
    with pytest.raises(TypeError, match="teacher_tokenizer"): al.check_tokenizers(tok("qwen2"), "mistral_tekken")


def test_same_labels_add_fingerprints():
    spm, spm_eos = load_tokenizer("mistral_spm"), load_tokenizer("mistral_spm", add_eos=True)
    with pytest.raises(ValueError, match=r"32000 ids\), fingerprint [0-9a-f]{12}, got the teacher tokenizer .*fingerprint"):
        TokenAligner(tok("qwen2"), spm).check_tokenizers(tok("qwen2"), spm_eos)


OLD_PUBLIC = ['DEFAULT_ROLE_EQUIVALENCE', 'PROBE_TEXTS', 'shift_chunk_ids', 'role_classes', 'ChunkKind', 'SampleAlignment',
              'AlignmentStats', 'AlignmentResult', 'TokenAligner', 'SpanTruncation', 'truncate_spans', 'BatchTruncation',
              'truncate_batch', 'template_specials', 'chunk_rows', 'diff_blocks', 'PairReport', 'AlignmentBatch']


def test_aligner_keeps_every_public_name():
    missing = [n for n in OLD_PUBLIC if n not in aligner_module.__all__ or not hasattr(aligner_module, n)]
    assert not missing, missing
    from xtoken_dp import alignments, chunking, id_path, truncation
    assert aligner_module.shift_chunk_ids is alignments.shift_chunk_ids
    assert aligner_module.truncate_batch is truncation.truncate_batch and aligner_module.diff_blocks is id_path.diff_blocks
    assert aligner_module.role_classes is chunking.role_classes and aligner_module.ChunkKind is chunking.ChunkKind


def test_the_modules_build_on_each_other_in_order():
    from xtoken_dp import alignments, chunking, id_path, truncation
    text = "Hello world! 東京 🙂"
    S, T = (batch_token_byte_spans(tok(n), [text]) for n in ("mistral_spm", "qwen2"))
    flat = chunking.align_flat(S, T)
    res = alignments.AlignmentResult.from_spans(S, T, texts=[text])
    assert np.array_equal(res.flat.s_chunk, flat.s_chunk) and res.flat is not flat
    via_aligner = TokenAligner(tok("mistral_spm"), tok("qwen2")).align_texts([text])
    for f in ("s_chunk", "t_chunk", "c_start", "c_end", "c_kind", "c_correct"):
        assert np.array_equal(getattr(via_aligner.flat, f), getattr(flat, f))
    ids = torch.tensor([tok("mistral_spm")(text)["input_ids"]]), torch.tensor([tok("qwen2")(text)["input_ids"]])
    by_ids = id_path.align_ids(*ids, tok("mistral_spm"), tok("qwen2"))
    assert torch.equal(by_ids.student_chunk_id, via_aligner.to_padded().student_chunk_id)
    cut = truncation.truncate_batch([S, T], [4, None])
    assert cut.kept_nbytes[0] < len(text.encode())
