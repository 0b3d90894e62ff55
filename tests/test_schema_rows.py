"""`AlignmentBatch` refuses fields of one axis whose rows disagree, and shares one offsets object where they agree.

The two student fields, the two teacher fields and the two pair fields each describe the same rows. Rows of 3, 10, 1
and 6 tokens are not rows of 3, 9, 2 and 6, though both hold 20 tokens: the check compares the offsets by value and
never reads a values buffer (fields of 10^12 tokens over one broadcast element construct at once).
"""
import pytest
import torch

from xtoken_dp.schema import AlignmentBatch, lengths_to_offsets, make_jagged

ROWS, OTHER_ROWS = [3, 10, 1, 6], [3, 9, 2, 6]


def jagged(lengths, dtype):
    offsets = lengths_to_offsets(torch.tensor(lengths))
    return make_jagged(torch.zeros(int(offsets[-1]), dtype=dtype), offsets)


def fields(student=ROWS, teacher=(2, 2, 2, 2), pairs=(2, 2, 1, 2)):
    return dict(pair_valid=jagged(pairs, torch.bool), pair_is_correct=jagged(pairs, torch.bool),
                student_exact_partition_mask=jagged(student, torch.bool), student_chunk_id=jagged(student, torch.int64),
                teacher_exact_partition_mask=jagged(teacher, torch.bool), teacher_chunk_id=jagged(teacher, torch.int64),
                num_chunks=torch.tensor([2, 2, 1, 2]), batch_size=[4])


def test_agreeing_rows_share_one_offsets_object():
    ab = AlignmentBatch(**fields())
    for axis in ("student", "teacher", "pairs"):
        a, b = (getattr(ab, n) for n in AlignmentBatch.axis_fields(axis))
        assert a.offsets() is b.offsets(), axis


@pytest.mark.parametrize("name", ["student_chunk_id", "teacher_chunk_id", "pair_is_correct"])
def test_equal_totals_with_other_rows_are_refused(name):
    kw = fields(teacher=ROWS, pairs=ROWS)
    kw[name] = jagged(OTHER_ROWS, kw[name].dtype)
    with pytest.raises(ValueError, match=rf"AlignmentBatch\.{name} must have the rows of .*row 1 has 9 values"):
        AlignmentBatch(**kw)


def test_padded_fields_of_other_shapes_are_refused():
    kw = fields()
    kw = {k: (v.to_padded_tensor(0) if isinstance(v, torch.Tensor) and v.is_nested else v) for k, v in kw.items()}
    AlignmentBatch(**kw)
    kw["student_chunk_id"] = kw["student_chunk_id"][:, :5]
    with pytest.raises(ValueError, match=r"student_chunk_id must have the shape of student_exact_partition_mask"):
        AlignmentBatch(**kw)


def test_the_check_never_reads_values():
    "Reading 10^12 broadcast values would not finish: constructing and refusing here must not touch them."
    T = 10**12
    rows, other = torch.tensor([0, T // 2, T]), torch.tensor([0, T // 2 + 1, T])
    huge = lambda off, dtype: make_jagged(torch.zeros(1, dtype=dtype).expand(int(off[-1])), off)
    kw = fields()
    kw.update(student_exact_partition_mask=huge(rows, torch.bool), student_chunk_id=huge(rows.clone(), torch.int64),
              num_chunks=torch.tensor([1, 1]), batch_size=[2],
              pair_valid=jagged([1, 1], torch.bool), pair_is_correct=jagged([1, 1], torch.bool),
              teacher_exact_partition_mask=jagged([1, 1], torch.bool), teacher_chunk_id=jagged([1, 1], torch.int64))
    ab = AlignmentBatch(**kw)
    assert ab.student_chunk_id.offsets() is ab.student_exact_partition_mask.offsets()
    with pytest.raises(ValueError, match="row 0 has"):
        AlignmentBatch(**{**kw, "student_chunk_id": huge(other, torch.int64)})
