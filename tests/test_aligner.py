"""The aligner's must-handle cases with the real tokenizers: CJK, emoji, combining accents, whitespace, digits, byte
fallback, BOS on one side, pad == eos, truncation, empty and whitespace-only texts, special strings in raw text,
hand-made worked examples, the id-only path, layouts, the next-token shift and the pair report.

The property test on random Unicode is in test_aligner_props.py; the collator and the views have their own test files.
Every alignment produced here also passes `AlignmentBatch.validate()` in both layouts and the invariant checks of
`check_sample` (the chunk properties of the property test, on one sample). Test names keep the numbers of the
acceptance list they check.
"""
import random, sys, unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import BERT_MARKS, GOLDEN, SPECIAL_TEXT, no_network, requires_bert, tok
from tokenizer_texts import random_texts

from xtoken_dp.aligner import (AlignmentBatch, AlignmentResult, ChunkKind, TokenAligner, chunk_rows, shift_chunk_ids,
                               template_specials, truncate_batch, truncate_spans)
from xtoken_dp.id_path import align_id_rows
from xtoken_dp.tokenizers import ROLES, TokenSpans, batch_token_byte_spans, describe_tokenizer, load_tokenizer

BYTE_LEVEL = ["qwen2", "mistral_tekken", "bpe_bytelevel", "bpe_bytelevel_digits"]
BYTE_COMPLETE = BYTE_LEVEL + ["mistral_spm"]


# ---- shared checks (also used by test_aligner_props.py) ----

def cuts_of(sp: TokenSpans, L: int) -> np.ndarray:
    "bool [L+1]: positions no non-empty content span of `sp` straddles (brute force, the oracle)."
    ok = np.ones(L + 1, bool)
    c = (sp.role == 0) & (sp.end > sp.start)
    for s, e in zip(sp.start[c].tolist(), sp.end[c].tolist()): ok[s + 1:e] = False
    return ok


def byte_complete_text(name: str, text: str) -> bool:
    "The tokenizer spans every byte exactly on this text (NFC text for NFC tokenizers, no literal ▁ for SentencePiece)."
    info = describe_tokenizer(tok(name))
    if not info.byte_complete: return False
    if info.space_marker and "▁" in text: return False
    return "NFC" not in info.normalizer or unicodedata.is_normalized("NFC", text)


def check_sample(s, text: str | None = None, byte_complete: bool = False):
    "The chunk properties (a)–(f) of the property test on one SampleAlignment; (d) when the pair is byte-complete on `text`."
    S, T, L, C = s.student, s.teacher, s.kept_nbytes, s.num_chunks
    st, en, kind = s.chunk_start, s.chunk_end, s.chunk_kind
    for ids in (s.student_chunk_id, s.teacher_chunk_id):  # (f) monotone ids in range, every slot used
        assert (np.diff(ids) >= 0).all() and ((ids >= 0) & (ids < C)).all()
    used = np.zeros(C, bool); used[s.student_chunk_id] = True; used[s.teacher_chunk_id] = True
    assert used.all(), "a chunk with no token"
    assert (en >= st).all() and (st[1:] >= en[:-1]).all(), "(a) chunk ranges overlap or do not increase with the id"
    for sp, ids in ((S, s.student_chunk_id), (T, s.teacher_chunk_id)):  # (b) every token inside its chunk's range
        assert (sp.start >= st[ids]).all() and (sp.end <= en[ids]).all(), "(b) a token outside its chunk"
        content = (sp.role == 0) & (sp.end > sp.start)
        covered = np.zeros(L, bool)
        for a, b in zip(sp.start[content].tolist(), sp.end[content].tolist()): covered[a:b] = True
        in_chunk = np.zeros(L, bool)
        for c in np.flatnonzero(kind <= ChunkKind.TEACHER_ONLY): in_chunk[st[c]:en[c]] = True
        assert in_chunk[covered].all(), "(b) a covered byte in no chunk"
    common = np.flatnonzero(cuts_of(S, L) & cuts_of(T, L))
    content = kind <= ChunkKind.TEACHER_ONLY
    assert np.isin(st[content], common).all() and np.isin(en[content], common).all(), "(c) chunk edges must be common cuts"
    k = np.searchsorted(common, st, "right")
    assert not ((k < len(common)) & (common[np.minimum(k, len(common) - 1)] < en)).any(), "(e) a chunk is not the finest"
    specials = kind >= ChunkKind.SPECIAL_PAIR
    assert (st[specials] == en[specials]).all(), "special chunks own no bytes"
    for sp, ids in ((S, s.student_chunk_id), (T, s.teacher_chunk_id)):  # content never sits in a special chunk
        assert not specials[ids[sp.role == 0]].any()
    both = (s.student_chunk_size > 0) & (s.teacher_chunk_size > 0)
    assert (both[kind == ChunkKind.CONTENT]).all() and not both[np.isin(kind, [1, 2, 4, 5])].any()
    assert not s.pair_is_correct[np.isin(kind, [1, 2, 4, 5])].any(), "a one-sided chunk marked correct"
    one_one = s.pair_is_correct & (s.student_chunk_size == 1) & (s.teacher_chunk_size == 1)
    assert (s.student_exact_partition_mask == one_one[s.student_chunk_id]).all()
    assert (s.teacher_exact_partition_mask == one_one[s.teacher_chunk_id]).all()
    if byte_complete and text is not None:  # (d) equal bytes on both sides and in the text
        tb = text.encode()[:L]
        assert not np.isin(kind, [1, 2]).any(), "(d) a one-sided content chunk in a byte-complete pair"
        for c in np.flatnonzero(content):
            for sp, ids in ((S, s.student_chunk_id), (T, s.teacher_chunk_id)):
                m = (ids == c) & (sp.role == 0)
                assert b"".join(tb[a:b] for a, b in zip(sp.start[m], sp.end[m])) == tb[st[c]:en[c]], "(d) bytes differ"
        assert s.pair_is_correct[content].all(), "(d) a byte-complete content chunk is incorrect"


