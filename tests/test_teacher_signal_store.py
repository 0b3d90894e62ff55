"""The teacher store: a killed scorer resumes without losing or duplicating a text, the round trip keeps what it stores,
one store serves several student tokenizers with the alignments the live collator makes, and bad stores are refused
with typed errors before any loss."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from xtoken_dp.aligner import TokenAligner
from xtoken_dp.collate import CrossTokenizerCollator
from xtoken_dp.teacher_store import (MissingShardError, SignalPacking, StoredSignalCollator, StoreMismatchError,
                                     StoreShardError, StoreTextsError, TeacherSignalDataset, TeacherStoreError,
                                     score_batch, score_texts, text_hash)
from xtoken_dp.tokenizers import load_tokenizer, train_toy_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEACHER = "mistral_spm"
MODEL_SOURCE = textwrap.dedent('''
    import time, torch
    class SlowLM(torch.nn.Module):
        "A deterministic stand-in teacher that takes its time, so that a run can be killed half way."
        def __init__(self, vocab_size, delay=0.0):
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.out, self.delay = torch.nn.Embedding(vocab_size, 8), torch.nn.Linear(8, vocab_size), delay
        def forward(self, ids):
            time.sleep(self.delay)
            return self.out(self.emb(ids).cumsum(1))
''')
_namespace = {}
exec(MODEL_SOURCE, _namespace)
SlowLM = _namespace["SlowLM"]
TEXTS = [f"Text {i}: {'naïve café 東京 🙂 ' * (i % 4)}the quick brown fox {i * 7} jumps." for i in range(40)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TEACHER)


def _score(tok, path, texts=TEXTS, **kw):
    kw = {"k": 8, "shard_size": 2, "batch_size": 2, "model_id": "slow-lm", "progress": False, **kw}
    return score_texts(SlowLM(len(tok)), tok, texts, path, **kw)


CHILD = """
import sys, torch
from xtoken_dp.teacher_store import score_texts
from xtoken_dp.tokenizers import load_tokenizer, train_toy_tokenizer
exec(sys.argv[1])
texts = [f"Text {i}: {'naïve café 東京 🙂 ' * (i % 4)}the quick brown fox {i * 7} jumps." for i in range(40)]
tok = load_tokenizer(sys.argv[2])
score_texts(SlowLM(len(tok), delay=0.05), tok, texts, sys.argv[3], k=8, shard_size=2, batch_size=2, model_id="slow-lm",
            progress=False)
