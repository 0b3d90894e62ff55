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
"""
import os, sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
sys.path.insert(0, str(Path(__file__).parent))
from tokenizer_support import no_network, requires_bert, tok
from tokenizer_texts import (ASCII_WORDS, ASTRAL, CJK, COMBINING, CONTROL, DIGITS, EMOJI, HANGUL, OTHER_SCRIPTS,
                             SPECIAL_STRINGS, WHITESPACE, ZERO_WIDTH)
from test_aligner import byte_complete_text, check_sample

from xtoken_dp.aligner import AlignmentResult, TokenAligner
from xtoken_dp.tokenizers import batch_token_byte_spans

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