def aligned(aligner: TokenAligner, texts, byte_complete=None, **kw) -> AlignmentResult:
    "align_texts, then validate both layouts and check every sample."
    res = aligner.align_texts(texts, **kw)
    res.to_padded().validate()
    jag = res.to_jagged().validate()
    assert jag.student_chunk_id.offsets() is jag.student_exact_partition_mask.offsets()
    for i, (text, s) in enumerate(zip(texts, res.samples)):
        check_sample(s, text, bool(byte_complete[i] if isinstance(byte_complete, (list, tuple)) else byte_complete))
    return res


def pair(a: str, b: str) -> TokenAligner: return TokenAligner(tok(a), tok(b))


def rows(aligner, text, **kw):
    s = aligned(aligner, [text], **kw).samples[0]
    return [(r["text"], r["student"], r["teacher"], r["kind"], r["correct"])
            for r in chunk_rows(s, text, aligner.student_tokenizer, aligner.teacher_tokenizer)]


def spans(pieces, nbytes, exact=True):
    "Hand-made TokenSpans from [(start, end) | role name]; specials anchored at the end of the content before them (L after it)."
    starts, ends, roles, prev = [], [], [], 0
    content = [i for i, p in enumerate(pieces) if not isinstance(p, str)]
    for i, p in enumerate(pieces):
        if isinstance(p, str):
            a = nbytes if content and i > content[-1] else prev
            starts.append(a); ends.append(a); roles.append(1 + ROLES.index(p))
        else: starts.append(p[0]); ends.append(p[1]); roles.append(0); prev = p[1]
    n = len(pieces)
    return TokenSpans(np.arange(n, dtype=np.int64), np.array(starts, np.int64), np.array(ends, np.int64),
                      np.array([exact and r == 0 for r in roles], bool), np.array(roles, np.int8),
                      np.full(n, -1, np.int32), nbytes).validate()


def summary(s):
    return [(int(a), int(b), ChunkKind(int(k)).name, int(ns), int(nt), bool(c)) for a, b, k, ns, nt, c in
            zip(s.chunk_start, s.chunk_end, s.chunk_kind, s.student_chunk_size, s.teacher_chunk_size, s.pair_is_correct)]


# ---- 1. CJK ----

@pytest.mark.parametrize("a,b", [("qwen2", "mistral_spm"), ("mistral_tekken", "qwen2"), ("mistral_spm", "mistral_tekken"),
                                 ("bpe_bytelevel", "qwen2")])
def test_01_cjk_byte_complete_pairs(a, b):
    texts = ["東京は晴れ", "日本語のテキストと English mixed, 中文。", GOLDEN]
    res = aligned(pair(a, b), texts, byte_complete=True)
    for text, s in zip(texts, res.samples):  # a chunk edge inside a character is a cut of both sides
        tb = text.encode()
        for edge in np.r_[s.chunk_start, s.chunk_end]:
            if 0 < edge < len(tb) and 0x80 <= tb[edge] < 0xC0:
                assert cuts_of(s.student, len(tb))[edge] and cuts_of(s.teacher, len(tb))[edge]


def test_01_golden_split_character():
    assert (" 東", ["ĠæĿ", "±"], ["▁", "東"], "content", True) in rows(pair("qwen2", "mistral_spm"), GOLDEN)


# ---- 2. emoji ----

def test_02_emoji():
    assert (" 🙂", ["ĠðŁĻĤ"], ["ĠðŁ", "Ļ", "Ĥ"], "content", True) in rows(pair("qwen2", "mistral_tekken"), GOLDEN)
    text = "🙂 👍🏽 👨\u200d👩\u200d👧 🇫🇷🇩🇪 ok"
    for a, b in [("qwen2", "mistral_tekken"), ("mistral_spm", "qwen2"), ("mistral_tekken", "mistral_spm")]:
        assert aligned(pair(a, b), [text], byte_complete=True).stats().exact_share == 1.0


# ---- 3. combining accents ----

def test_03_combining_accents():
    text = "e\u0301t\u00e9"
    s = aligned(pair("qwen2", "mistral_tekken"), [text]).samples[0]
    rs = rows(pair("qwen2", "mistral_tekken"), text)
    assert rs[1] == (text, ["Ã©tÃ©"], ["e", "Ì", "ģ", "tÃ©"], "content", False)
    assert not s.student.exact.any() and s.teacher.exact[s.teacher.role == 0].all()
    assert not s.pair_is_correct[1] and not s.student_exact_partition_mask.any()


