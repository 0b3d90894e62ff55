"""The tiled route of the chunk algorithm (`align_tiled`) against the general sweep, field by field.

`align_flat(route="auto")` takes the tiled route whenever every sample of a batch tiles on both sides and the general
sweep otherwise; `route="general"` always sweeps. On random batches of random Unicode (multilingual text, emoji
sequences, combining marks, whitespace runs, special-token strings, empty texts), tokenised by real tokenizer pairs
from the installed packages and truncated to random contexts, the two routes must give identical `FlatAlignment` arrays
(values and dtypes), and so identical `AlignmentBatch`es. 100 batches per test by default, 600 with
`XTOKEN_DP_TEST_FLAGS=slow`.
"""
import dataclasses, os, sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
sys.path.insert(0, str(Path(__file__).parent))
from tokenizer_support import no_network, tok
from test_aligner_props import texts

from xtoken_dp.aligner import TokenAligner, role_classes, truncate_batch
from xtoken_dp.chunking import FlatAlignment, align_flat, align_tiled
from xtoken_dp.tokenizers import TokenSpans, batch_token_byte_spans

SLOW = "slow" in os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split()
EXAMPLES = 600 if SLOW else 100
BYTE_COMPLETE = ["qwen2", "mistral_tekken", "mistral_spm"]
PAIRS = [(a, b) for a in BYTE_COMPLETE for b in BYTE_COMPLETE if a != b] + [("mistral_spm", "unigram_metaspace"),
                                                                            ("wordpiece_toy", "qwen2")]
CLASSES = role_classes()


def differing_field(a: FlatAlignment, b: FlatAlignment):
    "The first `FlatAlignment` field whose dtype or values differ, else None."
    for f in dataclasses.fields(FlatAlignment):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y): return f.name
    return None


def both_routes(a: str, b: str, batch: list[str], ctx=(None, None)):
    "The tiled result (None when the route does not apply) and the general one, on the kept spans of `batch`."
    cut = truncate_batch([batch_token_byte_spans(tok(a), batch), batch_token_byte_spans(tok(b), batch)], list(ctx))
    S, T = cut.spans
    kept = [t.encode()[:s.nbytes] for t, s in zip(batch, S)]
    L = np.array([s.nbytes for s in S], np.int64)
    general = align_flat(S, T, CLASSES, kept.__getitem__, route="general")
    auto = align_flat(S, T, CLASSES, kept.__getitem__)
    return align_tiled(S, T, CLASSES, L), general, auto


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(texts, min_size=1, max_size=6), st.sampled_from([None, 3, 8, 40]), st.sampled_from([None, 5, 30]))
@example(batch=["\u1100"], ctx_s=3, ctx_t=None)  # truncation keeps no content segment but an empty token
def test_tiled_route_equals_general_route(batch, ctx_s, ctx_t):
    for a, b in PAIRS:
        tiled, general, auto = both_routes(a, b, batch, (ctx_s, ctx_t))
        assert differing_field(auto, general) is None, (a, b, batch, ctx_s, ctx_t, differing_field(auto, general))
        if tiled is not None:
            assert differing_field(tiled, general) is None, (a, b, batch, ctx_s, ctx_t, differing_field(tiled, general))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(texts)
def test_tiled_route_one_sample_equals_its_batch_row(text):
    "A sample aligned alone (where it may tile) equals its row of a batch that the general route must take."
    for a, b in PAIRS[:3]:
        al = TokenAligner(tok(a), tok(b))
        alone = al.align_texts([text]).samples[0]
        row = al.align_texts([text, ""]).samples[0]   # the empty text keeps the batch off the tiled route
        for f in ("student_chunk_id", "teacher_chunk_id", "chunk_start", "chunk_end", "chunk_kind", "pair_is_correct",
                  "student_exact_partition_mask", "teacher_exact_partition_mask"):
            assert np.array_equal(getattr(alone, f), getattr(row, f)), (a, b, text, f)


MIXED = ["Hello world, this is plain prose.", " 東京は晴れ 🙂 👍🏽 👨‍👩‍👧 🇯🇵", "naïve café e\u0301t\u00e9",
         "a\tb\n\nc   d\r\n ", "x 𝔘 \U0010FFFF 3.14159 12345", "def f(x):\n    return x**2\n", "  \n\t "]


@pytest.mark.parametrize("a,b", PAIRS[:6])
@pytest.mark.parametrize("ctx", [(None, None), (6, 40), (40, 6)])
def test_tiled_route_is_taken_and_equal(a, b, ctx):
    "On ordinary text of the byte-complete pairs the tiled route applies (so the property test compares two routes)."
    tiled, general, auto = both_routes(a, b, MIXED, ctx)
    assert tiled is not None, (a, b, ctx)
    assert differing_field(tiled, general) is None
    assert differing_field(auto, general) is None


def test_tiled_route_declines():
    "Empty texts (L = 0), whitespace-skipping WordPiece and an empty batch go the general way."
    assert both_routes("qwen2", "mistral_tekken", ["Hello", ""])[0] is None
    assert both_routes("qwen2", "wordpiece_toy", ["Hello world"])[0] is None
    assert align_tiled([], [], CLASSES, np.zeros(0, np.int64)) is None
    with pytest.raises(ValueError, match="route: expected"): align_flat([], [], CLASSES, None, route="tiled")


GAPPED = [("wordpiece_toy", "qwen2"), ("qwen2", "wordpiece_toy"), ("mistral_spm", "unigram_metaspace")]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(texts, min_size=2, max_size=6))
@example(batch=["a\x01 b\u00a0c \u3000d", "e\u0301 f\x0b g", "  \t"])   # gaps of control, no-break and ideographic space
def test_general_route_rows_equal_samples_alone(batch):
    "The general route reads every gap's bytes on the batch's byte axis at once: each row equals its sample aligned alone."
    for a, b in GAPPED:
        al = TokenAligner(tok(a), tok(b))
        whole = al.align_texts(batch).samples
        for i, text in enumerate(batch):
            alone = al.align_texts([text]).samples[0]
            for f in ("student_chunk_id", "teacher_chunk_id", "chunk_start", "chunk_end", "chunk_kind", "pair_is_correct",
                      "student_exact_partition_mask", "teacher_exact_partition_mask"):
                assert np.array_equal(getattr(whole[i], f), getattr(alone, f)), (a, b, batch, i, f)


def test_gap_bytes_decide_correctness():
    "A 2:1 chunk whose student gap holds whitespace (1-3 bytes) is correct; a control character or a letter there, not."
    def spans(starts, ends, nbytes):
        k = len(starts)
        return TokenSpans(np.arange(5, 5 + k), np.array(starts), np.array(ends), np.ones(k, bool), np.zeros(k, np.int8),
                          np.full(k, -1, np.int32), nbytes)
    texts = ["a b", "a\x01b", "a\u00a0b", "a\u00e9b", "a\u3000b"]   # gaps of 1, 1, 2, 2 and 3 bytes
    widths = [len(t.encode()) - 2 for t in texts]
    S = [spans([0, 1 + w], [1, 2 + w], 2 + w) for w in widths]
    T = [spans([0], [2 + w], 2 + w) for w in widths]
    al = TokenAligner(tok("wordpiece_toy"), tok("qwen2"))
    got = [bool(s.pair_is_correct.item()) for s in al.align_spans_batch(S, T, texts=texts).samples]
    assert got == [True, False, True, False, True]
