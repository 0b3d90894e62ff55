"""The collator with real tokenizers: both forms and N teachers, configuration errors, text sources, the padded and
jagged layouts, the common cut, chat mode, `tokenize_padded`, and a property test over awkward texts (60 examples;
500 with `XTOKEN_DP_TEST_FLAGS=slow`).

DataLoader workers are in test_collate_workers.py.
"""
import os, pickle, sys, warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from tokenizer_support import BERT_MARKS, no_network, requires_bert, tok
from tokenizer_texts import POOLS, random_texts

from xtoken_dp.aligner import AlignmentBatch, TokenAligner
from xtoken_dp.batch import DataProto, DistillBatch
from xtoken_dp.codec import materialize
from xtoken_dp.collate import (CrossTokenizerCollator, TruncationWarning, pad_id_of, template_special_counts,
                               tokenize_padded)
from xtoken_dp.tokenizers import batch_token_byte_spans, load_tokenizer, tokenizer_fingerprint

LONG = ("The quick brown fox jumps over the lazy dog; 東京は晴れ 🙂 and 3.14159 digits, " * 6).strip()
TEXTS = ["Hello world", "", "def f(x):\n    return x ** 2  # 東京 🙂", LONG, "  \n\t ",
         "<s> </s> [INST] <|im_end|> <|endoftext|> [CLS] [UNK] <pad>"]


def aligner(s, t, **kw) -> TokenAligner: return TokenAligner(tok(s), tok(t), **kw)


def collator(student="mistral_spm", teachers=("qwen2",), ctx=16, teacher_ctx=24, **kw) -> CrossTokenizerCollator:
    "A collator over named tokenizers; a teacher named like the student is a same-vocab teacher (a fresh copy)."
    toks, als = [], []
    for t in teachers:
        if t == student: toks.append(load_tokenizer(student)); als.append(None)
        else: toks.append(tok(t)); als.append(aligner(student, t))
    return CrossTokenizerCollator(student_tokenizer=tok(student), teacher_tokenizers=toks, aligners=als,
                                  ctx_length_student=ctx, ctx_length_teachers=[teacher_ctx] * len(teachers), **kw)


def state(t) -> tuple:
    "Everything about a tokenizer that collation must leave alone."
    bk = t.backend_tokenizer
    return bk.to_str(), t.padding_side, t.pad_token, t.truncation_side, bk.encode_special_tokens, bk.truncation, bk.padding