# ---- 4. whitespace ----

WHITESPACE_TEXT = "a\tb\n\nc   d\r\n "


@pytest.mark.parametrize("a,b", [("qwen2", "mistral_tekken"), ("mistral_spm", "qwen2"), ("mistral_spm", "mistral_tekken"),
                                 ("bpe_bytelevel", "bpe_bytelevel_digits")])
def test_04_whitespace_byte_level(a, b):
    st = aligned(pair(a, b), [WHITESPACE_TEXT], byte_complete=True).stats()
    assert st.byte_coverage == 1.0 and st.exact_share == 1.0


@requires_bert
def test_04_whitespace_against_bert():
    rs = rows(pair("qwen2", "bert_uncased"), WHITESPACE_TEXT)
    assert ("\tb", ["ĉb"], ["b"], "content", True) in rs            # the tab is a whitespace gap of BERT
    assert ("\n\n", ["ĊĊ"], [], "student_only", False) in rs         # whitespace-only tokens: one-sided


def test_04_gaps_must_be_whitespace():
    al = pair("bpe_bytelevel", "bpe_bytelevel")
    student, teacher = spans([(0, 1), (1, 3)], 3), spans([(0, 1), (2, 3)], 3)  # the teacher skips byte 1
    assert summary(al.align_spans(student, teacher, text="a\tb"))[1] == (1, 3, "CONTENT", 1, 1, True)
    assert summary(al.align_spans(student, teacher, text="a-b"))[1] == (1, 3, "CONTENT", 1, 1, False)
    assert summary(al.align_spans(student, teacher, text="a\u3000b".encode()[:1] + b" b"))[1][-1] is True
    wide = al.align_spans(spans([(0, 1), (1, 5)], 5), spans([(0, 1), (4, 5)], 5), text="a\u3000b")  # a 3-byte space
    assert summary(wide)[1] == (1, 5, "CONTENT", 1, 1, True)


@requires_bert
def test_04_gap_bytes_from_pieces_without_text():
    "Without the text, a gap's bytes are read from the piece bytes of the exact tokens that cover it."
    al = pair("qwen2", "bert_uncased")
    for text in ("a\tb c\n\nd", "x  y"):
        s_sp, t_sp = (batch_token_byte_spans(tok(n), [text])[0] for n in ("qwen2", "bert_uncased"))
        with_text, without = al.align_spans(s_sp, t_sp, text=text), al.align_spans(s_sp, t_sp)
        assert summary(with_text) == summary(without) and with_text.pair_is_correct[1:-1].any()


# ---- 5. digits ----

def test_05_digits_free_length_bpe():
    text = " 12345 12345"
    s = aligned(pair("qwen2", "bpe_bytelevel"), [text], byte_complete=True).samples[0]
    assert not ((s.chunk_start < 6) & (s.chunk_end > 6)).any()
    common = np.flatnonzero(cuts_of(s.student, 12) & cuts_of(s.teacher, 12))
    assert s.num_chunks == len(common) - 1


@requires_bert
def test_05_digits_against_bert():
    rs = rows(pair("qwen2", "bert_uncased"), "3.14159")
    assert ("141", ["1", "4", "1"], ["141"], "content", True) in rs
    assert ("59", ["5", "9"], ["##59"], "content", True) in rs


# ---- 6. byte fallback ----

def test_06_byte_fallback():
    text = "x 𝔘 \U0010FFFF"
    al = pair("mistral_spm", "mistral_tekken")
    s = aligned(al, [text], byte_complete=True).samples[0]
    names = tok("mistral_spm").convert_ids_to_tokens(s.student.ids.tolist())
    fallback = [i for i, n in enumerate(names) if n.startswith("<0x")]
    assert len(fallback) == 8 and ((s.student.end - s.student.start)[fallback] == 1).all()
    assert s.student.exact[fallback].all()
    chunks = s.student_chunk_id[fallback]
    assert (s.chunk_kind[chunks] == ChunkKind.CONTENT).all() and s.pair_is_correct[chunks].all()


# ---- 7. BOS on one side ----

def test_07_bos_on_one_side():
    text = "The cat sat on the mat, and 東京 🙂 too."
    with_bos = aligned(pair("mistral_spm", "qwen2"), [text], byte_complete=True)
    no_bos = aligned(TokenAligner(load_tokenizer("mistral_spm", add_bos=False), tok("qwen2")), [text], byte_complete=True)
    s, n = with_bos.samples[0], no_bos.samples[0]
    assert s.chunk_kind[0] == ChunkKind.STUDENT_SPECIAL and s.student_chunk_id[0] == 0
    assert (s.student_chunk_id[1:] == n.student_chunk_id + 1).all() and (s.teacher_chunk_id == n.teacher_chunk_id + 1).all()
    assert (s.chunk_start[1:] == n.chunk_start).all()
    batch = with_bos.to_padded()
    sig_s, sig_t = shift_chunk_ids(batch.student_chunk_id), shift_chunk_ids(batch.teacher_chunk_id)
    C = int(batch.num_chunks[0])
    valid = (torch.bincount(sig_s[sig_s >= 0], minlength=C) > 0) & (torch.bincount(sig_t[sig_t >= 0], minlength=C) > 0)
    two_sided = torch.from_numpy(s.chunk_kind == ChunkKind.CONTENT)
    assert not valid[0] and not valid[1]
    assert valid[2:][two_sided[2:]].all()
    bos_pair = aligned(pair("mistral_tekken", "mistral_spm"), [text], byte_complete=True).samples[0]
    assert summary(bos_pair)[0] == (0, 0, "SPECIAL_PAIR", 1, 1, True)
    assert bos_pair.student_exact_partition_mask[0] and bos_pair.teacher_exact_partition_mask[0]