"""


def _listed(path):
    try: return len(json.loads((Path(path) / "manifest.json").read_text())["shards"])
    except (OSError, ValueError): return 0


def _run_and_kill(path, after_shards):
    "Start a scoring process and SIGKILL it once the manifest lists `after_shards` shards (it must not have finished)."
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, MODEL_SOURCE, TEACHER, str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _listed(path) < after_shards:
            if proc.poll() is not None: pytest.fail(f"the scorer ended before it was killed: {proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline: pytest.fail("the scorer made no progress")
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None: proc.kill(); proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def test_a_killed_scorer_resumes_without_losing_or_duplicating_a_text(tok, tmp_path):
    _run_and_kill(tmp_path / "store", 3)
    _run_and_kill(tmp_path / "store", 9)  # the second run resumed from the first's shards before it was killed
    listed = _listed(tmp_path / "store")
    assert 9 <= listed < 20
    resumed = _score(tok, tmp_path / "store")
    fresh = _score(tok, tmp_path / "fresh")
    assert len(resumed) == len(TEXTS) and resumed.text_hashes == [text_hash(t) for t in TEXTS]
    assert [s["dir"] for s in resumed.manifest["shards"]] == [f"shard-{i:06d}" for i in range(20)]
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted(["manifest.json", *(f"shard-{i:06d}" for i in range(20))])
    assert resumed.signals(range(len(TEXTS))).same_as(fresh.signals(range(len(TEXTS))))
    assert [resumed[i]["text"] for i in range(len(TEXTS))] == TEXTS


def test_the_round_trip_keeps_what_the_store_keeps(tok, tmp_path):
    exact = _score(tok, tmp_path / "exact", packing=SignalPacking("exact"), shard_size=7)
    direct = torch.cat([score_batch(SlowLM(len(tok)), tok, TEXTS[i:i + 2], k=8) for i in range(0, len(TEXTS), 2)])
    assert exact.signals(range(len(TEXTS))).same_as(direct)
    order = torch.randperm(len(TEXTS), generator=torch.Generator().manual_seed(0))
    assert exact.signals(order.tolist()).same_as(direct[order])
    packed = _score(tok, tmp_path / "packed", shard_size=7)
    again = _score(tok, tmp_path / "again", shard_size=7)
    assert packed.signals(range(len(TEXTS))).same_as(again.signals(range(len(TEXTS))))  # packing is deterministic
    from xtoken_dp.teacher_store import shard_columns, signal_from_shard
    signal = packed.shard(0)
    repacked = signal_from_shard(shard_columns(signal, packed.packing, packed.manifest["shards"][0]["text_hashes"])[0],
                                 packed.packing, packed.vocab_size, packed.k)
    assert repacked.same_as(signal)  # what packing kept comes back bit for bit
    err = (packed.signals(range(4)).sparse().densify().exp() - direct[:4].sparse().densify().exp()).abs().max()
    assert float(err) < 0.02  # probabilities within 2 points of the exact ones


def _student(name):
    return train_toy_tokenizer("wordpiece_toy", vocab_size=300) if name == "toy_wordpiece" else load_tokenizer(name)


@pytest.mark.parametrize("student", ["qwen2", "mistral_tekken", "toy_wordpiece"])
def test_one_store_serves_any_student_tokenizer_byte_exactly(tok, tmp_path_factory, student):
    path = tmp_path_factory.getbasetemp() / "shared_store"
    data = TeacherSignalDataset(path) if (path / "manifest.json").exists() else _score(tok, path)
    student_tok = _student(student)
    for budget in (None, 9):
        stored, teachers = StoredSignalCollator(data, student_tok, max_student_tokens=budget)([data[i] for i in range(12)])
        live = CrossTokenizerCollator(student_tokenizer=student_tok, teacher_tokenizer=tok, aligner=TokenAligner(student_tok, tok),
                                      ctx_length_student=budget or 10 ** 6, ctx_length_teacher=10 ** 6, pad_to="longest")(
            [{"text": t} for t in TEXTS[:12]])
        for key in live:
            if key.startswith(("alignment_0_", "teacher_0_")) or key in ("input_ids", "token_mask", "input_lengths"):
                assert torch.equal(stored[key], live[key]), (student, budget, key)
        assert teachers[0].lengths.tolist() == live["teacher_0_input_lengths"].tolist()


def test_bad_stores_and_uses_are_refused_with_typed_errors(tok, tmp_path):
    good = _score(tok, tmp_path / "good", texts=TEXTS[:6])

    def copy(name, edit=None):
        dst = tmp_path / name
        shutil.copytree(good.path, dst)
        if edit:
            m = json.loads((dst / "manifest.json").read_text()); edit(m); (dst / "manifest.json").write_text(json.dumps(m))
        return dst

    other = SlowLM(len(tok)); torch.nn.init.zeros_(other.out.bias)
    with pytest.raises(StoreMismatchError, match="manifest.json: written by teacher model_fingerprint"):
        score_texts(other, tok, TEXTS[:6], tmp_path / "good", k=8, shard_size=2, model_id="slow-lm", progress=False)
    with pytest.raises(StoreMismatchError, match="written with k=8, this run asks for 4"):
        _score(tok, tmp_path / "good", texts=TEXTS[:6], k=4)
    with pytest.raises(StoreMismatchError, match="tokenizer_fingerprint"):
        good.check_teacher(tokenizer=load_tokenizer("qwen2"))
    with pytest.raises(StoreTextsError, match="text 3 differs"):
        TeacherSignalDataset(good.path, texts=TEXTS[:3] + TEXTS[4:7])
    with pytest.raises(ValueError, match="k must be <= the teacher's vocabulary size"):
        _score(tok, tmp_path / "k", k=len(tok) + 1)
    missing = copy("missing"); shutil.rmtree(missing / "shard-000002")
    with pytest.raises(MissingShardError, match="shard-000002: the manifest lists this shard"):
        TeacherSignalDataset(missing)
    short = copy("short")
    column = sorted((short / "shard-000001" / "tensors").glob("*.bin"))[0]
    column.write_bytes(column.read_bytes()[:-1])
    with pytest.raises(StoreShardError, match=r"shard-000001: holds \d+ data bytes, the store's manifest says"):
        TeacherSignalDataset(short)
    lying = copy("lying", lambda m: m["shards"][1].update(rows=3, text_hashes=m["shards"][1]["text_hashes"] + ["00" * 16]))
    with pytest.raises(StoreShardError, match="shard-000001: holds 2 rows, the store's manifest says 3"):
        TeacherSignalDataset(lying)
    with pytest.raises(TeacherStoreError, match="k=32001 must lie in"):
        TeacherSignalDataset(copy("big_k", lambda m: m.update(k=m["teacher"]["vocab_size"] + 1)))
    with pytest.raises(TeacherStoreError, match="version 2, this reader reads"):
        TeacherSignalDataset(copy("future", lambda m: m.update(version=2)))
