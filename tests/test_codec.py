"""Tests of the wire codec that the notebook does not host, and property tests.

The notebook `nbs/01_codec.ipynb` asserts the worked examples (packing, padding, the error contracts, encode/decode);
this file covers empty batches everywhere, TP/CP padding, trailing dims, shared offsets, object columns through
tensordict operations and every transport, out-of-band pickling, aliasing, `wire_nbytes`, import hygiene, the CUDA
path, round-trip exactness under hypothesis, and the `python -O` independence of the validation (the numbers in the
test names are those of the codec's acceptance list). `tests/test_codec_hostile.py` feeds `decode` malformed input.
Set `XTOKEN_DP_HYPOTHESIS_EXAMPLES` to run more examples (default 40).
"""
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from xtoken_dp.codec import (LengthsError, PaddingError, WireBatch, WireFormatError, decode, encode, materialize,
                             maybe_pack_jagged, object_array, pack_jagged_fields, pack_per_token_field,
                             response_from_nested, to_nested_by_length, wire_nbytes)
from xtoken_dp.schema import FieldSpec, Schema, infer_schema, is_jagged, make_jagged, lengths_to_offsets

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("XTOKEN_DP_HYPOTHESIS_EXAMPLES", "40"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------------- helpers
def bits(t: torch.Tensor) -> torch.Tensor:
    "A byte view for bitwise comparison (NaN payloads, bf16, bool)."
    t = t.contiguous()
    return t.view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_wire(a: TensorDict, b: TensorDict, schema: Schema | None = None):
    "Bitwise equality of two wire batches: keys, kinds, values, offsets, seqlen cache, shared offsets, objects."
    assert list(a.keys()) == list(b.keys()) and a.batch_size == b.batch_size
    for key in a.keys():
        x, y = a.get(key), b.get(key)
        if is_jagged(x):
            assert is_jagged(y), key
            assert torch.equal(x.offsets(), y.offsets()), key
            assert (x._min_seqlen, x._max_seqlen) == (y._min_seqlen, y._max_seqlen), key
            assert same_bits(x.values(), y.values()), key
        elif isinstance(x, torch.Tensor):
            assert same_bits(x, y), key
        else:
            xs, ys = x.tolist(), y.tolist()
            assert xs == ys and [type(v) for v in xs] == [type(v) for v in ys], key
    for group in (schema or infer_schema(a)).groups().values():
        assert len({id(b.get(k).offsets()) for k in group}) == 1, f"group {group} does not share one offsets object"


def msgpack_round_trip(td, schema=None) -> TensorDict:
    header, buffers = encode(td, schema=schema)
    packed = msgpack.packb((header, [bytes(b) for b in buffers]), use_bin_type=True)
    header2, buffers2 = msgpack.unpackb(packed, raw=False)
    return decode(header2, buffers2, allow_pickle=True)


def rl_batch(n=5, s=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, s + 1, (n,), generator=g)
    schema = Schema([FieldSpec("input_ids", "token", torch.int64, pad_value=7),
                     FieldSpec("logprobs", "token", torch.bfloat16),
                     FieldSpec("topk_ids", "token", torch.int32, trailing_shape=(4,)),
                     FieldSpec("positions", "token", torch.int64, group="mrope", trailing_shape=(4,)),
                     FieldSpec("reward", "sample", torch.float32),
                     FieldSpec("image_grid_thw", "rect", torch.int64, trailing_shape=(3,)),
                     FieldSpec("prompt", "object")])
    columns = {"input_ids": torch.randint(0, 1000, (n, s), generator=g),
               "logprobs": torch.randn(n, s, generator=g).to(torch.bfloat16),
               "topk_ids": torch.randint(0, 1000, (n, s, 4), generator=g, dtype=torch.int64).to(torch.int32),
               "positions": torch.randint(0, 99, (n, s + 2, 4), generator=g),
               "reward": torch.rand(n, generator=g), "image_grid_thw": torch.ones(n, 3, dtype=torch.int64),
               "prompt": object_array([f"p{i}" if i % 2 else None for i in range(n)])}
    pos_lengths = torch.randint(0, s + 3, (n,), generator=g)
    wire = pack_jagged_fields(columns, lengths={"default": lengths, "mrope": pos_lengths}, schema=schema)
    return wire, schema, columns, lengths


# ------------------------------------------------------------------------------------------- acceptance tests
def test_03_empty_batch_round_trips_everywhere():
    "N == 0 through to_nested_by_length, pack_*, encode/decode and materialize, every column present."
    none = torch.zeros(0, dtype=torch.long)
    assert to_nested_by_length(torch.zeros(0, 4, 2), none).values().shape == (0, 2)
    assert is_jagged(pack_per_token_field(torch.zeros(0, 4), none)) and is_jagged(maybe_pack_jagged(torch.zeros(0, 4), none))
    wire, schema, columns, _ = rl_batch()
    empty = pack_jagged_fields({k: v[:0] for k, v in columns.items()}, lengths={"default": none, "mrope": none}, schema=schema)
    assert tuple(empty.keys()) == schema.names
    assert schema.validate(empty) is empty
    for back in (decode(*encode(empty, schema=schema), allow_pickle=True), msgpack_round_trip(empty),
                 pickle.loads(pickle.dumps(WireBatch(empty), protocol=5)).td):
        assert_same_wire(empty, back, schema)
        assert back.get("input_ids").offsets().tolist() == [0] and back.get("input_ids")._max_seqlen == 0
    out = materialize(empty, pad_to_seqlen=6)
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "input_ids": (0, 6), "logprobs": (0, 6), "topk_ids": (0, 6, 4), "positions": (0, 6, 4), "reward": (0,),
        "image_grid_thw": (0, 3), "prompt": (0,)}