# ---- 8. pad == eos ----

def test_08_pad_equals_eos():
    al = pair("mistral_spm", "qwen2")
    body = tok("qwen2")("Hi there", add_special_tokens=False)["input_ids"]
    t_ids = torch.tensor([body + [151643] * 4])
    t_mask = torch.tensor([[1] * (len(body) + 1) + [0] * 3])
    s_ids = torch.tensor([tok("mistral_spm")("Hi there")["input_ids"] + [2, 2]])  # student EOS, then EOS as padding
    s_mask = torch.tensor([[1] * (s_ids.shape[1] - 1) + [0]])
    out = al.align(s_ids, t_ids, student_attention_mask=s_mask, teacher_attention_mask=t_mask).validate()
    C = int(out.num_chunks[0])
    assert out.teacher_chunk_id[0, -3:].tolist() == [-1] * 3 and out.student_chunk_id[0, -1] == -1
    assert not out.teacher_exact_partition_mask[0, -3:].any() and not out.student_exact_partition_mask[0, -1]
    assert out.teacher_chunk_id[0, len(body)] == C - 1 == out.student_chunk_id[0, -2]  # the real EOS pairs with </s>
    assert out.pair_is_correct[0, C - 1]
    every = al.align(s_ids, t_ids).validate()  # no masks: every position is real, the extra EOS are one-sided
    assert int(every.num_chunks[0]) == C + 3
    assert (every.teacher_chunk_id[0] >= 0).all() and (every.student_chunk_id[0] >= 0).all()


def test_08_pad_role_never_pairs():
    al = pair("mistral_tekken", "mistral_tekken")  # tekken's <pad> (11) has the role pad only
    ids = torch.tensor([tok("mistral_tekken")("ab")["input_ids"] + [11]])
    out = al.align(ids, ids).validate()
    assert int(out.num_chunks[0]) == out.student_chunk_id[0, -1] + 2  # two one-sided pad chunks at the end
    assert not out.pair_is_correct[0, -2:].any()


# ---- 9. truncation mismatch ----

def brute_force_L(sides, ctx, keep_trailing=False):
    "The largest common cut with each side's content tokens ending at or before it within budget, by brute force."
    L_all = sides[0].nbytes
    ok = np.ones(L_all + 1, bool)
    for sp in sides: ok &= cuts_of(sp, L_all)
    best = 0
    for L in np.flatnonzero(ok).tolist():
        fits = True
        for sp, c in zip(sides, ctx):
            content = np.flatnonzero(sp.role == 0)
            lead = int(content[0]) if len(content) else len(sp.ids)
            trail = len(sp.ids) - int(content[-1]) - 1 if len(content) else 0
            budget = c - lead - (trail if keep_trailing else 0)
            fits &= int((sp.end[content] <= L).sum()) <= budget
        if fits: best = L
    return best


LONG = ("Tokenizers disagree about 東京, 🙂, naïve cafés and 3.14159; the aligner cuts both sides at one byte. " * 6)


@pytest.mark.parametrize("a,b", [("mistral_spm", "qwen2"), ("qwen2", "mistral_tekken"), ("mistral_tekken", "bpe_bytelevel")])
def test_09_truncation_one_common_cut(a, b):
    res = aligned(pair(a, b), [LONG], byte_complete=True, max_student_tokens=16, max_teacher_tokens=64)
    s = res.samples[0]
    full = [batch_token_byte_spans(tok(n), [LONG])[0] for n in (a, b)]
    assert s.kept_nbytes == brute_force_L(full, [16, 64]) and s.truncated
    assert s.dropped_bytes == len(LONG.encode()) - s.kept_nbytes
    assert len(res.student_ids[0]) <= 16 and len(res.teacher_ids[0]) <= 64
    for sp, f in zip((s.student, s.teacher), full):  # a prefix of each side's own encoding
        assert (sp.ids == f.ids[:len(sp.ids)]).all() and sp.end.max(initial=0) <= s.kept_nbytes
    assert not np.isin(s.chunk_kind, [ChunkKind.STUDENT_ONLY, ChunkKind.TEACHER_ONLY]).any()
    assert not np.isin(s.chunk_kind[-1:], [ChunkKind.STUDENT_SPECIAL, ChunkKind.TEACHER_SPECIAL]).any() or s.kept_nbytes == 0


