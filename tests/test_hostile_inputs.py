"""Hostile inputs at the library's entry points: each is refused with the module's typed error, naming what is wrong.

Every case here once escaped as another exception (torch's `RuntimeError`/`NotImplementedError`, an `AssertionError`,
an `AttributeError`) or as a message that named neither the argument nor the file. The cases are data: an entry
point, a hostile input, the error class expected and a fragment of its message.
"""
import io, os, pickle
from contextlib import redirect_stdout

import pytest
import torch
from tensordict import TensorDict

from xtoken_dp.codec import WireFormatError, encode, to_nested_by_length
from xtoken_dp.cli import main as cli_main
from xtoken_dp.projection import UnsafeProjectionFileError, load_projection_object
from xtoken_dp.core import offsets_of
from xtoken_dp.dataplane import KVBatchMeta
from xtoken_dp.dataproto import DataProto
from xtoken_dp.schema import as_lengths, make_jagged
from xtoken_dp.tensorclasses import RewardData, TokenSeq

META = torch.device("meta")


def _id_aligner():
    from xtoken_dp.aligner import TokenAligner
    from xtoken_dp.tokenizers import load_tokenizer
    return TokenAligner(load_tokenizer("qwen2"), load_tokenizer("mistral_spm"))

CASES = {
    "lengths beyond int64": (lambda: as_lengths([1, 2**63]), ValueError, "lengths[1]: expected an int that fits in int64"),
    "lengths far beyond int64": (lambda: as_lengths([-2**70], "response_lengths"), ValueError,
                                 "response_lengths[0]: expected an int that fits in int64"),
    "lengths on the meta device": (lambda: as_lengths(torch.ones(2, dtype=torch.long, device=META)), TypeError,
                                   "lengths must hold data, got a tensor on the meta device"),
    "padded column with meta lengths": (lambda: to_nested_by_length(torch.zeros(2, 3), torch.ones(2, dtype=torch.long, device=META)),
                                        TypeError, "meta device"),
    "padded column with huge lengths": (lambda: to_nested_by_length(torch.zeros(2, 3), [1, 2**64]), ValueError, "fits in int64"),
    "jagged offsets as a list": (lambda: make_jagged(torch.zeros(3), [0, 1, 3]), TypeError, "must be tensors, got Tensor and list"),
    "jagged values and offsets on two devices": (lambda: make_jagged(torch.zeros(3, device=META), torch.tensor([0, 1, 3])),
                                                 ValueError, "values on meta and offsets on cpu"),
    "a wire batch on the meta device": (lambda: encode(TensorDict({"x": torch.zeros(2, 3, device=META)}, batch_size=[2])),
                                        WireFormatError, "fields ['x'] are on the meta device"),
    "row offsets of lengths beyond int64": (lambda: offsets_of([1, 2**63]), ValueError, "expected ints that fit in int64"),
    "row offsets whose total overflows": (lambda: offsets_of([2**62, 2**62]), ValueError, "whose total fits in int64"),
    "a DataProto row index beyond int64": (lambda: DataProto.from_dict({"a": torch.zeros(3)})[[0, 2**63]], ValueError,
                                           "index[1]: expected an int that fits in int64"),
    "a DataProto repeated beyond int64": (lambda: DataProto.from_dict({"a": torch.zeros(3)}).repeat(2**63), ValueError,
                                          "repeat_times: expected an int that fits in int64"),
    "a tensorclass field of another batch size": (
        lambda: RewardData(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(3, 3, dtype=torch.long),
                           batch_size=[2]), ValueError, "RewardData.attention_mask: expected leading dims [2] (batch_size), got shape (3, 3)"),
    "a token field of another batch size": (
        lambda: TokenSeq(input_ids=torch.zeros(2, 3, dtype=torch.long), input_lengths=torch.ones(3, dtype=torch.long), batch_size=[2]),
        ValueError, "TokenSeq.input_lengths: expected leading dims [2]"),
    "receipts whose extra_info disagree": (
        lambda: KVBatchMeta(partition_id="p", sample_ids=["a"], fields=["x"], extra_info={"step": 1}).concat(
            KVBatchMeta(partition_id="p", sample_ids=["b"], fields=["x"], extra_info={"step": 2})),
        ValueError, "concat: extra_info['step'] is 1 in receipt 0 and 2 in receipt 1"),
    "a receipt whose extra_info is no dict": (
        lambda: KVBatchMeta(partition_id="p", sample_ids=["a"], fields=["x"], extra_info=[("step", 1)]),
        TypeError, "extra_info: expected a dict of batch-level values or None, got list"),
    "ids on the meta device": (lambda: _id_aligner().align(torch.ones(1, 2, dtype=torch.long, device=META), torch.ones(1, 2, dtype=torch.long)),
                               ValueError, "student_ids must hold ids, got a tensor on the meta device"),
    "an attention mask on the meta device": (
        lambda: _id_aligner().align(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                                    student_attention_mask=torch.ones(1, 2, dtype=torch.long, device=META)),
        ValueError, "student_attention_mask must hold 0/1 values, got a tensor on the meta device"),
    "a receipt sliced from a bool": (
        lambda: KVBatchMeta(partition_id="p", sample_ids=["a", "b"], fields=["x"]).slice(True, 2),
        TypeError, "start: expected an int, got bool True"),
    "a receipt length beyond int64": (
        lambda: KVBatchMeta(partition_id="p", sample_ids=["a"], fields=["x"], sequence_lengths=[2**63]),
        ValueError, "sequence_lengths[0]: expected an int >= 0 and <= 9223372036854775807"),
}