def test_14_tp_cp_padded_ids_round_trip():
    "ids padded to a TP x CP multiple pack and round-trip to the original unpadded rows."
    rows = [torch.arange(5), torch.arange(9) + 100, torch.arange(3) + 200]
    tp_cp = 8
    width = -(-max(len(r) for r in rows) // tp_cp) * tp_cp
    padded = torch.full((3, width), -5)
    for i, r in enumerate(rows): padded[i, :len(r)] = r
    lengths = torch.tensor([len(r) for r in rows])
    wire = pack_jagged_fields({"input_ids": padded}, lengths=lengths, schema=Schema([FieldSpec("input_ids", "token")]))
    back = decode(*encode(wire))
    assert [r.tolist() for r in back.get("input_ids").unbind()] == [r.tolist() for r in rows]
    natural = materialize(back)["input_ids"]
    assert natural.shape == (3, 9) and all(torch.equal(natural[i, :len(r)], r) for i, r in enumerate(rows))
    assert torch.equal(materialize(back, pad_value_dict={"input_ids": -5}, pad_to_seqlen=width)["input_ids"], padded)


def test_15_trailing_dims_round_trip_and_ragged_dim_2_rejected():
    wire, schema, columns, lengths = rl_batch(n=6, s=7, seed=3)
    back = msgpack_round_trip(wire, schema)
    assert_same_wire(wire, back)
    out = materialize(back)
    topk = out["topk_ids"]
    for i, length in enumerate(lengths.tolist()):
        assert torch.equal(topk[i, :length], columns["topk_ids"][i, :length])
        assert (topk[i, length:] == 0).all()
    assert topk.shape[2:] == (4,) and out["positions"].shape[2:] == (4,)
    ragged2 = make_jagged(torch.zeros(10, 4), lengths_to_offsets(torch.tensor([4, 6]))).transpose(1, 2)
    with pytest.raises(ValueError, match="ragged dim must be dim 1"):
        pack_jagged_fields({"x": ragged2}, lengths=None)
    with pytest.raises(ValueError, match="ragged dim must be dim 1"):
        encode(TensorDict({"x": ragged2}, batch_size=[2]))


def test_16_groups_share_offsets_after_pack_decode_and_unpickling():
    wire, schema, _, _ = rl_batch()
    ids = lambda td: td.get("input_ids").offsets()
    for td in (wire, decode(*encode(wire, schema=schema), allow_pickle=True), pickle.loads(pickle.dumps(WireBatch(wire), protocol=5)).td,
               pickle.loads(pickle.dumps(WireBatch(wire), protocol=2)).td, msgpack_round_trip(wire)):
        assert ids(td) is td.get("logprobs").offsets() is td.get("topk_ids").offsets()
        assert td.get("positions").offsets() is not ids(td)


def test_20_object_column_survives_tensordict_ops():
    items = [None, "s", b"b", {"k": [1, 2]}, (3, 4), np.float32(1.5)]
    wire = pack_jagged_fields({"o": object_array(items), "x": torch.arange(6)}, lengths=None)
    stack = wire.get("o")
    assert isinstance(stack, NonTensorStack) and all(wire[i]["o"] == items[i] or items[i] is None for i in range(6))
    assert wire[3]["o"] is items[3]
    assert materialize(wire.contiguous())["o"].tolist() == items
    assert materialize(wire[torch.tensor([4, 1])])["o"].tolist() == [items[4], items[1]]
    assert materialize(torch.cat([wire, wire]))["o"].tolist() == items + items


def test_31_bitwise_round_trips_everywhere():
    "encode/decode, pickle 2-5 of WireBatch and a real msgpack round trip are bitwise exact (NaN payloads, bf16)."
    wire, schema, _, _ = rl_batch(n=7, s=11, seed=1)
    lp = wire.get("logprobs").values()
    lp.view(torch.int16)[:3] = torch.tensor([0x7FC1, 0x7F81, -1], dtype=torch.int16)  # NaNs with distinct payloads
    assert torch.isnan(lp[:3].float()).all()
    assert_same_wire(wire, decode(*encode(wire, schema=schema), allow_pickle=True))
    for protocol in (2, 3, 4, 5):
        back = pickle.loads(pickle.dumps(WireBatch(wire, schema=schema), protocol=protocol))
        assert_same_wire(wire, back.td) and back.schema == schema
    assert_same_wire(wire, msgpack_round_trip(wire, schema))
    decoded = decode(*encode(wire), allow_pickle=True)
    assert torch.nested.to_padded_tensor(decoded.get("input_ids"), 0).shape[1] == wire.get("input_ids")._max_seqlen


def test_32_object_items_survive_equal_and_type_identical():
    items = [None, "str", b"bytes", {"nested": [1, (2, 3)], "x": None}, (1, "a"), np.int64(7), np.float32(0.5), [[1], [2]]]
    wire = pack_jagged_fields({"o": object_array(items)}, lengths=None)
    for back in (msgpack_round_trip(wire), pickle.loads(pickle.dumps(WireBatch(wire), protocol=5)).td,
                 pickle.loads(pickle.dumps(WireBatch(wire), protocol=2)).td):
        got = materialize(back)["o"].tolist()
        assert got == items and [type(v) for v in got] == [type(v) for v in items]
        assert got[0] is None  # None stays None, never "stripped"


def _many_fields(n: int) -> TensorDict:
    lengths = torch.ones(n, dtype=torch.long)
    cols = {f"tok{i}": torch.zeros(n, 1, dtype=torch.int32) for i in range(40)}
    cols.update({f"rect{i}": torch.zeros(n, 2) for i in range(20)})
    cols.update({f"obj{i}": object_array(["x"] * n) for i in range(4)})
    schema = Schema([FieldSpec(k, "token") if k.startswith("tok") else FieldSpec(k, "rect") if k.startswith("rect")
                     else FieldSpec(k, "object") for k in cols])
    return pack_jagged_fields(cols, lengths=lengths, schema=schema)


@pytest.mark.parametrize("n", [1, 5_000])
def test_33_protocol_5_out_of_band_and_small_inband(n):
    td = _many_fields(n)
    _, buffers = encode(td)
    oob = []
    inband = pickle.dumps(WireBatch(td), protocol=5, buffer_callback=oob.append)
    assert len(oob) == len(buffers) == 1 + 40 + 20 + 4
    assert all(isinstance(b, pickle.PickleBuffer) and isinstance(b.raw().obj, np.ndarray) for b in oob)
    assert len(inband) < 64 * 1024
    small = len(pickle.dumps(WireBatch(_many_fields(1)), protocol=5, buffer_callback=lambda b: None))
    assert len(inband) - small < 256  # grows by a few bytes only (variable-width integers)
    back = pickle.loads(inband, buffers=[b.raw() for b in oob])
    assert_same_wire(td, back.td)


def test_34_decode_aliases_writable_and_read_only_buffers():
    wire, schema, _, _ = rl_batch()
    header, buffers = encode(wire, schema=schema)
    fields = {f["name"]: f["buffer"] for f in header["fields"]}
    writable = [bytearray(b) for b in buffers]
    td = decode(header, writable, allow_pickle=True)
    assert td.get("reward").data_ptr() == np.frombuffer(writable[fields["reward"]], np.uint8).ctypes.data
    assert not td.is_locked
    read_only = [bytes(b) for b in buffers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td = decode(header, read_only, allow_pickle=True)
    assert td.get("input_ids").values().data_ptr() == np.frombuffer(read_only[fields["input_ids"]], np.uint8).ctypes.data
    assert td.is_locked


def test_36_wire_nbytes_counts_offsets_objects_and_one_buffer_per_object_column():
    wire, schema, _, _ = rl_batch()
    sizes = wire_nbytes(wire, schema=schema)
    header, buffers = encode(wire, schema=schema)
    assert sizes["total"] == sum(b.nbytes for b in buffers)
    assert sizes["offsets"] == 2 * (5 + 1) * 8 and sizes["objects"] == buffers[-1].nbytes > 0
    counts = {len(encode(pack_jagged_fields({"o": object_array(["x"] * n)}, lengths=None))[1]) for n in (1, 10, 1000)}
    assert counts == {1}


def test_39_import_hygiene_in_a_fresh_process():
    code = textwrap.dedent("""
        import sys, tensordict
        before = (tensordict.lazy_legacy(), tensordict.list_to_stack())
        import xtoken_dp.codec, xtoken_dp.schema
        after = (tensordict.lazy_legacy(), tensordict.list_to_stack())
        print(before == after, "ray" in sys.modules, "transformers" in sys.modules, "msgpack" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["True", "False", "False", "False"], out.stdout + out.stderr


def test_40_length_one_rows_stay_jagged_and_dense_shapes_stay():
    n = 4
    schema = Schema([FieldSpec("ids", "token"), FieldSpec("r1", "rect"), FieldSpec("s", "sample")])
    wire = pack_jagged_fields({"ids": torch.arange(n)[:, None], "r1": torch.ones(n, 1), "s": torch.zeros(n)},
                              lengths=torch.ones(n, dtype=torch.long), schema=schema)
    for back in (decode(*encode(wire, schema=schema)), msgpack_round_trip(wire)):
        assert is_jagged(back.get("ids")) and back.get("ids")._max_seqlen == 1
        assert back.get("r1").shape == (n, 1) and back.get("s").shape == (n,)
        assert [s.kind for s in infer_schema(back)] == ["token", "rect", "sample"]


def run_counting_cuda_syncs(fn):
    "Runs `fn` under torch's sync debug mode; returns its result and the host syncs it reported (not the mode's notice)."
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try: result = fn()
        finally: torch.cuda.set_sync_debug_mode("default")
    return result, [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_42_cuda_padding_equals_cpu_with_at_most_one_sync_per_group():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 50, (33,), generator=g)
    cols = {"i64": torch.randint(-2**40, 2**40, (33, 50), generator=g), "i32": torch.randint(0, 9, (33, 50), generator=g).int(),
            "b": torch.rand(33, 50, generator=g) > 0.5}
    schema = Schema([FieldSpec(k, "token") for k in cols])
    cpu = pack_jagged_fields(cols, lengths=lengths, schema=schema)
    gpu = pack_jagged_fields({k: v.cuda() for k, v in cols.items()}, lengths=lengths.cuda(), schema=schema)
    pads = {"i64": 2**62 + 1, "i32": -3, "b": True}
    expected = materialize(cpu, pad_value_dict=pads, pad_to_seqlen=64)
    torch.cuda.synchronize()
    got, syncs = run_counting_cuda_syncs(lambda: materialize(gpu, pad_value_dict=pads, pad_to_seqlen=64))
    assert len(syncs) <= 1, syncs
    # the counter itself sees a sync when there is one (a message change in torch would otherwise pass silently)
    assert len(run_counting_cuda_syncs(lambda: torch.ones(2, device="cuda").sum().item())[1]) == 1
    for k in cols:
        assert got[k].is_cuda and torch.equal(got[k].cpu(), expected[k])


# ------------------------------------------------------------------------------------- validation under python -O
def test_validation_does_not_depend_on_assert():
    "Every check is an explicit raise: under `python -O` (asserts stripped) they all still fire."
    code = textwrap.dedent("""
        import torch
        from xtoken_dp.codec import *
        from xtoken_dp.schema import FieldSpec, Schema, AlignmentBatch
        checks = {
            "lengths > S": lambda: to_nested_by_length(torch.zeros(2, 3), [4, 1]),
            "negative": lambda: to_nested_by_length(torch.zeros(2, 3), [-1, 1]),
            "1-D padded": lambda: to_nested_by_length(torch.zeros(3), [1, 1, 1]),
            "narrow field": lambda: pack_per_token_field(torch.zeros(2, 3), [4, 1]),
            "float pad": lambda: FieldSpec("x", "token", torch.int64, pad_value=0.5),
            "materialize pad": lambda: materialize(pack_jagged_fields({"x": torch.zeros(2, 3, dtype=torch.long)}, lengths=[1, 3]), pad_value_dict={"x": 0.5}),
            "target too small": lambda: materialize(pack_jagged_fields({"x": torch.zeros(2, 3)}, lengths=[1, 3]), pad_to_seqlen=2),
            "prompt 0": lambda: response_from_nested(to_nested_by_length(torch.zeros(1, 3), [2]), torch.tensor([2])),
            "version": lambda: decode({**encode(pack_jagged_fields({"x": torch.zeros(2)}, lengths=None))[0], "version": 2}, []),
            "undeclared": lambda: pack_jagged_fields({"x": torch.zeros(2)}, lengths=None, schema=Schema([])),
            "alignment": lambda: AlignmentBatch.from_padded(pair_valid=torch.ones(1, 1, dtype=torch.bool),
                pair_is_correct=torch.ones(1, 1, dtype=torch.bool), student_exact_partition_mask=torch.zeros(1, 1, dtype=torch.bool),
                teacher_exact_partition_mask=torch.zeros(1, 1, dtype=torch.bool), student_chunk_id=torch.tensor([[5]]),
                teacher_chunk_id=torch.tensor([[0]]), num_chunks=torch.tensor([1]), validate=True),
        }
        failed = []
        for name, fn in checks.items():
            try: fn(); failed.append(name)
            except (ValueError, TypeError): pass
        print("asserts stripped:", __debug__ is False, "| not raised:", failed)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # cache the -O bytecode once
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=ROOT, check=True, env=env)
    assert out.stdout.strip() == "asserts stripped: True | not raised: []", out.stdout + out.stderr


def test_library_source_has_no_assert_statements():
    "The static twin of the test above: no `assert` statement in the modules this file covers."
    import ast
    for module in ("schema", "codec", "bench/__init__", "bench/codec"):
        tree = ast.parse((ROOT / "xtoken_dp" / f"{module}.py").read_text())
        asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert asserts == [], f"xtoken_dp/{module}.py uses assert at lines {asserts}"


# ----------------------------------------------------------------------------------------- property tests
DTYPES = [torch.bool, torch.int32, torch.int64, torch.bfloat16, torch.float32]


@st.composite
def pad_values(draw, dtype):
    if dtype == torch.bool: return draw(st.booleans())
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return draw(st.integers(info.min, info.max))
    x = draw(st.floats(width=32, allow_nan=True, allow_infinity=True))
    return torch.tensor(x, dtype=dtype).item()  # exactly representable in dtype by construction


def random_values(shape, dtype, g):
    if dtype == torch.bool: return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
        if x.numel() > 2: x.view(-1)[:2] = torch.tensor([float("nan"), float("-inf")], dtype=dtype)
        return x
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@st.composite
def wire_cases(draw):
    n = draw(st.integers(0, 9))
    width = draw(st.integers(0, 12))
    lengths = draw(st.lists(st.integers(0, width), min_size=n, max_size=n))
    fields = []
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        trailing = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
        fields.append((f"f{i}", dtype, trailing, draw(pad_values(dtype))))
    longest = max(lengths, default=0)
    pad_to = draw(st.sampled_from([0, longest, longest + draw(st.integers(1, 5))]))
    return n, width, lengths, fields, pad_to, draw(st.integers(0, 2**16)), draw(st.sampled_from([2, 4, 5, "msgpack", "codec"]))


@PROPERTY
@given(wire_cases())
def test_property_pack_encode_decode_materialize_is_exact(case):
    n, width, lengths, fields, pad_to, seed, transport = case
    g = torch.Generator().manual_seed(seed)
    columns = {name: random_values((n, width, *trailing), dtype, g) for name, dtype, trailing, _ in fields}
    columns["reward"] = torch.rand(n, generator=g)
    schema = Schema([FieldSpec(name, "token", dtype, trailing_shape=trailing) for name, dtype, trailing, _ in fields]
                    + [FieldSpec("reward", "sample", torch.float32)])
    wire = pack_jagged_fields(columns, lengths=torch.tensor(lengths, dtype=torch.long), schema=schema)
    schema.validate(wire)
    if transport == "msgpack": back = msgpack_round_trip(wire, schema)
    elif transport == "codec": back = decode(*encode(wire, schema=schema))
    else: back = pickle.loads(pickle.dumps(WireBatch(wire, schema=schema), protocol=transport)).td
    assert_same_wire(wire, back, schema)
    pads = {name: pad for name, _, _, pad in fields}
    out = materialize(back, pad_value_dict=pads, pad_to_seqlen=pad_to)
    W = pad_to or max(lengths, default=0)
    for name, dtype, trailing, pad in fields:
        expected = torch.full((n, W, *trailing), pad, dtype=dtype)
        for i, length in enumerate(lengths): expected[i, :length] = columns[name][i, :length]
        assert same_bits(out[name], expected), name
    assert out["reward"] is back.get("reward")
    jag = materialize(back, layout="jagged", pad_to_seqlen=pad_to)
    for name, *_ in fields:
        assert [r.shape[0] for r in jag[name].unbind()] == lengths if n else jag[name].shape[0] == 0


@PROPERTY
@given(st.lists(st.tuples(st.integers(1, 10), st.integers(0, 10)), max_size=8), st.integers(0, 2**16))
def test_property_response_from_nested_matches_per_row_rule(rows, seed):
    rows = [(length, min(r, length - 1)) for length, r in rows]  # prompt >= 1 whenever r >= 1
    g = torch.Generator().manual_seed(seed)
    data = [torch.randn(length, 2, generator=g) for length, _ in rows]
    full = make_jagged(torch.cat(data) if data else torch.zeros(0, 2), lengths_to_offsets(torch.tensor([l for l, _ in rows], dtype=torch.long)))
    out = response_from_nested(full, torch.tensor([r for _, r in rows], dtype=torch.long))
    expected = [d[len(d) - r - 1:len(d) - 1] for d, (_, r) in zip(data, rows)]
    assert [torch.equal(a, b) for a, b in zip(out.unbind(), expected)] == [True] * len(rows)
    assert out._max_seqlen == max((r for _, r in rows), default=0)


@PROPERTY
@given(st.lists(st.integers(0, 6), max_size=7), st.integers(0, 3))
def test_property_pad_to_seqlen_gives_equal_shapes_or_raises(lengths, extra):
    wire = pack_jagged_fields({"x": torch.ones(len(lengths), 6, dtype=torch.int64)}, lengths=torch.tensor(lengths, dtype=torch.long),
                              token_aligned_fields=["x"])
    longest = max(lengths, default=0)
    for target in (longest + extra, max(longest - 1 - extra, 1)):
        if target >= longest:
            assert materialize(wire, pad_to_seqlen=target)["x"].shape == (len(lengths), target)
        else:
            with pytest.raises(PaddingError, match="narrower than its longest row"):
                materialize(wire, pad_to_seqlen=target)


def test_lengths_errors_are_lengths_errors():
    with pytest.raises(LengthsError): to_nested_by_length(torch.zeros(2, 3), [4, 1])
    with pytest.raises(LengthsError): pack_jagged_fields({"x": torch.zeros(2, 3)}, lengths=torch.tensor([[1], [2]]))
    with pytest.raises(WireFormatError): decode({"format": "other"}, [])