def test_09_three_sides_share_L():
    names, ctx = ["mistral_spm", "qwen2", "mistral_tekken"], [40, 12, 25]
    texts = [LONG, "short text", LONG[:150]]
    sides = [batch_token_byte_spans(tok(n), texts) for n in names]
    cut = truncate_batch(sides, ctx, template_leads=[template_specials(tok(n))[0] for n in names])
    for b in range(len(texts)):
        assert cut.kept_nbytes[b] == brute_force_L([side[b] for side in sides], ctx)
        for n in range(3): assert cut.spans[n][b].nbytes == cut.kept_nbytes[b] and len(cut.spans[n][b].ids) <= ctx[n]
    assert cut.truncated[1].tolist() == [False] * 3 and cut.kept_nbytes[1] == len(b"short text")
    for n in (1, 2):  # align the student with both teachers on the common cut
        res = pair(names[0], names[n]).align_spans_batch(cut.spans[0], cut.spans[n], texts=texts, nbytes=cut.nbytes,
                                                         truncated=cut.truncated)
        res.to_padded().validate()
        for text, s in zip(texts, res.samples): check_sample(s, text, True)
        assert (res.kept_nbytes == cut.kept_nbytes).all()
        assert res.stats().dropped_bytes == int(cut.dropped_bytes.sum())
    one = truncate_spans([side[0] for side in sides], ctx)
    assert one.kept_nbytes == cut.kept_nbytes[0]


@requires_bert
def test_09_trailing_specials():
    al = pair("bert_uncased", "qwen2")
    res = aligned(al, [LONG], max_student_tokens=20)  # [SEP] dropped: the text did not end there
    assert len(res.student_ids[0]) <= 20 and res.student_ids[0][-1] != 102 and res.student_ids[0][0] == 101
    kept = TokenAligner(tok("bert_uncased"), tok("qwen2"), keep_trailing_specials=True)
    res = aligned(kept, [LONG], max_student_tokens=20)
    assert len(res.student_ids[0]) <= 20 and res.student_ids[0][-1] == 102
    full = batch_token_byte_spans(tok("bert_uncased"), [LONG])[0]
    assert res.samples[0].kept_nbytes == brute_force_L([full, batch_token_byte_spans(tok("qwen2"), [LONG])[0]], [20, 10**6],
                                                      keep_trailing=True)


def test_09_errors():
    al = pair("mistral_spm", "qwen2")
    with pytest.raises(ValueError, match="leaves no room for content"): al.align_texts([LONG], max_student_tokens=1)
    with pytest.raises(ValueError, match="max_teacher_tokens: expected an int >= 1 or None, got 0"): al.align_texts([LONG], max_teacher_tokens=0)
    with pytest.raises(ValueError, match="one entry per side"): truncate_batch([[], []], [3])


# ---- 10–11. empty and whitespace-only texts ----

ALL_PAIRS = [("qwen2", "mistral_spm"), ("mistral_spm", "qwen2"), ("mistral_tekken", "mistral_spm"), ("qwen2", "qwen2"),
             ("bpe_bytelevel", "unigram_metaspace"), pytest.param("bert_uncased", "qwen2", marks=BERT_MARKS),
             pytest.param("mistral_spm", "bert_uncased", marks=BERT_MARKS)]


@pytest.mark.parametrize("a,b", ALL_PAIRS)
def test_10_empty_text(a, b):
    res = aligned(pair(a, b), ["", "x"])
    s = res.samples[0]
    assert (s.chunk_kind >= ChunkKind.SPECIAL_PAIR).all() and s.kept_nbytes == 0
    padded = res.to_padded()
    assert padded.pair_valid.shape[1] >= 1
    assert AlignmentResult.from_samples(res.samples[:1]).to_padded().pair_valid.shape[1] >= 1
    res.to_jagged().to_padded().validate()
    if a == "qwen2": assert len(res.student_ids[0]) == 0  # no token at all: the collator masks the sample


@pytest.mark.parametrize("a,b", [("qwen2", "mistral_tekken"), ("mistral_spm", "qwen2"), ("bpe_bytelevel", "mistral_spm")])
def test_11_whitespace_only_byte_level(a, b):
    st = aligned(pair(a, b), ["  \n\t "], byte_complete=True).stats()
    assert st.byte_coverage == 1.0 and st.student_only_chunks == st.teacher_only_chunks == 0


@requires_bert
@pytest.mark.parametrize("a,b", [("qwen2", "bert_uncased"), ("bert_uncased", "mistral_spm")])
def test_11_whitespace_only_bert(a, b):
    st = aligned(pair(a, b), ["  \n\t "]).stats()
    assert st.content_chunks == 0 and st.loss_valid_chunks == 0


# ---- 12. special strings in raw text ----

@pytest.mark.parametrize("a,b", [("qwen2", "mistral_tekken"), ("mistral_spm", "qwen2"), ("mistral_tekken", "mistral_spm"),
                                 pytest.param("bert_uncased", "qwen2", marks=BERT_MARKS)])
def test_12_special_strings_are_content(a, b):
    text = "<s> </s> [INST] <|im_end|> <|endoftext|> [CLS] [UNK] <pad>"
    bc = a in BYTE_COMPLETE and b in BYTE_COMPLETE
    s = aligned(pair(a, b), [text, SPECIAL_TEXT], byte_complete=bc).samples[0]
    for sp, name in ((s.student, a), (s.teacher, b)):
        lead, trail = template_specials(tok(name))
        assert (sp.role != 0).sum() == lead + trail
        assert (sp.role[lead:len(sp.ids) - trail] == 0).all()


