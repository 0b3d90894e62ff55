"""Per-token fields whose rows disagree are refused; fields whose rows agree share one offsets object.

Every class with jagged fields compares the offsets of fields that must have the same rows (their values, O(N) over
rows), not only their shapes or token totals: rows of 3, 10, 1 and 6 tokens are not rows of 3, 9, 2 and 6, though
both hold 20. The error names both fields and the first row that differs. The check reads offsets only, never a values
buffer: fields of 10^12 tokens over one broadcast element construct at once, and so do fields on the meta device.
(A `DataProto` makes its values contiguous by design, the wire layout, so it is shown on the meta device only.)
"""
import time

import pytest
import torch
from tensordict import TensorDict

from xtoken_dp.batch import DataProto, DistillBatch, LengthsError, RewardData, TeacherSeq, TokenSeq
from xtoken_dp.schema import AlignmentBatch, FieldSpec, Schema, lengths_to_offsets, make_jagged

ROWS, OTHER_ROWS = [3, 10, 1, 6], [3, 9, 2, 6]  # the same 20 tokens, other rows (row 1 is the first that differs)


def jagged(lengths, dtype=torch.int64, trailing=()):
    "A jagged tensor with rows of `lengths` (zeros: the values do not matter here)."
    offsets = lengths_to_offsets(torch.tensor(lengths))
    return make_jagged(torch.zeros(int(offsets[-1]), *trailing, dtype=dtype), offsets)


