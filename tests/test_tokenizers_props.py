"""Property tests of byte-span recovery on random Unicode, for every tokenizer of the project.

* the invariants of byte spans hold (`TokenSpans.validate`);
* the generic path equals an independent per-token reference implementation of span recovery;
* for byte-complete tokenizers on text their normaliser keeps (NFC; no literal ▁ for SentencePiece): content spans tile [0, nbytes), every token is exact, and the
  fast path equals the generic path and passes the offset cross-check.

`XTOKEN_DP_TEST_FLAGS=slow` raises the number of hypothesis examples.
"""
import os, sys, unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import BERT_MARKS, no_network, reference_spans, tok
from tokenizer_texts import (ASTRAL, COMBINING, CONTROL, EMOJI, SPECIAL_STRINGS, WHITESPACE, ZERO_WIDTH,
                             random_texts)

from xtoken_dp.tokenizers import batch_token_byte_spans, describe_tokenizer, token_byte_spans

SLOW = "slow" in os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split()
NAMES = ["qwen2", "mistral_tekken", "mistral_spm", pytest.param("bert_uncased", marks=BERT_MARKS),
         "bpe_bytelevel", "bpe_bytelevel_digits", "unigram_metaspace", "wordpiece_toy"]

pieces = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=6),         # anything but lone surrogates
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=10),
    st.sampled_from(SPECIAL_STRINGS + WHITESPACE + EMOJI + COMBINING + ASTRAL + CONTROL + ZERO_WIDTH + ["12345", "3.14"]),
)
texts = st.lists(pieces, max_size=12).map("".join)


def normaliser_invariant(t, text):
    "NFC tokenizers need NFC text; SentencePiece cannot tell a literal ▁ from a space."
    info = describe_tokenizer(t)
    if info.space_marker and "▁" in text: return False
    return "NFC" not in info.normalizer or unicodedata.is_normalized("NFC", text)


def check(t, text):
    sp = token_byte_spans(t, text).validate()
    assert sp.nbytes == len(text.encode())
    gen = token_byte_spans(t, text, path="generic").validate()
    ref = reference_spans(t, text)
    got = (gen.ids.tolist(), gen.start.tolist(), gen.end.tolist(), gen.exact.tolist(), gen.role.tolist(),
           gen.run.tolist())
    assert got == tuple(list(x) for x in ref), text
    info = describe_tokenizer(t)
    if info.byte_complete and normaliser_invariant(t, text):
        c = sp.role == 0
        assert sp.exact[c].all()
        assert sp.start[c][:1].tolist() in ([], [0]) and sp.end[c][-1:].tolist() in ([], [sp.nbytes])
        assert (sp.start[c][1:] == sp.end[c][:-1]).all()
        assert sp == gen
        assert token_byte_spans(t, text, check_offsets=True) == sp
    return sp


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=400 if SLOW else 40, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=texts)
def test_k12_span_invariants(name, text):
    check(tok(name), text)


@pytest.mark.parametrize("name", NAMES)
def test_k12_random_corpus_and_batches(name):
    t = tok(name)
    before = describe_tokenizer(t).fast_path_failures
    corpus = random_texts(600 if SLOW else 150, seed=11)
    singles = [check(t, text) for text in corpus]
    assert batch_token_byte_spans(t, corpus) == singles            # batching changes nothing
    assert batch_token_byte_spans(t, corpus[::-1]) == singles[::-1]
    assert describe_tokenizer(t).fast_path_failures == before       # no cross-check ever failed