# ---- 14–17. worked examples on hand-made spans ----

def test_14_one_4_to_5_chunk():
    s = pair("bpe_bytelevel", "bpe_bytelevel").align_spans(
        spans([(0, 2), (2, 4), (4, 6), (6, 8)], 8), spans([(0, 1), (1, 3), (3, 5), (5, 7), (7, 8)], 8), text="abcdefgh")
    check_sample(s, "abcdefgh", True)
    assert summary(s) == [(0, 8, "CONTENT", 4, 5, True)]


def test_15_two_chunks_not_one_2_to_10():
    digits = [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 8), (8, 9), (9, 10), (10, 11), (11, 12)]
    s = pair("bpe_bytelevel", "bpe_bytelevel").align_spans(spans([(0, 6), (6, 12)], 12), spans(digits, 12),
                                                           text=" 12345 12345")
    assert summary(s) == [(0, 6, "CONTENT", 1, 5, True), (6, 12, "CONTENT", 1, 5, True)]


def test_16_marker_vs_plain_at_start():
    al = pair("mistral_spm", "mistral_tekken")
    s = al.align_spans(spans([(0, 3)], 3), spans([(0, 3)], 3), text="The")
    assert summary(s) == [(0, 3, "CONTENT", 1, 1, True)] and s.student_exact_partition_mask.all()
    s = aligned(TokenAligner(load_tokenizer("mistral_spm", add_bos=False), load_tokenizer("mistral_tekken", add_bos=False)),
                ["The"], byte_complete=True).samples[0]
    assert summary(s) == [(0, 3, "CONTENT", 1, 1, True)]
    assert tok("mistral_spm").convert_ids_to_tokens(s.student.ids.tolist()) == ["▁The"]


def test_17_eos_role_pair():
    al = pair("mistral_spm", "qwen2")
    s = al.align_spans(spans([(0, 2), "eos"], 2), spans([(0, 2), "eos"], 2), text="hi")
    assert summary(s) == [(0, 2, "CONTENT", 1, 1, True), (2, 2, "SPECIAL_PAIR", 1, 1, True)]
    s_ids = torch.tensor([tok("mistral_spm")("hi", add_special_tokens=False)["input_ids"] + [2]])  # </s>
    t_ids = torch.tensor([tok("qwen2")("hi")["input_ids"] + [151643]])                            # <|endoftext|>
    out = al.align(s_ids, t_ids).validate()
    C = int(out.num_chunks[0])
    assert out.pair_is_correct[0, C - 1] and out.student_chunk_id[0, -1] == out.teacher_chunk_id[0, -1] == C - 1
    s = al.align_spans(spans([(0, 2), "eos"], 2), spans([(0, 2), "pad"], 2), text="hi")  # pad never pairs
    assert [row[2] for row in summary(s)] == ["CONTENT", "STUDENT_SPECIAL", "TEACHER_SPECIAL"]


def test_17_role_classes():
    al = pair("bpe_bytelevel", "bpe_bytelevel")
    s = al.align_spans(spans(["cls", (0, 2), "sep"], 2), spans(["bos", (0, 2), "eos"], 2), text="hi")
    assert [row[2] for row in summary(s)] == ["SPECIAL_PAIR", "CONTENT", "SPECIAL_PAIR"] and s.pair_is_correct.all()
    strict = TokenAligner(tok("bpe_bytelevel"), tok("bpe_bytelevel"), role_equivalence=[])
    s = strict.align_spans(spans(["cls", (0, 2), "sep"], 2), spans(["bos", (0, 2), "eos"], 2), text="hi")
    assert [row[2] for row in summary(s)] == ["STUDENT_SPECIAL", "TEACHER_SPECIAL", "CONTENT", "STUDENT_SPECIAL",
                                              "TEACHER_SPECIAL"]
    # two specials per side at one anchor pair by longest common subsequence of their roles
    s = al.align_spans(spans([(0, 2), "eos", "turn_end"], 2), spans([(0, 2), "turn_end"], 2), text="hi")
    assert [row[2] for row in summary(s)] == ["CONTENT", "STUDENT_SPECIAL", "SPECIAL_PAIR"]
    with pytest.raises(ValueError, match="never pairs"): TokenAligner(tok("qwen2"), tok("qwen2"), role_equivalence=[("pad", "eos")])


@requires_bert
def test_17_cls_pairs_with_bos_on_real_tokenizers():
    s = aligned(TokenAligner(load_tokenizer("mistral_spm", add_eos=True), tok("bert_uncased")), ["hello there"]).samples[0]
    assert summary(s)[0] == (0, 0, "SPECIAL_PAIR", 1, 1, True) and summary(s)[-1][2:] == ("SPECIAL_PAIR", 1, 1, True)


# ---- 18–19. the id path ----

def padded_ids(seqs, pad_id, side="right", extra=3):
    T = max([len(s) for s in seqs] + [0]) + extra
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.as_tensor(s, dtype=torch.long); mask[i, sl] = 1
    return ids, mask


@pytest.mark.parametrize("a,b", [("mistral_spm", "qwen2"), ("qwen2", "mistral_tekken"), ("mistral_tekken", "mistral_spm"),
                                 ("bpe_bytelevel", "mistral_spm")])