def assert_same(a: dict, b: dict):
    assert list(a) == list(b), (list(a), list(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
        else: assert list(a[k]) == list(b[k]), k


# ---- keys, dtypes and lengths ----

def test_keys_dtypes_widths():
    c = CrossTokenizerCollator(student_tokenizer=tok("mistral_spm"), teacher_tokenizer=tok("qwen2"),
                               aligner=aligner("mistral_spm", "qwen2"), ctx_length_student=10, ctx_length_teacher=10,
                               make_seq_div_by_student=8, make_seq_div_by_teacher=4)
    out = c([{"text": t, "idx": i} for i, t in enumerate(TEXTS)])
    N = len(TEXTS)
    expected = {"input_ids": ((N, 16), torch.int64), "input_lengths": ((N,), torch.int64),
                "token_mask": ((N, 16), torch.bool), "sample_mask": ((N,), torch.float32), "idx": ((N,), torch.int64),
                "teacher_0_input_ids": ((N, 12), torch.int64), "teacher_0_input_lengths": ((N,), torch.int64),
                "teacher_0_token_mask": ((N, 12), torch.bool)}
    for k, (shape, dtype) in expected.items(): assert (tuple(out[k].shape), out[k].dtype) == (shape, dtype), k
    assert [k for k in out if k.startswith("alignment_0_")] == [f"alignment_0_{f}" for f in AlignmentBatch.field_names()]
    assert out["alignment_0_student_chunk_id"].shape == (N, 16) and out["alignment_0_teacher_chunk_id"].shape == (N, 12)
    assert torch.equal(out["input_lengths"], out["token_mask"].sum(1))
    assert torch.equal(out["teacher_0_input_lengths"], out["teacher_0_token_mask"].sum(1))
    assert (out["input_lengths"] <= 10).all() and (out["teacher_0_input_lengths"] <= 10).all()
    AlignmentBatch.from_flat(out, prefix="alignment_0_").validate()
    assert out["idx"].tolist() == list(range(N))
    assert c.teacher_layout == (True,)


def test_pad_to_longest_and_divisors():
    c = collator(ctx=64, teacher_ctx=64, pad_to="longest", make_seq_div_by_student=8, make_seq_div_by_teachers=[5])
    out = c([{"text": "Hello world"}, {"text": "a b c d e f"}])
    longest = int(out["input_lengths"].max())
    assert out["input_ids"].shape[1] == -(-longest // 8) * 8
    assert out["teacher_0_input_ids"].shape[1] % 5 == 0 and out["teacher_0_input_ids"].shape[1] - int(out["teacher_0_input_lengths"].max()) < 5


# ---- pad == eos; empty text ----

def test_pad_is_eos_for_mistral_spm():
    c = collator(ctx=12)
    out = c([{"text": "Hi"}])
    n = int(out["input_lengths"][0])
    assert pad_id_of(tok("mistral_spm")) == 2 and tok("mistral_spm").pad_token is None
    assert (out["input_ids"][0, n:] == 2).all()
    assert (out["alignment_0_student_chunk_id"][0, n:] == -1).all() and not out["token_mask"][0, n:].any()
    assert not out["alignment_0_student_exact_partition_mask"][0, n:].any()
    assert (out["teacher_0_input_ids"][0, int(out["teacher_0_input_lengths"][0]):] == 151643).all()


def test_empty_text_masks_sample_both_layouts():
    for output in ("padded", "jagged"):
        c = collator(output=output)
        out = c([{"text": ""}, {"text": "x"}])
        assert out["sample_mask"].tolist() == [0.0, 1.0]
        assert out["teacher_0_input_lengths"].tolist()[0] == 0 and out["input_lengths"].tolist()[0] == 1  # BOS only
        assert out["alignment_0_num_chunks"][0] >= 1
        assert c.last_stats.zero_token_samples.tolist() == [True, False]
        flat = out if output == "padded" else c.materialize(out)
        AlignmentBatch.from_flat(flat, prefix="alignment_0_").validate()
        DistillBatch.from_flat(out, teacher_layout=c.teacher_layout).validate()


def test_loss_multiplier_passes_through():
    out = collator()([{"text": "a", "loss_multiplier": 0}, {"text": "b", "loss_multiplier": torch.tensor(1.0)},
                      {"text": "c"}])
    assert out["sample_mask"].tolist() == [0.0, 1.0, 1.0]


# ---- one common cut for the student and every cross teacher ----

def _cuts(sp, L):
    ok = np.ones(L + 1, bool)
    c = (sp.role == 0) & (sp.end > sp.start)
    for s, e in zip(sp.start[c].tolist(), sp.end[c].tolist()): ok[s + 1:e] = False
    return ok


def test_common_cut_with_two_teachers_is_the_largest():
    budgets = [16, 64, 20]
    c = CrossTokenizerCollator(student_tokenizer=tok("mistral_spm"), teacher_tokenizers=[tok("qwen2"), tok("mistral_tekken")],
                               aligners=[aligner("mistral_spm", "qwen2"), aligner("mistral_spm", "mistral_tekken")],
                               ctx_length_student=16, ctx_length_teachers=[64, 20], emit_dropped_bytes=True)
    texts = [LONG, "x" * 3 + " 東京は晴れ" * 8, "Hello world"]
    out = c([{"text": t} for t in texts])
    names = ["mistral_spm", "qwen2", "mistral_tekken"]
    for b, text in enumerate(texts):
        nbytes = len(text.encode())
        L = nbytes - int(out["dropped_bytes"][b])
        spans = [batch_token_byte_spans(tok(n), [text])[0] for n in names]
        lengths = [int(out["input_lengths"][b]), int(out["teacher_0_input_lengths"][b]), int(out["teacher_1_input_lengths"][b])]
        for sp, n_kept in zip(spans, lengths):
            assert n_kept == int((sp.end <= L).sum()) if L < nbytes else n_kept == len(sp.ids)
        best, cuts = 0, [_cuts(sp, nbytes) for sp in spans]
        for p in range(nbytes + 1):  # brute force: the largest common cut within every budget
            if all(cut[p] for cut in cuts) and all(
                    int(((sp.role == 0) & (sp.end <= p)).sum()) + int((sp.role[:1] != 0).sum()) <= bud
                    for sp, bud in zip(spans, budgets)):
                best = p
        expected = nbytes if all(len(sp.ids) <= bud for sp, bud in zip(spans, budgets)) else best
        assert L == expected, (b, L, expected)
        assert int(out["dropped_bytes"][b]) == nbytes - L
        if L < nbytes:  # no one-sided tail: every side's last kept token sits in the same two-sided chunk
            for i in (0, 1):
                last_t = int(out[f"alignment_{i}_teacher_chunk_id"][b, lengths[1 + i] - 1])
                last_s = int(out[f"alignment_{i}_student_chunk_id"][b, lengths[0] - 1])
                assert last_s == last_t == int(out[f"alignment_{i}_num_chunks"][b]) - 1, (b, i)
    assert np.array_equal(c.last_stats.dropped_bytes, out["dropped_bytes"].numpy())


# ---- N teachers, same-vocab teachers, mismatches ----

def test_two_cross_one_same_vocab_teacher():
    c = collator(teachers=("qwen2", "mistral_spm", "mistral_tekken"), ctx=160, teacher_ctx=160)
    assert c.teacher_layout == (True, False, True)
    out = c([{"text": t} for t in TEXTS])
    assert not any(k.startswith(("teacher_1_", "alignment_1_")) for k in out)
    assert {k for k in out if k.startswith("teacher_")} == {f"teacher_{i}_{f}" for i in (0, 2)
                                                             for f in ("input_ids", "input_lengths", "token_mask")}
    db = DistillBatch.from_flat(out, teacher_layout=c.teacher_layout).validate()
    assert db.teacher(1).alignment is None and db.teacher(0).alignment is not None
    assert c.last_stats.teachers[1] is None and c.last_stats.teachers[0].samples == len(TEXTS)
    single = collator(teachers=("qwen2",), ctx=160, teacher_ctx=160)([{"text": t} for t in TEXTS])
    for k, v in single.items(): assert torch.equal(out[k], v), k  # nothing is cut: teacher 0 does not see the others


def test_same_vocab_budget_caps_the_student():
    same = load_tokenizer("mistral_spm")
    c = CrossTokenizerCollator(student_tokenizer=tok("mistral_spm"), teacher_tokenizers=[tok("qwen2"), same],
                               aligners=[aligner("mistral_spm", "qwen2"), None], ctx_length_student=64,
                               ctx_length_teachers=[64, 10])
    out = c([{"text": LONG}])
    assert int(out["input_lengths"][0]) <= 10 and out["input_ids"].shape[1] == 64


def test_mismatches_raise():
    spm, qwen, tekken = tok("mistral_spm"), tok("qwen2"), tok("mistral_tekken")
    base = dict(student_tokenizer=spm, ctx_length_student=16)
    with pytest.raises(ValueError, match=r"aligners\[1\] was built for the teacher tokenizer .*151646 ids\), got the teacher tokenizer .*131072 ids"):
        CrossTokenizerCollator(**base, teacher_tokenizers=[qwen, tekken], aligners=[aligner("mistral_spm", "qwen2")] * 2,
                               ctx_length_teachers=[16, 16])
    with pytest.raises(ValueError, match=r"aligners\[0\] was built for the student tokenizer .*131072 ids\), got the student tokenizer .*32000 ids"):
        CrossTokenizerCollator(**base, teacher_tokenizers=[qwen], aligners=[aligner("mistral_tekken", "qwen2")],
                               ctx_length_teachers=[16])
    with pytest.raises(ValueError, match=r"teacher_tokenizers\[2\] is marked same-vocab"):
        CrossTokenizerCollator(**base, teacher_tokenizers=[qwen, spm, tekken],
                               aligners=[aligner("mistral_spm", "qwen2"), None, None], ctx_length_teachers=[16, 16, 16])
    with pytest.raises(ValueError, match=r"ctx_length_teachers must hold one entry per teacher \(len\(teacher_tokenizers\) = 2\), got 1"):
        CrossTokenizerCollator(**base, teacher_tokenizers=[qwen, tekken],
                               aligners=[aligner("mistral_spm", "qwen2"), aligner("mistral_spm", "mistral_tekken")],
                               ctx_length_teachers=[16])
    with pytest.raises(ValueError, match="either the single-teacher arguments or the list"):
        CrossTokenizerCollator(**base, teacher_tokenizer=qwen, aligner=aligner("mistral_spm", "qwen2"),
                               ctx_length_teacher=16, aligners=[None])
    with pytest.raises(ValueError, match=r"ctx_length_teachers\[0\]: expected an int >= 1 for a cross-tokenizer teacher, got None"):
        CrossTokenizerCollator(**base, teacher_tokenizers=[qwen], aligners=[aligner("mistral_spm", "qwen2")])
    with pytest.raises(ValueError, match=r"ctx_length_teacher: expected an int > 1 \(the 1 template special"):
        CrossTokenizerCollator(**base, teacher_tokenizer=tekken, aligner=aligner("mistral_spm", "mistral_tekken"),
                               ctx_length_teacher=1)
    with pytest.raises(TypeError, match=r"aligners\[0\] must be a TokenAligner or None"):
        CrossTokenizerCollator(**base, teacher_tokenizers=[qwen], aligners=["aligner"], ctx_length_teachers=[16])
    with pytest.raises(ValueError, match="output must be 'padded' or 'jagged'"):
        CrossTokenizerCollator(**base, teacher_tokenizer=qwen, aligner=aligner("mistral_spm", "qwen2"),
                               ctx_length_teacher=16, output="ragged")
    with pytest.raises(ValueError, match="pad_to must be 'ctx' or 'longest'"):
        CrossTokenizerCollator(**base, teacher_tokenizer=qwen, aligner=aligner("mistral_spm", "qwen2"),
                               ctx_length_teacher=16, pad_to="max")
    with pytest.raises(TypeError, match="keep_text: expected a bool, got str 'yes'"):
        CrossTokenizerCollator(**base, teacher_tokenizer=qwen, aligner=aligner("mistral_spm", "qwen2"),
                               ctx_length_teacher=16, keep_text="yes")
    with pytest.raises(ValueError, match=r"make_seq_div_by_teachers\[0\]: expected an int >= 1, got 0"):
        CrossTokenizerCollator(**base, teacher_tokenizers=[qwen], aligners=[aligner("mistral_spm", "qwen2")],
                               ctx_length_teachers=[16], make_seq_div_by_teachers=[0])
    with pytest.raises(TypeError, match="ctx_length_student: expected an int >= 1, got float 16.0"):
        CrossTokenizerCollator(student_tokenizer=spm, ctx_length_student=16.0, teacher_tokenizer=qwen,
                               aligner=aligner("mistral_spm", "qwen2"), ctx_length_teacher=16)


def test_no_pad_id_is_refused():
    t = load_tokenizer("mistral_spm")
    t.eos_token = None  # a private copy
    with pytest.raises(ValueError, match="student_tokenizer has no pad id"):
        CrossTokenizerCollator(student_tokenizer=t, teacher_tokenizer=tok("qwen2"), aligner=TokenAligner(t, tok("qwen2")),
                               ctx_length_student=8, ctx_length_teacher=8)


@pytest.mark.parametrize("name", ["qwen2", "mistral_tekken", "mistral_spm", "bpe_bytelevel", "unigram_metaspace",
                                  "wordpiece_toy", pytest.param("bert_uncased", marks=BERT_MARKS)])
def test_template_counts_match_the_aligner(name):
    from xtoken_dp.aligner import template_specials
    assert template_special_counts(tok(name)) == template_specials(tok(name))


# ---- text sources ----

def test_text_sources():
    c = collator()
    a = c([{"text": "Hello world"}])
    b = c([{"message_log": [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "ignored"}]}])
    assert_same(a, b)
    with pytest.raises(ValueError, match=r"batch\[1\] has no text: expected a 'text' key or a 'message_log' list, got keys \['content', 'idx'\]"):
        c([{"text": "a"}, {"content": "b", "idx": 1}])
    with pytest.raises(TypeError, match=r"batch\[0\]\['text'\] must be a str, got bytes"):
        c([{"text": b"bytes"}])
    with pytest.raises(TypeError, match=r"batch\[0\]\['message_log'\]\[0\]\['content'\] must be a str, got NoneType"):
        c([{"message_log": [{"role": "user", "content": None}]}])
    with pytest.raises(ValueError, match=r"message_log'\] must be a non-empty list"):
        c([{"message_log": []}])
    with pytest.raises(ValueError, match="idx must be given by every datum or by none"):
        c([{"text": "a", "idx": 0}, {"text": "b"}])
    with pytest.raises(TypeError, match="batch must be a list of dicts"):
        c({"text": "a"})


@pytest.mark.parametrize("output", ["padded", "jagged"])
@pytest.mark.parametrize("bad", ["caf\udce9", "\ud800", "ok \udfff end"])
def test_text_without_utf8_is_named_by_datum(output, bad):
    from xtoken_dp.tokenizers import InvalidTextError
    c = collator(teachers=("qwen2", "mistral_spm", "mistral_tekken"), output=output)
    for batch, where in (([{"text": "a"}, {"text": bad}], r"batch\[1\]\['text'\]"),
                         ([{"text": "a"}, {"text": "b"}, {"message_log": [{"role": "user", "content": bad}]}],
                          r"batch\[2\]\['message_log'\]\[0\]\['content'\]")):
        with pytest.raises(InvalidTextError, match=rf"^{where}: not valid Unicode: character \d+ is the lone surrogate "
                                                   rf"U\+D[89A-F]") as info:
            c(batch)
        assert isinstance(info.value, ValueError) and info.value.__suppress_context__
        assert "TextEncodeInput" not in str(info.value)
    assert c([{"text": "a"}, {"text": "b"}])["input_lengths"].shape == (2,)   # the collator is still usable


def test_chat_text_without_utf8_is_named_by_message():
    c = CrossTokenizerCollator(student_tokenizer=tok("qwen2"), teacher_tokenizer=tok("mistral_spm"),
                               aligner=aligner("qwen2", "mistral_spm"), ctx_length_student=64, ctx_length_teacher=64,
                               chat=True)
    log = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bad \udcff"}]
    with pytest.raises(ValueError, match=r"^batch\[1\]\['message_log'\]\[1\]\['content'\]: not valid Unicode: character 4"):
        c([{"message_log": log[:1] + [{"role": "assistant", "content": "ok"}]}, {"message_log": log}])


# ---- materialize(jagged) == padded; tokenizers unchanged ----

@pytest.mark.parametrize("teachers", [("qwen2",), ("qwen2", "mistral_spm", "mistral_tekken")], ids=["one", "three"])
@pytest.mark.parametrize("pad_to", ["ctx", "longest"])
def test_materialize_equals_padded(teachers, pad_to):
    kw = dict(teachers=teachers, ctx=20, teacher_ctx=24, pad_to=pad_to, make_seq_div_by_student=8, emit_dropped_bytes=True)
    batch = [{"text": t, "idx": 10 + i, "loss_multiplier": float(i % 2)} for i, t in enumerate(TEXTS + random_texts(6, seed=3))]
    padded = collator(**kw)(batch)
    jc = collator(**kw, output="jagged", keep_text=True)
    wire = jc(batch)
    jc.schema().validate(wire)
    back = jc.materialize(wire)
    assert list(back) == list(padded) + ["text"]
    assert isinstance(back["text"], np.ndarray) and back["text"].dtype == object and back["text"].shape == (len(batch),)
    assert list(back["text"]) == [d["text"] for d in batch]
    del back["text"]
    assert_same(back, padded)
    for group, keys in jc.schema().groups().items():  # one offsets object per group
        assert len({id(wire.get(k).offsets()) for k in keys}) == 1, group
    natural = dict(kw, pad_to="longest", make_seq_div_by_student=1)
    flat = collator(**natural)(batch)
    nc = collator(**natural, output="jagged")
    assert_same(materialize(nc(batch), schema=nc.schema()), flat)  # the codec alone, at natural widths
    a = DistillBatch.from_flat(padded, teacher_layout=jc.teacher_layout).validate()
    b = DistillBatch.from_flat(wire, teacher_layout=jc.teacher_layout).validate()
    assert_same(a.to_flat(), b.to_flat())
    proto = DataProto.from_wire(wire, schema=jc.schema())
    assert list(proto.non_tensor_batch) == ["text"] and "text" not in proto.batch.keys()


def test_tokenizers_unchanged_after_collation():
    names = ["mistral_spm", "qwen2", "mistral_tekken", "bpe_bytelevel"]
    before = {n: state(tok(n)) for n in names}
    for output in ("padded", "jagged"):
        c = collator(teachers=("qwen2", "mistral_tekken", "bpe_bytelevel"), output=output)
        c([{"text": t} for t in TEXTS])
        with pytest.warns(TruncationWarning): c._tokenize_batch(TEXTS, tok("qwen2"), 8, 4)
    c = CrossTokenizerCollator(student_tokenizer=tok("qwen2"), teacher_tokenizer=tok("mistral_tekken"),
                               aligner=aligner("qwen2", "mistral_tekken"), ctx_length_student=32, ctx_length_teacher=32,
                               chat=True)
    c([{"message_log": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|im_end|> ok"}]}])
    assert {n: state(tok(n)) for n in names} == before


def test_empty_batch_both_layouts():
    c = collator(teachers=("qwen2", "mistral_spm"), emit_dropped_bytes=True)
    out = c([])
    assert out["input_ids"].shape == (0, 16) and out["teacher_0_input_ids"].shape == (0, 24)
    assert out["alignment_0_pair_valid"].shape == (0, 1) and out["sample_mask"].shape == (0,)
    jc = collator(teachers=("qwen2",), output="jagged", keep_text=True)
    wire = jc([])
    assert wire.batch_size == torch.Size([0]) and jc.materialize(wire)["input_ids"].shape == (0, 16)


def test_random_batches_are_well_formed():
    c = collator(teachers=("qwen2", "mistral_tekken"), ctx=48, teacher_ctx=40, output="jagged")
    for seed in range(4):
        texts = random_texts(8, seed=seed)
        wire = c([{"text": t} for t in texts])
        flat = c.materialize(wire)
        for i in (0, 1): AlignmentBatch.from_flat(flat, prefix=f"alignment_{i}_").validate()
        DistillBatch.from_flat(wire, teacher_layout=c.teacher_layout).validate()
        assert torch.equal(flat["sample_mask"] == 0, torch.from_numpy(c.last_stats.zero_token_samples))


def test_outputs_do_not_depend_on_batch_composition():
    c = collator(teachers=("qwen2", "mistral_tekken"), ctx=24, teacher_ctx=24, pad_to="ctx")
    whole = c([{"text": t} for t in TEXTS])
    for b, t in enumerate(TEXTS):
        one = c([{"text": t}])
        for k, v in one.items():
            if k.endswith(("pair_valid", "pair_is_correct")):  # P depends on the batch: compare the used slots
                P = v.shape[1]
                assert torch.equal(v[0], whole[k][b][:P]) and not whole[k][b][P:].any(), k
            else: assert torch.equal(v[0], whole[k][b]), k


# ---- tokenize_padded, the reference collator's _tokenize_batch ----

def test_tokenize_batch_seed_semantics():
    ids, mask = CrossTokenizerCollator._tokenize_batch(["Hello world", ""], tok("mistral_spm"), 10, 8)
    assert ids.shape == mask.shape == (2, 16) and ids.dtype == mask.dtype == torch.int64
    assert mask.sum(1).tolist() == [3, 1] and (ids[mask == 0] == 2).all()
    with pytest.warns(TruncationWarning, match="^truncated 1 of 2 rows to ctx_length=3") as caught:
        ids, mask = tokenize_padded(["one two three four", "hi"], tok("mistral_spm"), 3)
    assert "_tokenize_batch" not in str(caught[0].message)
    assert ids[0].tolist() == tok("mistral_spm")("one two")["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenize_padded(["hi"], tok("qwen2"), 4, 1)  # nothing cut: no warning
    with pytest.raises(ValueError, match=r"^ctx_length: expected an int > 1 \(the 1 template special token\(s\) of tokenizer"):
        tokenize_padded(["hi"], tok("mistral_spm"), 1)
    with pytest.raises(TypeError, match="^make_seq_div_by: expected an int >= 1, got float"):
        tokenize_padded(["hi"], tok("mistral_spm"), 4, 2.0)
    with pytest.raises(ValueError, match=r"^texts\[1\]: not valid Unicode"):
        tokenize_padded(["hi", "\udcff"], tok("mistral_spm"), 4)


@requires_bert
def test_tokenize_batch_keeps_trailing_specials():
    bert = tok("bert_uncased")
    with pytest.warns(TruncationWarning):
        ids, mask = tokenize_padded(["one two three four five"], bert, 4)
    assert ids[0].tolist() == [101] + bert("one two")["input_ids"][1:3] + [102]


# ---- pickling, stats ----

def test_pickle_round_trip_and_stats():
    c = collator(teachers=("qwen2", "mistral_tekken"), emit_dropped_bytes=True)
    batch = [{"text": t} for t in TEXTS]
    out = c(batch)
    assert c.last_stats is not None and set(c.last_stats.seconds) == {"read", "tokenize", "truncate", "align", "stats", "pack"}
    clone = pickle.loads(pickle.dumps(c))
    assert clone.last_stats is None
    assert_same(clone(batch), out)
    assert tokenizer_fingerprint(clone.student_tokenizer) == tokenizer_fingerprint(tok("mistral_spm"))


# ---- chat mode ----

def _chat_collator(student, teacher, **kw):
    return CrossTokenizerCollator(student_tokenizer=tok(student), teacher_tokenizer=tok(teacher),
                                  aligner=aligner(student, teacher), ctx_length_student=kw.pop("ctx", 96),
                                  ctx_length_teacher=kw.pop("teacher_ctx", 96), chat=True, **kw)


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say <|im_end|> please"},
                {"role": "assistant", "content": "Sure: <|im_end|> — 東京 🙂"}, {"role": "user", "content": "Again"},
                {"role": "assistant", "content": "<|im_end|> again."}]


@pytest.mark.parametrize("teacher", ["mistral_spm", "mistral_tekken"])
def test_chat_only_assistant_tokens_are_aligned(teacher):
    c = _chat_collator("qwen2", teacher)
    out = c([{"message_log": CONVERSATION}])
    q = tok("qwen2")
    ids, chunk = out["input_ids"][0], out["alignment_0_student_chunk_id"][0]
    n = int(out["input_lengths"][0])
    rendered = q.apply_chat_template(CONVERSATION, tokenize=False)
    assert q.decode(ids[:n]) == rendered  # concatenated pieces spell the rendering
    assert q.decode(ids[chunk >= 0]) == "Sure: <|im_end|> — 東京 🙂<|im_end|><|im_end|> again.<|im_end|>"
    assert int((ids[chunk >= 0] == 151645).sum()) == 2  # only the two closing markers are the special id
    assert torch.equal(out["token_mask"][0], chunk >= 0)
    t_chunk, t_ids = out["alignment_0_teacher_chunk_id"][0], out["teacher_0_input_ids"][0]
    assert int((t_ids[t_chunk >= 0] == 2).sum()) == 2  # the teacher's closing </s>, paired with <|im_end|>
    al = AlignmentBatch.from_flat(out, prefix="alignment_0_").validate()
    assert al.pair_is_correct[0, :int(al.num_chunks[0])].float().mean() > 0.8
    jc = _chat_collator("qwen2", teacher, output="jagged", keep_text=True)
    wire = jc([{"message_log": CONVERSATION}])
    back = jc.materialize(wire)
    assert back["text"][0] == rendered
    del back["text"]
    assert_same(back, out)


def test_chat_dropped_bytes():
    for student, teacher in (("qwen2", "mistral_tekken"), ("mistral_spm", "qwen2")):
        full = _chat_collator(student, teacher, emit_dropped_bytes=True)([{"message_log": CONVERSATION}])
        assert full["dropped_bytes"].tolist() == [0]
        n = int(full["input_lengths"][0])
        cut = _chat_collator(student, teacher, ctx=n - 4, emit_dropped_bytes=True)([{"message_log": CONVERSATION}])
        rendered = tok(student).apply_chat_template(CONVERSATION, tokenize=False).encode()
        dropped = int(cut["dropped_bytes"][0])
        assert 0 < dropped < len(rendered) and rendered.endswith(b" again.</s>" if student == "mistral_spm" else b"<|im_end|>\n")


def test_chat_truncation_and_prompt_overflow():
    full = _chat_collator("qwen2", "mistral_tekken")([{"message_log": CONVERSATION}])
    n_full = int(full["input_lengths"][0])
    cut = _chat_collator("qwen2", "mistral_tekken", ctx=n_full - 3)([{"message_log": CONVERSATION}])
    n = int(cut["input_lengths"][0])
    assert n <= n_full - 3 and cut["sample_mask"][0] == 1
    assert torch.equal(cut["input_ids"][0, :n], full["input_ids"][0, :n])
    assert cut["alignment_0_student_chunk_id"][0, n - 1] >= 0  # the cut falls inside the last assistant message
    AlignmentBatch.from_flat(cut, prefix="alignment_0_").validate()
    tiny = _chat_collator("qwen2", "mistral_tekken", ctx=6)([{"message_log": CONVERSATION}])
    assert tiny["sample_mask"].tolist() == [0.0] and tiny["alignment_0_num_chunks"].tolist() == [0]
    assert int(tiny["input_lengths"][0]) == 6


def test_chat_errors():
    with pytest.raises(ValueError, match="chat=True needs a chat template on every tokenized side: teacher_tokenizer"):
        CrossTokenizerCollator(student_tokenizer=tok("qwen2"), teacher_tokenizer=tok("bpe_bytelevel"),
                               aligner=aligner("qwen2", "bpe_bytelevel"), ctx_length_student=8, ctx_length_teacher=8,
                               chat=True)
    c = _chat_collator("qwen2", "mistral_spm")
    with pytest.raises(ValueError, match=r"batch\[0\], teacher_tokenizer: its chat template cannot render"):
        c([{"message_log": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"batch\[0\]: chat=True needs a 'message_log'"):
        c([{"text": "x"}])


# ---- property: any batch of awkward texts collates into well-formed, layout-independent batches ----

EXAMPLES = 500 if "slow" in os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split() else 60
PIECES = st.sampled_from([p for pool in POOLS for p in pool] + [" ", "  ", "\n"])
TEXT = st.lists(PIECES, max_size=30).map("".join)
PROPERTY_PADDED = collator(teachers=("qwen2", "mistral_spm", "mistral_tekken"), ctx=24, teacher_ctx=20, pad_to="ctx",
                           make_seq_div_by_student=8, emit_dropped_bytes=True)
PROPERTY_JAGGED = collator(teachers=("qwen2", "mistral_spm", "mistral_tekken"), ctx=24, teacher_ctx=20, pad_to="ctx",
                           make_seq_div_by_student=8, emit_dropped_bytes=True, output="jagged", keep_text=True)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(TEXT, min_size=1, max_size=5))
def test_property_layouts_agree_and_validate(texts):
    batch = [{"text": t} for t in texts]
    padded, wire = PROPERTY_PADDED(batch), PROPERTY_JAGGED(batch)
    back = PROPERTY_JAGGED.materialize(wire)
    assert list(back.pop("text")) == texts
    assert_same(back, padded)
    assert (padded["input_lengths"] <= 24).all() and (padded["teacher_0_input_lengths"] <= 20).all()
    zero = (padded["input_lengths"] == 0) | (padded["teacher_0_input_lengths"] == 0) | (padded["teacher_2_input_lengths"] == 0)
    assert torch.equal(padded["sample_mask"] == 0, zero)
    for i in (0, 2): AlignmentBatch.from_flat(padded, prefix=f"alignment_{i}_").validate()
    assert (padded["dropped_bytes"] >= 0).all()
    DistillBatch.from_flat(wire, teacher_layout=PROPERTY_JAGGED.teacher_layout).validate()


def test_only_same_vocab_or_no_teachers():
    for teachers in ((), ("mistral_spm",)):
        for output in ("padded", "jagged"):
            c = collator(teachers=teachers, output=output)
            out = c([{"text": t} for t in TEXTS])
            keys = list(out.keys())
            assert keys == ["input_ids", "input_lengths", "token_mask", "sample_mask"], keys
            assert c.teacher_layout == (False,) * len(teachers)
            db = DistillBatch.from_flat(out, teacher_layout=c.teacher_layout).validate()
            assert db.num_teachers == len(teachers)


# ---- the losses read the collator's numbered keys (spec README "Key names") ----

def test_losses_read_collator_keys_in_both_layouts():
    from xtoken_dp.losses import alignment_from_flat_batch
    kw = dict(teachers=("qwen2", "mistral_spm", "mistral_tekken"), ctx=24, teacher_ctx=24, pad_to="longest")
    batch = [{"text": t} for t in TEXTS]
    flat, jc = collator(**kw)(batch), collator(**kw, output="jagged")
    wire = jc(batch)
    for i in (0, 2):
        prefix = f"alignment_{i}_"
        expected = {k.removeprefix(prefix): v for k, v in flat.items() if k.startswith(prefix)}
        for source in (flat, wire):
            got = alignment_from_flat_batch(source, prefix=prefix).validate()
            for name in AlignmentBatch.field_names(): assert torch.equal(getattr(got, name), expected[name]), (i, name)
    with pytest.raises(KeyError, match="missing key 'alignment_1_pair_valid'"):  # the same-vocab teacher wrote nothing
        alignment_from_flat_batch(flat, prefix="alignment_1_")


def test_the_common_cut_never_separates_a_letter_from_its_combining_mark():
    "qwen2 normalises e + U+0301 to é: wherever the budgets cut, the kept text ends on a whole normalised stretch."
    import unicodedata
    from xtoken_dp.tokenizers import load_tokenizer
    student, teacher = load_tokenizer("qwen2"), load_tokenizer("mistral_spm")
    text = "Cafe\u0301 cre\u0300me bru\u0302le\u0301e, the\u0301 a\u0300 la menthe, re\u0301sume\u0301 nai\u0308ve " * 3
    data = text.encode()
    for budget in range(4, 40, 3):
        collate = CrossTokenizerCollator(student_tokenizer=student, teacher_tokenizer=teacher,
                                         aligner=TokenAligner(student, teacher), ctx_length_student=budget,
                                         ctx_length_teacher=budget, emit_dropped_bytes=True)
        kept = len(data) - int(collate([{"text": text}])["dropped_bytes"][0])
        following = data[kept:].decode()[:1]
        assert not following or unicodedata.combining(following) == 0, (budget, kept, repr(data[:kept].decode()[-3:]))
