"""The chunk properties on random Unicode, for every ordered pair of the project's tokenizers.

Each hypothesis example is one text; it is tokenised once per tokenizer and aligned for **every** ordered pair, so every
pair sees every example (300 per pair by default, 2000 with `XTOKEN_DP_TEST_FLAGS=slow`). For each pair:

* (a) chunk byte ranges are disjoint and increase with the id;
* (b) every covered byte is in exactly one chunk and every token inside its chunk's range;
* (c) both sides of a two-sided content chunk account for the same bytes: its edges are common cuts of both sides;
* (d) for byte-complete pairs on text their normalisers keep, each chunk's student bytes equal its teacher bytes and
  its text bytes;
* (e) chunks are the finest: no chunk's range strictly contains a common cut (found by brute force over all bytes);
* (f) ids are monotone, every slot is used, `P >= 1`; and the batch passes `AlignmentBatch.validate()` in both layouts.

Pairs with BERT are a separate test marked `requires_bert`.

Text a normaliser rewrites (decomposed accents, Hangul jamo, reordered marks, compatibility characters and ligatures)
has its own property: every content chunk's tokens, on each side, spell that side's normalisation of the chunk's
text, and the chunks of byte-complete pairs tile the text, with or without a common truncation.
"""
import functools, itertools, os, random, sys, unicodedata
from pathlib import Path

import numpy as np

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
sys.path.insert(0, str(Path(__file__).parent))
from tokenizer_support import no_network, requires_bert, tok
from tokenizer_texts import (ASCII_WORDS, ASTRAL, CJK, COMBINING, CONTROL, DIGITS, EMOJI, HANGUL, OTHER_SCRIPTS,
                             SPECIAL_STRINGS, WHITESPACE, ZERO_WIDTH)
from test_aligner import byte_complete_text, check_sample

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from xtoken_dp.aligner import AlignmentResult, ChunkKind, TokenAligner, template_specials, truncate_batch
from xtoken_dp.tokenizers import batch_token_byte_spans, describe_tokenizer, piece_bytes_table, toy_corpus

SLOW = "slow" in os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split()
EXAMPLES = 2000 if SLOW else 300
NAMES = ["qwen2", "mistral_tekken", "mistral_spm", "bpe_bytelevel", "bpe_bytelevel_digits", "unigram_metaspace",
         "wordpiece_toy"]

pieces = st.one_of(
    st.sampled_from(ASCII_WORDS + OTHER_SCRIPTS),
    st.text(st.sampled_from(" \t\n\r\x0b\x0c\u00a0\u3000"), min_size=1, max_size=5),   # whitespace runs
    st.text(st.sampled_from("0123456789.,"), min_size=1, max_size=9),                    # digits
    st.text(st.sampled_from("".join(CJK + HANGUL)), min_size=1, max_size=4),
    st.lists(st.sampled_from(EMOJI), min_size=1, max_size=3).map("".join),                # emoji sequences
    st.sampled_from(COMBINING), st.sampled_from(ASTRAL + CONTROL + ZERO_WIDTH),
    st.sampled_from(SPECIAL_STRINGS + WHITESPACE + DIGITS),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=4),                      # anything but lone surrogates
)
texts = st.lists(pieces, max_size=16).map("".join)


def align_pairs(pairs, text):
    "Tokenise `text` once per tokenizer, align every pair, check each sample, and validate all of them as one batch."
    names = sorted({n for p in pairs for n in p})
    spans = {n: batch_token_byte_spans(tok(n), [text])[0] for n in names}
    samples = []
    for a, b in pairs:
        s = TokenAligner(tok(a), tok(b)).align_spans_batch([spans[a]], [spans[b]], texts=[text]).samples[0]
        try: check_sample(s, text, byte_complete_text(a, text) and byte_complete_text(b, text))
        except AssertionError as e: raise AssertionError(f"{a} -> {b} on {text!r}: {e}") from None
        samples.append(s)
    batch = AlignmentResult.from_samples(samples)  # one row per pair: validate them all at once, in both layouts
    assert batch.to_padded().validate().pair_valid.shape[1] >= 1
    batch.to_jagged().validate()


PAIRS = [(a, b) for a in NAMES for b in NAMES]
BERT_PAIRS = sorted({p for n in NAMES + ["bert_uncased"] for p in (("bert_uncased", n), (n, "bert_uncased"))})


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(texts)
def test_13_chunk_properties_every_pair(text):
    align_pairs(PAIRS, text)


@requires_bert
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(texts)
def test_13_chunk_properties_with_bert(text):
    align_pairs(BERT_PAIRS, text)