def test_18_ids_equal_texts_on_equal_streams(a, b):
    texts = [t for t in random_texts(60, seed=7) + [GOLDEN, WHITESPACE_TEXT, "", " lead", "\t\n"]
             if byte_complete_text(a, t) and byte_complete_text(b, t)]
    al = pair(a, b)
    res = aligned(al, texts, byte_complete=True)
    s_ids, s_mask = padded_ids(res.student_ids, 0)
    t_ids, t_mask = padded_ids(res.teacher_ids, 0)
    out = al.align(s_ids, t_ids, student_attention_mask=s_mask, teacher_attention_mask=t_mask).validate()
    ref = res.to_padded(s_ids.shape[1], t_ids.shape[1])
    for f in AlignmentBatch.field_names(): assert torch.equal(getattr(out, f), getattr(ref, f)), f


@pytest.mark.parametrize("a,b", [("mistral_spm", "qwen2"), pytest.param("qwen2", "bert_uncased", marks=BERT_MARKS),
                                 ("unigram_metaspace", "mistral_tekken")])
def test_19_padding_side_does_not_matter(a, b):
    al = pair(a, b)
    res = al.align_texts([GOLDEN, "東京は晴れ", "", "Hello  World"])
    results = []
    for side in ("right", "left", None):
        if side is None:  # no padding: one row at a time, masks None
            rows_ = [al.align(res.student_ids[i][None], res.teacher_ids[i][None]).validate() for i in range(4)]
            results.append([(r.student_chunk_id[0], r.teacher_chunk_id[0], r.pair_is_correct[0, :int(r.num_chunks[0])])
                            for r in rows_])
            continue
        s_ids, s_mask = padded_ids(res.student_ids, 7, side)
        t_ids, t_mask = padded_ids(res.teacher_ids, 5, "right" if side == "left" else "left")
        out = al.align(s_ids, t_ids, student_attention_mask=s_mask.bool(), teacher_attention_mask=t_mask).validate()
        assert (out.student_chunk_id[~s_mask.bool()] == -1).all() and not out.student_exact_partition_mask[~s_mask.bool()].any()
        assert (out.teacher_chunk_id[~t_mask.bool()] == -1).all() and not out.teacher_exact_partition_mask[~t_mask.bool()].any()
        results.append([(out.student_chunk_id[i][s_mask[i].bool()], out.teacher_chunk_id[i][t_mask[i].bool()],
                         out.pair_is_correct[i, :int(out.num_chunks[i])]) for i in range(4)])
    for other in results[1:]:
        for x, y in zip(results[0], other):
            for u, v in zip(x, y): assert torch.equal(u, v)


def test_19_bad_inputs():
    al = pair("mistral_spm", "qwen2")
    ids = torch.ones(2, 5, dtype=torch.long)
    for kwargs, msg in [(dict(student_ids=ids[0], teacher_ids=ids), "must be 2-D"),
                        (dict(student_ids=ids, teacher_ids=ids[:1]), "same batch size"),
                        (dict(student_ids=ids.float(), teacher_ids=ids), "integer ids"),
                        (dict(student_ids=ids, teacher_ids=ids.bool()), "integer ids"),
                        (dict(student_ids=ids, teacher_ids=ids, student_attention_mask=ids[:, :4]), "must have shape"),
                        (dict(student_ids=ids, teacher_ids=ids, teacher_attention_mask=ids * 2), "only 0 and 1"),
                        (dict(student_ids=ids, teacher_ids=ids, teacher_attention_mask=ids.float()), "int or bool"),
                        (dict(student_ids=ids * 10**7, teacher_ids=ids), "outside the tokenizer's ids"),
                        (dict(student_ids=[[1, 2]], teacher_ids=ids), "2-D integer tensor")]:
        with pytest.raises(ValueError, match=msg): al.align(**kwargs)
    out = al.align(torch.zeros(0, 9, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long))
    assert (tuple(out.student_chunk_id.shape), tuple(out.teacher_chunk_id.shape), tuple(out.pair_valid.shape)) == ((0, 9), (0, 4), (0, 1))
    out.validate()
    with pytest.raises(TypeError, match="fast tokenizer"): TokenAligner(object(), tok("qwen2"))
    with pytest.raises(TypeError, match=r"wrap one text as \[text\]"): al.align_texts("one text")
    with pytest.raises(TypeError, match="texts\\[1\\] must be a str"): al.align_texts(["a", 3])


@requires_bert
def test_19_different_streams_are_best_effort_but_valid():
    al = pair("qwen2", "bert_uncased")
    texts = random_texts(40, seed=3) + [GOLDEN, "Hello WORLD, naïve café ǅ 한국어 [UNK] x"]
    res = al.align_texts(texts)
    s_ids, s_mask = padded_ids(res.student_ids, 151643)
    t_ids, t_mask = padded_ids(res.teacher_ids, 0)
    out = al.align(s_ids, t_ids, student_attention_mask=s_mask, teacher_attention_mask=t_mask).validate()
    _, id_res = align_id_rows(s_ids.numpy(), s_mask.numpy().astype(bool), t_ids.numpy(), t_mask.numpy().astype(bool),
                              al.student_facts, al.teacher_facts, al.classes)
    for s in id_res.samples: check_sample(s)
    assert out.pair_is_correct.any() and (out.pair_is_correct.sum(1) <= out.num_chunks).all()


