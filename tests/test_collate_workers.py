"""The collator in `DataLoader` workers (fork and spawn) gives the batches of
`num_workers=0`, in both layouts and in chat mode. Library-loaded tokenizers travel by reference.

A spawn worker costs seconds to start, so the default run spawns for the jagged layout only (it pickles the same
collator and also sends nested tensors back); `XTOKEN_DP_TEST_FLAGS=slow` adds the padded layout under spawn."""
import os, pickle, sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import tok
from tokenizer_texts import random_texts

from xtoken_dp.aligner import TokenAligner
from xtoken_dp.codec import encode
from xtoken_dp.collate import CrossTokenizerCollator
from xtoken_dp.tokenizers import load_tokenizer

SLOW = "slow" in os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split()
DATA = [{"text": t, "idx": i} for i, t in enumerate(["Hello world", "", "東京は晴れ 🙂 12345"] + random_texts(9, seed=7))]
CHAT = [{"message_log": [{"role": "user", "content": f"Question {i}: {t}"}, {"role": "assistant", "content": t}]}
        for i, t in enumerate(random_texts(6, seed=11))]


def make(output: str, chat: bool = False) -> CrossTokenizerCollator:
    if chat:
        q, t = tok("qwen2"), tok("mistral_tekken")
        return CrossTokenizerCollator(student_tokenizer=q, teacher_tokenizer=t, aligner=TokenAligner(q, t),
                                      ctx_length_student=48, ctx_length_teacher=48, chat=True, output=output)
    spm, qwen, tekken = tok("mistral_spm"), tok("qwen2"), tok("mistral_tekken")
    return CrossTokenizerCollator(student_tokenizer=spm, teacher_tokenizers=[qwen, load_tokenizer("mistral_spm"), tekken],
                                  aligners=[TokenAligner(spm, qwen), None, TokenAligner(spm, tekken)],
                                  ctx_length_student=24, ctx_length_teachers=[32, None, 20], make_seq_div_by_student=8,
                                  output=output, keep_text=output == "jagged", emit_dropped_bytes=True)


def as_flat(batch, collator) -> dict:
    "A comparable plain dict of either layout."
    return collator.materialize(batch) if not isinstance(batch, dict) else batch


def same(a: dict, b: dict) -> bool:
    if list(a) != list(b): return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else list(a[k]) == list(b[k]) for k in a)


def test_pickles_by_reference():
    c = make("padded")
    blob = pickle.dumps(c)
    assert len(blob) < 2_000_000, len(blob)  # the 131k-id tekken and 151k-id qwen2 vocabularies are not inside


SPAWN_PADDED = pytest.mark.skipif(not SLOW, reason="a second spawn run; set XTOKEN_DP_TEST_FLAGS=slow")


@pytest.mark.parametrize("context,output", [("fork", "padded"), ("fork", "jagged"), ("spawn", "jagged"),
                                            pytest.param("spawn", "padded", marks=SPAWN_PADDED)])
def test_workers_equal_main_process(context, output, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    c = make(output)
    serial = [as_flat(b, c) for b in DataLoader(DATA, batch_size=4, collate_fn=c)]
    loader = DataLoader(DATA, batch_size=4, collate_fn=c, num_workers=2, multiprocessing_context=context)
    batches = list(loader)
    if output == "jagged":  # what a worker sends back is still a valid wire batch
        for batch in batches:
            c.schema(idx=True).validate(batch)
            assert encode(batch, schema=c.schema())[0]["fields"]
    parallel = [as_flat(b, c) for b in batches]
    assert len(parallel) == len(serial) == 3
    for a, b in zip(serial, parallel): assert same(a, b)


def test_fork_workers_chat_mode(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    c = make("jagged", chat=True)
    serial = [c.materialize(b) for b in DataLoader(CHAT, batch_size=3, collate_fn=c)]
    parallel = [c.materialize(b) for b in DataLoader(CHAT, batch_size=3, collate_fn=c, num_workers=2,
                                                     multiprocessing_context="fork")]
    assert len(parallel) == 2
    for a, b in zip(serial, parallel): assert same(a, b)