@settings(max_examples=EXAMPLES // 6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(texts, min_size=1, max_size=6))
def test_13_batches_equal_single_samples(batch):
    "The batched core gives every sample the alignment it gets alone (positions of one sample never meet another's)."
    for a, b in [("mistral_spm", "qwen2"), ("unigram_metaspace", "wordpiece_toy")]:
        al = TokenAligner(tok(a), tok(b))
        together = al.align_texts(batch).samples
        for text, s in zip(batch, together):
            alone = al.align_texts([text]).samples[0]
            for f in ("student_chunk_id", "teacher_chunk_id", "chunk_start", "chunk_end", "chunk_kind", "pair_is_correct"):
                assert (getattr(s, f) == getattr(alone, f)).all(), (a, b, text, f)


# ---- text a normaliser rewrites: every chunk byte-consistent ----

NORMALISING_PAIRS_NAMES = ["qwen2", "mistral_spm", "mistral_tekken", "bpe_bytelevel", "wordpiece_toy", "nfkc_toy"]
BYTE_COMPLETE_NAMES = {"qwen2", "mistral_spm", "mistral_tekken", "bpe_bytelevel", "nfkc_toy"}
PROSE = ["The", "data", "were", "collected", "in", "2021", "and", "a", "small", "village", ".", ",", "(", ")"]
COMPOSED = ["é", "ï", "ñ", "Å", "ř", "ậ", "ẋ", "ḱ", "ǅ", "ễ", "각", "한국어", "서울", "감사합니다", "café", "naïve", "Zürich"]
MARKS = ["\u0301", "\u0308", "\u0323", "\u0307", "\u0302", "\u0303", "\u031b", "\u0345", "\u20dd"]
JAMO = ["\u1100", "\u1161", "\u11a8", "\u1109", "\u1165", "\u11af", "\u3131", "\u314f", "\uffa1", "\uffc2", "\u115f"]
COMPAT = ["①", "②", "ﬁ", "ﬂ", "ﬀ", "ﬃ", "Ａ", "ｆｕｌｌ", "㎏", "½", "™", "Ⅳ", "ｶﾀｶﾅ", "\u212b", "\u2126", "ǆ"]

normalisable = st.one_of(
    st.sampled_from(PROSE),
    st.sampled_from(COMPOSED).map(lambda w: unicodedata.normalize("NFD", w)),    # decomposed accents and jamo
    st.sampled_from(COMPOSED),
    st.lists(st.sampled_from(MARKS), min_size=1, max_size=3).map("".join),        # stacked marks, any order
    st.lists(st.sampled_from(JAMO), min_size=1, max_size=3).map("".join),         # conjoining and compatibility jamo
    st.sampled_from(COMPAT),                                                      # NFC keeps them, NFKC folds them
    st.sampled_from([" ", "  ", "\n", "\t", " \u00a0"]),
)
normalisable_texts = st.lists(normalisable, max_size=20).map("".join)


@functools.cache
def nfkc_toy():
    "A byte-level BPE with an NFKC normaliser, trained on the toy corpus (no such tokenizer ships offline)."
    tk = Tokenizer(models.BPE())
    tk.normalizer, tk.pre_tokenizer = normalizers.NFKC(), pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(toy_corpus(max_bytes=100_000), trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def norm_tok(name):
    return nfkc_toy() if name == "nfkc_toy" else tok(name)


@functools.cache
def normaliser(name):
    "bytes -> what the tokenizer's normaliser makes of them (WordPiece: whitespace dropped, as its pre-tokenizer does)."
    t, info = norm_tok(name), describe_tokenizer(norm_tok(name))
    forms = [s for s in info.normalizer if s in ("NFC", "NFD", "NFKC", "NFKD")]
    if forms:
        def unicode_forms(b):   # unicodedata, so that a chunk ending inside a character (both sides cut there) stays as is
            s = b.decode("utf-8", "surrogateescape")
            for f in forms: s = unicodedata.normalize(f, s)
            return s.encode("utf-8", "surrogateescape")
        return unicode_forms
    if info.family == "wordpiece":
        return lambda b: "".join(t.backend_tokenizer.normalizer.normalize_str(b.decode()).split()).encode()
    return lambda b: b   # no normaliser, or only SentencePiece's space marker


def spelling_errors(sample, text, s_name, t_name):
    "Two-sided content chunks where a side's pieces are not the side's normalisation of the chunk's text bytes."
    tb, bad = text.encode()[:sample.kept_nbytes], []
    for sp, ids, name in ((sample.student, sample.student_chunk_id, s_name), (sample.teacher, sample.teacher_chunk_id, t_name)):
        t = norm_tok(name)
        table, norm, marker = piece_bytes_table(t), normaliser(name), describe_tokenizer(t).space_marker
        content = np.flatnonzero(sp.role == 0)
        for c in np.flatnonzero(sample.chunk_kind == ChunkKind.CONTENT):
            members = np.flatnonzero((ids == c) & (sp.role == 0))
            if t.unk_token_id is not None and (sp.ids[members] == t.unk_token_id).any(): continue
            got = b"".join(table[int(i)] for i in sp.ids[members])
            want = norm(tb[sample.chunk_start[c]:sample.chunk_end[c]])
            dummy = marker and len(content) and content[0] in members and got == b" " + want   # SentencePiece's prefix
            if got != want and not dummy: bad.append((int(c), got, want))
    return bad


def check_consistent(sample, text, a, b):
    "Both sides of every content chunk stand for its text; byte-complete pairs: two-sided chunks tile [0, L)."
    assert not spelling_errors(sample, text, a, b), f"{a} -> {b} on {text!r}: {spelling_errors(sample, text, a, b)}"
    if a in BYTE_COMPLETE_NAMES and b in BYTE_COMPLETE_NAMES:
        content = np.isin(sample.chunk_kind, [ChunkKind.CONTENT, ChunkKind.STUDENT_ONLY, ChunkKind.TEACHER_ONLY])
        content &= sample.chunk_end > sample.chunk_start   # a lone dummy prefix kept by truncation owns no byte
        st, en = sample.chunk_start[content], sample.chunk_end[content]
        assert (sample.chunk_kind[content] == ChunkKind.CONTENT).all(), f"{a} -> {b} on {text!r}: a one-sided chunk"
        assert st.tolist() == [0] * bool(len(st)) + en[:-1].tolist() and (en[-1:] == sample.kept_nbytes).all(), \
            f"{a} -> {b} on {text!r}: chunks do not tile the text"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(normalisable_texts, st.integers(2, 30), st.integers(2, 30))
def test_normalised_text_gives_consistent_chunks(text, ctx_a, ctx_b):
    """For every pair (qwen2 and an NFKC toy normalise, a toy WordPiece has BERT's normaliser, the others none): every
    content chunk's tokens, on each side, spell that side's normalisation of the chunk's text bytes, so both sides cover
    exactly the same text; chunks tile the text for byte-complete pairs; the same after a common truncation."""
    spans = {n: batch_token_byte_spans(norm_tok(n), [text]) for n in NORMALISING_PAIRS_NAMES}
    for a, b in itertools.permutations(NORMALISING_PAIRS_NAMES, 2):
        al = TokenAligner(norm_tok(a), norm_tok(b))
        sample = al.align_spans_batch(spans[a], spans[b], texts=[text]).samples[0]
        check_consistent(sample, text, a, b)
        cut = truncate_batch([spans[a], spans[b]], [ctx_a, ctx_b], texts=[text],
                             template_leads=[template_specials(norm_tok(n))[0] for n in (a, b)])
        short = al.align_spans_batch(cut.spans[0], cut.spans[1], texts=[text], nbytes=cut.nbytes).samples[0]
        check_consistent(short, text, a, b)
        for s in (sample, short): s.student.validate(); s.teacher.validate()


def test_normalised_comparison_set_is_consistent():
    "150 prose texts with decomposed accents, jamo and compatibility characters: no chunk that is not byte-consistent."
    rng = random.Random(0)
    prose = ["The committee met on Tuesday to discuss the budget.", "She walked along the river until the sun went down.",
             "Our results suggest a modest improvement over the baseline.", "He ordered a coffee and sat by the window."]
    texts = []
    for _ in range(150):
        words = rng.choice(prose).split(" ")
        for _ in range(rng.randint(1, 3)):
            w = rng.choice(COMPOSED + COMPAT)
            words.insert(rng.randrange(len(words) + 1), unicodedata.normalize("NFD", w) if rng.random() < 0.8 else w)
        texts.append(" ".join(words))
    for a, b in [("qwen2", "mistral_spm"), ("mistral_tekken", "qwen2"), ("wordpiece_toy", "nfkc_toy")]:
        res = TokenAligner(norm_tok(a), norm_tok(b)).align_texts(texts)
        for text, sample in zip(texts, res.samples): check_consistent(sample, text, a, b)
        if a in BYTE_COMPLETE_NAMES and b in BYTE_COMPLETE_NAMES: assert res.stats().byte_coverage == 1.0