# ---- 20. layouts ----

def test_20_jagged_round_trip():
    res = aligned(pair("mistral_spm", "qwen2"), random_texts(12, seed=5) + [""])
    padded = res.to_padded()
    jag = padded.to_jagged(res.student_lengths, res.teacher_lengths)
    back = jag.to_padded()
    for f in AlignmentBatch.field_names(): assert torch.equal(getattr(back, f), getattr(padded, f)), f
    direct = res.to_jagged()
    for group in (("student_chunk_id", "student_exact_partition_mask"), ("teacher_chunk_id", "teacher_exact_partition_mask"),
                  ("pair_valid", "pair_is_correct")):
        assert getattr(direct, group[0]).offsets() is getattr(direct, group[1]).offsets()
    for f in AlignmentBatch.field_names(): assert torch.equal(getattr(direct.to_padded(), f), getattr(padded, f)), f
    shared = torch.from_numpy(np.r_[0, np.cumsum([len(x) for x in res.student_ids])])
    assert res.to_jagged(student_offsets=shared).student_chunk_id.offsets() is shared


# ---- 21. the shift ----

def test_21_shift_padded_jagged_transposed():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, T = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        lengths = torch.randint(0, T + 1, (B,), generator=g)
        ids = torch.cumsum(torch.randint(0, 2, (B, T), generator=g), 1)
        ids[torch.arange(T) >= lengths[:, None]] = -1
        ref = shift_chunk_ids(ids, lengths=lengths)
        assert torch.equal(ref, shift_chunk_ids(ids))                       # padding already -1
        assert torch.equal(ref, shift_chunk_ids(ids.t().contiguous().t()))  # non-contiguous input
        njt = torch.nested.nested_tensor_from_jagged(ids[torch.arange(T) < lengths[:, None]],
                                                     torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
        out = shift_chunk_ids(njt)
        assert out.offsets() is njt.offsets()
        assert torch.equal(out.to_padded_tensor(-1, output_size=(B, T)), ref)
        assert torch.equal(shift_chunk_ids(ids, fill=-5, lengths=lengths)[torch.arange(T) >= lengths[:, None] - 1],
                           torch.full((int((torch.arange(T) >= lengths[:, None] - 1).sum()),), -5))


def test_21_shift_of_real_alignment():
    res = aligned(pair("mistral_spm", "qwen2"), [GOLDEN, "東京"])
    padded, jag = res.to_padded(), res.to_jagged()
    for side in ("student", "teacher"):
        p, j = getattr(padded, f"{side}_chunk_id"), getattr(jag, f"{side}_chunk_id")
        lengths = getattr(res, f"{side}_lengths")
        assert torch.equal(shift_chunk_ids(j).to_padded_tensor(-1, output_size=tuple(p.shape)), shift_chunk_ids(p, lengths=lengths))


# ---- 27. "Hello world" and the pair report ----

def test_27_hello_world_and_report():
    al = pair("qwen2", "mistral_tekken")
    st = aligned(al, ["Hello world"], byte_complete=True).stats()
    assert (st.byte_coverage, st.one_to_one_share, st.exact_share) == (1.0, 1.0, 1.0)
    report = al.pair_report()
    md = report.to_markdown()
    assert "| digit policy | single | single |" in md
    d = report.to_dict()
    assert d["student"]["digit_policy"] == "single" and d["teacher"]["digit_policy"] == "single"
    assert 0 < d["overlap"] and 0 < d["overlap_share"] <= 1 and d["stats"]["samples"] == len(d["probes"])
    spm_report = pair("mistral_spm", "bpe_bytelevel").pair_report(["Hello world", "12345"])
    assert spm_report.teacher.digit_policy == "free" and spm_report.stats.samples == 2


def test_stats_add_up_over_batches():
    al = pair("mistral_spm", "qwen2")
    texts = random_texts(20, seed=11)
    whole = al.align_texts(texts).stats()
    parts = al.align_texts(texts[:7]).stats() + al.align_texts(texts[7:]).stats()
    assert whole == parts
    assert al.stats(al.align_texts(texts)) == whole == al.stats(al.align_texts(texts).samples)


def test_outputs_do_not_depend_on_batch_composition():
    al = pair("mistral_spm", "qwen2")
    texts = random_texts(10, seed=13)
    together = al.align_texts(texts).samples
    for text, s in zip(texts, together):
        alone = al.align_texts([text]).samples[0]
        for f in ("student_chunk_id", "teacher_chunk_id", "chunk_start", "chunk_end", "chunk_kind", "pair_is_correct",
                  "student_exact_partition_mask", "teacher_exact_partition_mask"):
            assert np.array_equal(getattr(s, f), getattr(alone, f)), f


def test_aligner_pickles():
    import pickle
    al = TokenAligner(tok("qwen2"), tok("mistral_tekken"), keep_trailing_specials=True)
    back = pickle.loads(pickle.dumps(al))
    assert back.keep_trailing_specials and summary(back.align_texts([GOLDEN]).samples[0]) == summary(al.align_texts([GOLDEN]).samples[0])
