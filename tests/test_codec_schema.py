"""Property and cross-process tests of `xtoken_dp.schema`: schema serialization and `AlignmentBatch` layouts.

The notebook `nbs/00_schema.ipynb` asserts the worked examples; here hypothesis draws random valid alignments and
checks `to_padded(to_jagged(x)) == x`, shared offsets per axis, `validate()`, and the left-padding refusal.
"""
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xtoken_dp.schema import AlignmentBatch, FieldSpec, Schema, SchemaError, is_jagged

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("XTOKEN_DP_HYPOTHESIS_EXAMPLES", "40"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

SCHEMA_CODE = """
import torch
from xtoken_dp.schema import FieldSpec, Schema, AlignmentBatch
s = Schema([FieldSpec("input_ids", "token", torch.int64, pad_value=151643, group="student"),
            FieldSpec("lp", "token", torch.bfloat16, pad_value=float("-inf"), group="teacher_0", trailing_shape=(8,)),
            FieldSpec("r", "sample", torch.float32), FieldSpec("g", "rect", trailing_shape=(3,)), FieldSpec("t", "object"),
            *AlignmentBatch.wire_schema("alignment_0_")])
"""


def test_fingerprint_is_stable_across_processes():
    ns = {}
    exec(SCHEMA_CODE, ns)
    out = subprocess.run([sys.executable, "-c", SCHEMA_CODE + "print(s.fingerprint())"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == ns["s"].fingerprint()


def test_schema_dict_survives_msgpack_and_pickle():
    ns = {}
    exec(SCHEMA_CODE, ns)
    s = ns["s"]
    back = Schema.from_dict(msgpack.unpackb(msgpack.packb(s.to_dict(), use_bin_type=True), raw=False))
    assert back == s and back.fingerprint() == s.fingerprint()
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(AttributeError): s._fields = ()


def test_field_spec_rules():
    with pytest.raises(SchemaError, match="'x'"): FieldSpec("x", "token", torch.uint8, pad_value=-1)
    with pytest.raises(SchemaError, match="no dtype"): FieldSpec("x", "object", dtype=torch.int64)
    assert FieldSpec("x", "token").group == "default"


# ---------------------------------------------------------------------------------------- random alignments
@st.composite
def alignments(draw):
    "A random valid padded AlignmentBatch with its per-row lengths (right padding, some unaligned -1 tokens)."
    B = draw(st.integers(0, 5))
    rows = []
    for _ in range(B):
        sizes = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(lambda t: t != (0, 0)), max_size=5))
        correct = [draw(st.booleans()) for _ in sizes]
        tail_s, tail_t = draw(st.integers(0, 2)), draw(st.integers(0, 2))  # real tokens with id -1 (chat mode)
        rows.append((sizes, correct, tail_s, tail_t))
    s_ids = [[c for c, (ns, _) in enumerate(sz) for _ in range(ns)] + [-1] * ts for sz, _, ts, _ in rows]
    t_ids = [[c for c, (_, nt) in enumerate(sz) for _ in range(nt)] + [-1] * tt for sz, _, _, tt in rows]
    T_s = max([len(r) for r in s_ids], default=0) + draw(st.integers(0, 3))
    T_t = max([len(r) for r in t_ids], default=0) + draw(st.integers(0, 3))
    P = max([len(sz) for sz, *_ in rows] + [1])

    def pad(seqs, width, fill):
        return torch.tensor([r + [fill] * (width - len(r)) for r in seqs] or [[fill] * width][:0], dtype=torch.int64).reshape(len(seqs), width)

    sid, tid = pad(s_ids, T_s, -1), pad(t_ids, T_t, -1)
    exact_chunk = [[ok and ns == 1 and nt == 1 for (ns, nt), ok in zip(sz, corr)] for sz, corr, *_ in rows]
    def mask_of(ids):
        return torch.tensor([[c >= 0 and exact_chunk[b][c] for c in row] for b, row in enumerate(ids.tolist())],
                            dtype=torch.bool).reshape(ids.shape)
    num = torch.tensor([len(sz) for sz, *_ in rows], dtype=torch.int64)
    batch = AlignmentBatch.from_padded(
        pair_valid=torch.arange(P)[None, :] < num[:, None],
        pair_is_correct=torch.tensor([corr + [False] * (P - len(corr)) for _, corr, *_ in rows], dtype=torch.bool).reshape(B, P),
        student_exact_partition_mask=mask_of(sid), teacher_exact_partition_mask=mask_of(tid),
        student_chunk_id=sid, teacher_chunk_id=tid, num_chunks=num)
    return batch, torch.tensor([len(r) for r in s_ids], dtype=torch.int64), torch.tensor([len(r) for r in t_ids], dtype=torch.int64)


def fields_equal(a: AlignmentBatch, b: AlignmentBatch) -> bool:
    return a.layout == b.layout and all(
        torch.equal(getattr(a, n).values(), getattr(b, n).values()) and torch.equal(getattr(a, n).offsets(), getattr(b, n).offsets())
        if is_jagged(getattr(a, n)) else torch.equal(getattr(a, n), getattr(b, n)) for n in AlignmentBatch.field_names())


@PROPERTY
@given(alignments())
def test_property_alignment_layouts_round_trip(case):
    padded, s_len, t_len = case
    padded.validate()
    jagged = padded.to_jagged(s_len, t_len)
    assert jagged.layout == "jagged" and jagged.validate() is jagged
    for axis in ("student", "teacher", "pairs"):
        names = AlignmentBatch.axis_fields(axis)
        assert getattr(jagged, names[0]).offsets() is getattr(jagged, names[1]).offsets()
    assert torch.equal(jagged.pair_valid.offsets().diff(), padded.num_chunks)
    T_s, T_t = padded.student_chunk_id.shape[1], padded.teacher_chunk_id.shape[1]
    assert fields_equal(jagged.to_padded(T_s, T_t), padded)
    natural = jagged.to_padded()
    assert natural.student_chunk_id.shape[1] == int(s_len.max()) if len(s_len) else natural.student_chunk_id.shape[1] == 0
    assert fields_equal(natural.to_padded(T_s, T_t), padded)
    assert fields_equal(pickle.loads(pickle.dumps(jagged)).to_padded(T_s, T_t), padded)
    assert padded.to_jagged(s_len, t_len).to_jagged(s_len, t_len) is not None


@PROPERTY
@given(alignments())
def test_property_left_padding_is_refused(case):
    padded, s_len, t_len = case
    T_s = padded.student_chunk_id.shape[1]
    if padded.batch_size[0] == 0 or T_s == 0: return
    shift = T_s - s_len  # move each student row to the right end: left padding
    left = padded.clone()
    for name in AlignmentBatch.axis_fields("student"):
        x = getattr(padded, name)
        setattr(left, name, torch.stack([torch.roll(row, int(k)) for row, k in zip(x, shift)]))
    left.validate()
    beyond = torch.arange(T_s)[None, :] >= s_len[:, None]
    if not bool((beyond & (left.student_chunk_id != -1)).any()): return  # nothing real moved past the lengths
    with pytest.raises(ValueError, match="right-padded"):
        left.to_jagged(s_len, t_len)
