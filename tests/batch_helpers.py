"""Shared by the DataProto tests: reading a batch back row by row, independently of the kernels under test."""
from xtoken_dp.batch import DataProto


def rows_of(dp: DataProto) -> list[dict]:
    "Rows read back one at a time through torch's own NJT indexing (independent of the kernels under test)."
    out = []
    for i in range(len(dp)):
        row = {k: dp.batch.get(k)[i] for k in dp.batch.keys()} if dp.batch is not None else {}
        row.update({k: v[i] for k, v in dp.non_tensor_batch.items()})
        out.append(row)
    return out
