"""Teacher signals through the data plane: a scorer puts them by key, the trainer gets them, in process and on
TransferQueue (a scorer process attached to the test's local Ray); what the trainer gets is, bit for bit, what the
store would keep (packed) or what the teacher produced (exact)."""
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from xtoken_dp.dataplane import InProcessDataPlane, TransferQueueDataPlane
from xtoken_dp.teacher_store import SignalPacking, score_batch
from xtoken_dp.teacher_stream import get_signal, put_signal, score_and_put
from xtoken_dp.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [f"Sample {i}: naïve café 東京 🙂 and {i * 13} more words." for i in range(6)]
KEYS = [f"doc-{i}" for i in range(6)]
SCORER = """
import sys, torch
from xtoken_dp.dataplane import TransferQueueDataPlane
from xtoken_dp.teacher_stream import score_and_put
from xtoken_dp.tokenizers import load_tokenizer
tok = load_tokenizer("mistral_spm")
torch.manual_seed(0)
teacher = torch.nn.Sequential(torch.nn.Embedding(len(tok), 16), torch.nn.Linear(16, len(tok)))
texts = [f"Sample {i}: naïve café 東京 🙂 and {i * 13} more words." for i in range(6)]
keys = [f"doc-{i}" for i in range(6)]
with TransferQueueDataPlane(bootstrap=False, ray_address=sys.argv[1]) as plane:
    plane.register_partition(sys.argv[2])
    for i in range(0, 6, 2): score_and_put(plane, teacher, tok, texts[i:i + 2], keys[i:i + 2], sys.argv[2], k=32)
"""


@pytest.fixture(scope="module")
def tok(): return load_tokenizer("mistral_spm")


@pytest.fixture(scope="module")
def teacher(tok):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(len(tok), 16), torch.nn.Linear(16, len(tok)))




def expected(teacher, tok, packing):
    "What the trainer should get: the scorer's batches of two, put and read back in process."
    with InProcessDataPlane() as plane:
        plane.register_partition("p")
        for i in range(0, 6, 2):
            put_signal(plane, KEYS[i:i + 2], "p", score_batch(teacher, tok, TEXTS[i:i + 2], k=32), packing=packing)
        return get_signal(plane, KEYS, "p")


def test_in_process_the_exact_form_is_the_teachers_signal_bit_for_bit(teacher, tok):
    direct = torch.cat([score_batch(teacher, tok, TEXTS[i:i + 2], k=32) for i in range(0, 6, 2)])
    assert expected(teacher, tok, SignalPacking("exact")).same_as(direct)
    with InProcessDataPlane() as plane:
        plane.register_partition("p")
        score_and_put(plane, teacher, tok, TEXTS[:2], KEYS[:2], "p", k=32, prefix="teacher_1_")
        with pytest.raises(KeyError):  # another teacher's prefix holds nothing under these keys
            get_signal(plane, KEYS[:2], "p", prefix="teacher_0_", timeout_s=0.1)


def test_a_scorer_process_puts_signals_the_trainer_gets_on_transfer_queue(tq_plane, teacher, tok):
    partition = f"signals_{uuid.uuid4().hex[:8]}"
    tq_plane.register_partition(partition)
    proc = subprocess.run([sys.executable, "-c", SCORER, tq_plane.ray_address, partition], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = get_signal(tq_plane, KEYS[::-1], partition)  # any order, by key
    want = expected(teacher, tok, SignalPacking())
    assert got.same_as(want[torch.arange(5, -1, -1)])
    assert got.texts() == TEXTS[::-1]
    tq_plane.clear_samples(KEYS, partition)