def flat_batch(s_len, t_len, nc):
    "A padded collator-style flat batch with one cross-tokenizer teacher (top-k K=2)."
    n, S, T, P = len(s_len), max(s_len), max(t_len), max(nc)
    s_len, t_len, nc = torch.tensor(s_len), torch.tensor(t_len), torch.tensor(nc)
    def chunk_ids(lengths, width):
        pos = torch.arange(width)[None, :]
        return torch.where(pos < lengths[:, None], (pos * nc[:, None]) // lengths[:, None].clamp(min=1), -1)
    s_cid, t_cid = chunk_ids(s_len, S), chunk_ids(t_len, T)
    valid = torch.arange(P) < nc[:, None]
    return {"input_ids": torch.arange(n * S).reshape(n, S), "input_lengths": s_len, "token_mask": torch.arange(S) < s_len[:, None],
            "sample_mask": torch.ones(n), "teacher_0_input_ids": torch.arange(n * T).reshape(n, T),
            "teacher_0_input_lengths": t_len, "teacher_0_token_mask": torch.arange(T) < t_len[:, None],
            "teacher_0_topk_ids": torch.zeros(n, T, 2, dtype=torch.int32), "teacher_0_topk_logprobs": torch.zeros(n, T, 2),
            "alignment_0_pair_valid": valid, "alignment_0_pair_is_correct": valid,
            "alignment_0_student_exact_partition_mask": s_cid == 0, "alignment_0_teacher_exact_partition_mask": t_cid == 0,
            "alignment_0_student_chunk_id": s_cid, "alignment_0_teacher_chunk_id": t_cid, "alignment_0_num_chunks": nc}


def distill_batch():
    return DistillBatch.from_flat(flat_batch([3, 10, 1, 6], [2, 5, 1, 4], [1, 2, 1, 3]), teacher_layout=(True,))


def alignment_with(alignment, **fields):
    return AlignmentBatch(**{**{n: getattr(alignment, n) for n in AlignmentBatch.field_names()}, **fields},
                          batch_size=alignment.batch_size)


def refused(fn, *words):
    with pytest.raises(ValueError) as info: fn()
    for w in words: assert w in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------------- one per class
def test_reward_data_refuses_equal_totals_in_other_rows_and_shares_equal_rows():
    ids = jagged(ROWS)
    refused(lambda: RewardData(ids, jagged(OTHER_ROWS, torch.bool), batch_size=[4]),
            "attention_mask", "input_ids", "row 1 has 9 values in attention_mask, 10 values in input_ids")
    refused(lambda: RewardData(ids, jagged(ROWS, torch.bool), rewards=jagged(OTHER_ROWS, torch.float32), batch_size=[4]),
            "rewards", "row 1")
    rd = RewardData(ids, jagged(ROWS, torch.bool), rewards=jagged(ROWS, torch.float32), batch_size=[4])
    assert rd.attention_mask.offsets() is rd.input_ids.offsets() is rd.rewards.offsets()
    for picked in (rd[torch.tensor([3, 1, 1])], rd[1:3], torch.cat([rd, rd])):  # tensordict's ops, checked again
        assert picked.attention_mask.offsets() is picked.input_ids.offsets() is picked.rewards.offsets()


def test_token_seq_refuses_a_mask_in_other_rows():
    refused(lambda: TokenSeq(jagged(ROWS), jagged(OTHER_ROWS, torch.bool), torch.tensor(ROWS), batch_size=[4]),
            "TokenSeq.token_mask", "input_ids", "row 1")
    ts = TokenSeq(jagged(ROWS), jagged(ROWS, torch.bool), torch.tensor(ROWS), batch_size=[4])
    assert ts.token_mask.offsets() is ts.offsets
    picked = ts[torch.tensor([2, 0])]
    assert picked.token_mask.offsets() is picked.offsets


def test_teacher_seq_refuses_top_k_and_alignment_fields_in_other_rows():
    teacher = distill_batch().teacher(0)
    t_rows = teacher.tokens.offsets.diff().tolist()  # [2, 5, 1, 4]: 12 tokens
    moved = [t_rows[0] + 1, t_rows[1] - 1, *t_rows[2:]]  # 12 tokens, other rows
    refused(lambda: TeacherSeq(teacher.tokens, teacher.alignment, jagged(moved, torch.int32, (2,)), batch_size=[4]),
            "TeacherSeq.topk_ids", "tokens.input_ids", "row 0")
    refused(lambda: TeacherSeq(teacher.tokens, teacher.alignment, teacher.topk_ids, jagged(moved, torch.float32, (2,)),
                               batch_size=[4]), "TeacherSeq.topk_logprobs", "row 0")
    bad = alignment_with(teacher.alignment, teacher_chunk_id=jagged(moved), teacher_exact_partition_mask=jagged(moved, torch.bool))
    refused(lambda: TeacherSeq(teacher.tokens, bad, batch_size=[4]), "alignment.teacher_", "row 0")
    pairs = teacher.alignment.pair_valid.offsets().diff().tolist()  # [1, 2, 1, 3]
    swapped = jagged([pairs[1], pairs[0], *pairs[2:]], torch.bool)  # refused by the alignment itself, before TeacherSeq
    refused(lambda: TeacherSeq(teacher.tokens, alignment_with(teacher.alignment, pair_is_correct=swapped), batch_size=[4]),
            "pair_is_correct", "pair_valid", "row 0")
    copies = alignment_with(teacher.alignment, teacher_chunk_id=make_jagged(
        teacher.alignment.teacher_chunk_id.values(), teacher.tokens.offsets.clone()))
    shared = TeacherSeq(teacher.tokens, copies, teacher.topk_ids, batch_size=[4])
    assert shared.alignment.teacher_chunk_id.offsets() is shared.tokens.offsets  # equal rows: one offsets object


def test_distill_batch_refuses_alignment_student_fields_in_other_rows():
    batch = distill_batch()
    teacher = batch.teacher(0)
    bad = alignment_with(teacher.alignment, student_chunk_id=jagged(OTHER_ROWS),  # the student has ROWS
                         student_exact_partition_mask=jagged(OTHER_ROWS, torch.bool))
    teachers = TensorDict({"0": TeacherSeq(teacher.tokens, bad, batch_size=[4])}, batch_size=[4])
    refused(lambda: DistillBatch(batch.student, batch.sample_mask, teachers, batch_size=[4]),
            "teachers['0']", "alignment.student_", "student.input_ids", "row 1 has 9 values")
    picked = batch[torch.tensor([3, 0, 0])]
    assert picked.teacher(0).alignment.student_chunk_id.offsets() is picked.student.offsets
    assert picked.teacher(0).alignment.teacher_chunk_id.offsets() is picked.teacher(0).tokens.offsets


def test_data_proto_refuses_a_declared_group_in_other_rows():
    schema = Schema([FieldSpec("ids", "token", group="tok"), FieldSpec("mask", "token", group="tok")])
    with pytest.raises(LengthsError) as info:
        DataProto(TensorDict({"ids": jagged(ROWS), "mask": jagged(OTHER_ROWS, torch.bool)}, batch_size=[4]), schema=schema)
    assert "field 'ids' and field 'mask' have different rows: row 1 has 10 values in field 'ids', 9 values" in str(info.value)
    dp = DataProto(TensorDict({"ids": jagged(ROWS), "mask": jagged(ROWS, torch.bool)}, batch_size=[4]), schema=schema)
    assert dp.batch.get("ids").offsets() is dp.batch.get("mask").offsets()
    undeclared = DataProto(TensorDict({"ids": jagged(ROWS), "mask": jagged(OTHER_ROWS, torch.bool)}, batch_size=[4]))
    assert undeclared.groups == {"g0": ("ids",), "g1": ("mask",)}  # without a schema: two groups, as before


# ------------------------------------------------------------------------------------------------- values never read
def broadcast(offsets, dtype):
    "A jagged tensor over `offsets` whose values are one element broadcast: any read of them would take forever."
    return make_jagged(torch.zeros(1, dtype=dtype).expand(int(offsets[-1])), offsets)


def test_the_row_check_never_reads_values():
    T = 10**12
    rows, other = torch.tensor([0, T // 2, T]), torch.tensor([0, T // 4, T])
    start = time.perf_counter()
    rd = RewardData(broadcast(rows, torch.long), broadcast(rows.clone(), torch.bool), batch_size=[2])
    assert rd.attention_mask.offsets() is rd.input_ids.offsets()
    with pytest.raises(ValueError, match="row 0 has 250000000000 values in attention_mask, 500000000000 values"):
        RewardData(broadcast(rows, torch.long), broadcast(other, torch.bool), batch_size=[2])
    ts = TokenSeq(broadcast(rows, torch.long), broadcast(rows.clone(), torch.bool), torch.tensor([T // 2] * 2), batch_size=[2])
    assert ts.token_mask.offsets() is ts.offsets
    with pytest.raises(ValueError, match="row 0"):
        TokenSeq(broadcast(rows, torch.long), broadcast(other, torch.bool), torch.tensor([T // 2] * 2), batch_size=[2])
    assert time.perf_counter() - start < 10  # reading 10^12 values would take hours


def test_meta_fields_construct_without_reading_anything():
    meta_rows = lengths_to_offsets(torch.tensor(ROWS)).to("meta")
    ids = make_jagged(torch.empty(20, dtype=torch.long, device="meta"), meta_rows, min_seqlen=1, max_seqlen=10)
    mask = make_jagged(torch.empty(20, dtype=torch.bool, device="meta"), meta_rows.clone(), min_seqlen=1, max_seqlen=10)
    rd = RewardData(ids, mask, batch_size=[4])  # meta offsets hold no numbers: only the row counts can be compared
    assert rd.attention_mask.offsets() is rd.input_ids.offsets() and rd.input_ids.device.type == "meta"
    moved = RewardData(jagged(ROWS), jagged(ROWS, torch.bool), batch_size=[4]).to("meta")  # tensordict's .to
    assert moved.attention_mask.offsets() is moved.input_ids.offsets()
    schema = Schema([FieldSpec("ids", "token", group="tok"), FieldSpec("mask", "token", group="tok")])
    dp = DataProto(TensorDict({"ids": ids, "mask": mask}, batch_size=[4]), schema=schema)  # a declared group: shared
    assert dp.batch.get("ids").offsets() is dp.batch.get("mask").offsets()
    assert DataProto(TensorDict({"ids": ids, "mask": mask}, batch_size=[4])).groups == {"g0": ("ids",), "g1": ("mask",)}