def test_receipts_that_agree_merge_their_extra_info():
    a = KVBatchMeta(partition_id="p", sample_ids=["a"], fields=["x"], extra_info={"step": 1, "seed": [1, 2]})
    b = KVBatchMeta(partition_id="p", sample_ids=["b"], fields=["x"], extra_info={"seed": [1, 2], "source": "rollout"})
    assert a.concat(b).extra_info == {"step": 1, "seed": [1, 2], "source": "rollout"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_input_gets_a_typed_error(case):
    call, error, fragment = CASES[case]
    with pytest.raises(error) as info: call()
    assert fragment in str(info.value), f"{case}: {info.value}"


class _Smuggled:
    "What a hostile file carries: unpickling it would call print."
    def __reduce__(self): return (print, ("this would have run",))


@pytest.mark.parametrize("protocol", [0, 2, 5])
@pytest.mark.parametrize("legacy_torch", [False, True])
def test_a_pickle_that_is_no_zip_archive_names_its_globals(tmp_path, protocol, legacy_torch):
    path = tmp_path / "projection.pt"
    obj = {"indices": torch.zeros(2, 1, dtype=torch.long), "likelihoods": torch.ones(2, 1), "extra": _Smuggled(),
           "hook": os.system}
    if legacy_torch: torch.save(obj, path, _use_new_zipfile_serialization=False, pickle_protocol=max(protocol, 2))
    else: path.write_bytes(pickle.dumps(obj, protocol=protocol))
    with redirect_stdout(io.StringIO()) as printed, _quiet():
        with pytest.raises(UnsafeProjectionFileError) as info: load_projection_object(path)
    assert printed.getvalue() == ""   # nothing in the file ran
    assert {"builtins.print", f"{os.system.__module__}.system"} <= set(info.value.unsafe_globals)
    assert str(path) in str(info.value)


class _quiet:
    "Silences torch's warning about pickle protocols newer than 2 (the refusal is what is tested)."
    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings(); self._ctx.__enter__(); warnings.simplefilter("ignore")
    def __exit__(self, *exc): return self._ctx.__exit__(*exc)


@pytest.mark.parametrize("claims", [{"top_k": 4}, {"nonempty_rows": 1}, {"report": {"teacher_ids_covered": 99}},
                                    {"teacher_fingerprint": "a" * 64, "report": {"teacher_fingerprint": "b" * 64}}])
def test_projection_inspect_fails_on_a_file_whose_claims_contradict_its_tensors(tmp_path, capsys, claims):
    path = tmp_path / "claims.pt"
    torch.save({"indices": torch.tensor([[1, -1], [0, 2]]), "likelihoods": torch.tensor([[1.0, 0.0], [0.5, 0.5]]),
                **claims}, path)
    assert cli_main(["projection", "inspect", str(path)]) == 1
    assert str(path) in capsys.readouterr().err
