"""`decode` on hostile input: malformed headers and buffers raise `WireFormatError`, or decode to a consistent batch.

Hypothesis builds valid wire batches (token groups sharing offsets, sample and rect fields, object columns, empty
batches, zero-length rows, zero-size per-token dims), encodes them, then mutates the header (keys deleted or retyped,
numbers nudged or replaced by bools, strings, huge or negative values, dtype names swapped, fields duplicated or moved
to another group) and the buffers (truncated, extended, bytes flipped, swapped, reordered, dropped, added). Whatever
comes out, `decode` either raises `WireFormatError` or returns a batch that is internally consistent (its seqlen cache
is what its offsets say, it validates against the header's own schema, it materializes, it round-trips exactly), equal
to the original when the mutation changed nothing, and never much larger than the bytes it was given.
Set `XTOKEN_DP_HYPOTHESIS_EXAMPLES` to run more examples (default 40; the mutation test runs five times as many).
"""
import copy
import math
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from json_paths import json_paths

from xtoken_dp.codec import (MAX_WIRE_COUNT, WireBatch, WireFormatError, decode, encode, materialize, object_array,
                             pack_jagged_fields)
from xtoken_dp.schema import FieldSpec, Schema, is_jagged

EXAMPLES = int(os.environ.get("XTOKEN_DP_HYPOTHESIS_EXAMPLES", "40"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MUTATIONS = settings(PROPERTY, max_examples=5 * EXAMPLES)

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.bfloat16, torch.float32]
DTYPE_NAMES = ["int64", "int32", "int16", "uint8", "bool", "float32", "float64", "bfloat16", "float16", "complex64",
               "qint8", "bits16", "Tensor", "nope", ""]
# object items whose strings are no importable module name: a flipped pickle byte cannot make them a global to load
OBJECT_ITEMS = [None, "prompt-0", "ü 🙂", 7, -1.5, ("a b", 2), [1, [2]], {"k-1": None}, b"\x00\xff"]


# ------------------------------------------------------------------------------------------------ valid batches
@st.composite
def wire_batches(draw):
    "A valid wire batch with its schema: (td, schema, has_objects)."
    n = draw(st.integers(0, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    specs, columns, lengths = [], {}, {}
    for gi in range(draw(st.integers(0, 2))):
        group = f"g{gi}" if gi or draw(st.booleans()) else "default"
        lengths[group] = torch.tensor(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), dtype=torch.int64)
        for fi in range(draw(st.integers(1, 2))):
            dtype, trailing = draw(st.sampled_from(DTYPES)), draw(st.sampled_from([(), (2,), (0,)]))
            name = f"{group}_t{fi}"
            columns[name] = random_values((n, 5 + draw(st.integers(0, 2)), *trailing), dtype, g)
            specs.append(FieldSpec(name, "token", dtype if draw(st.booleans()) else None, group=group,
                                   trailing_shape=trailing if draw(st.booleans()) else None))
    if draw(st.booleans()):
        columns["reward"] = random_values((n,), torch.float32, g)
        specs.append(FieldSpec("reward", "sample", torch.float32 if draw(st.booleans()) else None))
    if draw(st.booleans()):
        trailing = draw(st.sampled_from([(3,), (0,), (2, 2)]))
        columns["grid"] = random_values((n, *trailing), torch.int64, g)
        specs.append(FieldSpec("grid", "rect", torch.int64, trailing_shape=trailing if draw(st.booleans()) else None))
    has_objects = draw(st.booleans())
    if has_objects:
        columns["prompt"] = object_array(draw(st.lists(st.sampled_from(OBJECT_ITEMS), min_size=n, max_size=n)))
        specs.append(FieldSpec("prompt", "object"))
    schema = Schema(specs)
    if not columns: return TensorDict({}, batch_size=[n]), schema, False
    return pack_jagged_fields(columns, lengths=lengths or None, schema=schema), schema, has_objects


def random_values(shape, dtype, g):
    if dtype == torch.bool: return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point: return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**40), min(info.max, 2**40), shape, generator=g, dtype=torch.int64).to(dtype)


# ---------------------------------------------------------------------------------------------------- mutations
JUNK = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2, 10**9, 2**62, 2**63, 2**64 + 1, -2**63]),
                 st.booleans(), st.none(), st.text(max_size=4), st.floats(allow_nan=True),
                 st.lists(st.integers(-2, 3), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=2),
                 st.sampled_from(DTYPE_NAMES), st.binary(max_size=3))


def parent_of(root, path):
    for key in path[:-1]: root = root[key]
    return root


def entries(header, part: str) -> list:
    "The dict entries of `header[part]` (an earlier mutation may have broken it)."
    found = header.get(part)
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def mutate_header(draw, header):
    "One random edit of the header, in place."
    where = list(json_paths(header))
    if not where: return
    kind = draw(st.sampled_from(["delete", "junk", "nudge", "nudge", "dtype", "duplicate", "group", "swap"]))
    path = draw(st.sampled_from(where))
    parent, key = parent_of(header, path), path[-1]
    value = parent[key]
    fields = entries(header, "fields")
    if kind == "delete": del parent[key]
    elif kind == "nudge" and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = value + draw(st.sampled_from([-2, -1, 1, 2, 7]))
    elif kind == "dtype" and fields:
        draw(st.sampled_from(fields))["dtype"] = draw(st.sampled_from(DTYPE_NAMES))
    elif kind == "duplicate" and fields:
        header["fields"].insert(draw(st.integers(0, len(header["fields"]))), copy.deepcopy(draw(st.sampled_from(fields))))
    elif kind == "group" and fields:
        names = [g.get("name") for g in entries(header, "groups")] + ["other", None]
        draw(st.sampled_from(fields))["group"] = draw(st.sampled_from(names))
    elif kind == "swap" and isinstance(parent, list) and len(parent) > 1:
        j = draw(st.integers(0, len(parent) - 1))
        parent[key], parent[j] = parent[j], parent[key]
    else: parent[key] = draw(JUNK)


def mutate_buffers(draw, buffers):
    "One random edit of the buffers (a list of bytearrays), in place."
    kind = draw(st.sampled_from(["truncate", "extend", "flip", "flip", "flip", "swap", "reorder", "drop", "add"]))
    filled = [k for k, b in enumerate(buffers) if b]
    if not buffers: kind = "add"
    elif kind in ("truncate", "flip") and not filled: kind = "extend"
    i = draw(st.sampled_from(filled)) if kind in ("truncate", "flip") else draw(st.integers(0, max(len(buffers) - 1, 0)))
    if kind == "truncate": del buffers[i][len(buffers[i]) - draw(st.integers(1, len(buffers[i]))):]
    elif kind == "extend": buffers[i].extend(draw(st.binary(min_size=1, max_size=16)))
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            buffers[i][draw(st.integers(0, len(buffers[i]) - 1))] ^= draw(st.integers(1, 255))
    elif kind == "swap":
        j = draw(st.integers(0, len(buffers) - 1))
        buffers[i], buffers[j] = buffers[j], buffers[i]
    elif kind == "reorder": buffers[:] = draw(st.permutations(buffers))
    elif kind == "drop": del buffers[i]
    elif kind == "add": buffers.insert(i, bytearray(draw(st.binary(max_size=24))))


# ------------------------------------------------------------------------------------------------------ checks
def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def same_wire(a, b) -> bool:
    "Bitwise equality of two wire batches: keys, offsets, seqlen cache, dtypes, values, object items."
    if list(a.keys()) != list(b.keys()) or a.batch_size != b.batch_size: return False
    for key in a.keys():
        x, y = a.get(key), b.get(key)
        if is_jagged(x):
            if not (is_jagged(y) and torch.equal(x.offsets(), y.offsets()) and x.dtype == y.dtype
                    and (x._min_seqlen, x._max_seqlen) == (y._min_seqlen, y._max_seqlen)
                    and x.values().shape == y.values().shape
                    and torch.equal(x.values().contiguous().view(torch.uint8), y.values().contiguous().view(torch.uint8))):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                    and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))): return False
        elif x.tolist() != y.tolist(): return False
    return True


def check_consistent(td, header, buffers):
    "A batch that decoded: every size it declares matches its data, and its memory stays within the input's."
    budget = 4 * sum(len(b) for b in buffers) + 4096
    n = td.batch_size[0]
    for key in td.keys():
        leaf = td.get(key)
        if is_jagged(leaf):
            offsets, values = leaf.offsets(), leaf.values()
            assert offsets.dtype == torch.int64 and offsets.shape == (n + 1,), key
            assert int(offsets[0]) == 0 and int(offsets[-1]) == values.shape[0], key
            lengths = offsets.diff()
            assert bool((lengths >= 0).all()), key
            lo, hi = (int(lengths.min()), int(lengths.max())) if n else (0, 0)
            assert (leaf._min_seqlen, leaf._max_seqlen) == (lo, hi), key  # the cache is what the offsets say
            assert nbytes(values) <= budget and nbytes(offsets) <= budget, key
        elif isinstance(leaf, torch.Tensor):
            assert leaf.shape[0] == n and nbytes(leaf) <= budget, key
    schema = Schema.from_dict(header["schema"])
    assert schema.validate(td) is td  # the header's own schema binds what came out
    padded = materialize(td)
    for key, out in padded.items():
        leaf = td.get(key)
        if not is_jagged(leaf): continue
        longest = leaf._max_seqlen
        assert out.shape == (n, longest, *leaf.shape[2:]), key
        per_token = leaf.values().element_size() * math.prod(leaf.shape[2:])
        assert nbytes(out) <= budget + n * longest * per_token, key
    again = decode(*encode(td, schema=schema), allow_pickle=True)
    assert same_wire(again, td)


# ------------------------------------------------------------------------------------------------------ properties
@PROPERTY
@given(wire_batches(), st.booleans())
def test_property_valid_batches_round_trip(case, read_only):
    td, schema, has_objects = case
    header, buffers = encode(td, schema=schema)
    given_buffers = [bytes(b) if read_only else bytearray(b) for b in buffers]
    back = decode(header, given_buffers, allow_pickle=True)
    assert same_wire(back, td)
    check_consistent(back, header, given_buffers)
    if has_objects:
        with pytest.raises(WireFormatError, match="allow_pickle=True"):
            decode(header, given_buffers)
    else:
        assert same_wire(decode(header, given_buffers), td)  # no object column: the default decodes it


@MUTATIONS
@given(wire_batches(), st.data())
def test_property_mutated_input_raises_wire_format_error_or_decodes_consistently(case, data):
    td, schema, _ = case
    header, buffers = encode(td, schema=schema)
    original = (copy.deepcopy(header), [bytes(b) for b in buffers])
    bad_header, bad_buffers = copy.deepcopy(header), [bytearray(b) for b in buffers]
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()): mutate_header(data.draw, bad_header)
        else: mutate_buffers(data.draw, bad_buffers)
    read_only = data.draw(st.booleans())
    given_buffers = [bytes(b) if read_only else b for b in bad_buffers]
    try:
        back = decode(bad_header, given_buffers, allow_pickle=data.draw(st.sampled_from([True, True, True, False])))
    except WireFormatError as e:
        assert isinstance(e, ValueError) and str(e)
        return
    if (bad_header, [bytes(b) for b in bad_buffers]) == original: assert same_wire(back, td)
    check_consistent(back, bad_header, given_buffers)


@PROPERTY
@given(wire_batches(), st.data())
def test_property_any_header_value_replaced_by_junk(case, data):
    "Every header entry, one at a time, replaced by junk: WireFormatError or a consistent batch, nothing else."
    td, schema, _ = case
    header, buffers = encode(td, schema=schema)
    for path in list(json_paths(header)):
        bad = copy.deepcopy(header)
        parent_of(bad, path)[path[-1]] = data.draw(JUNK)
        try: back = decode(bad, buffers, allow_pickle=True)
        except WireFormatError: continue
        check_consistent(back, bad, buffers)


# ----------------------------------------------------------------------------------------------- explicit cases
def rl_wire():
    schema = Schema([FieldSpec("input_ids", "token", torch.int64), FieldSpec("logprobs", "token", torch.float32),
                     FieldSpec("reward", "sample", torch.float32), FieldSpec("prompt", "object")])
    wire = pack_jagged_fields({"input_ids": torch.arange(15).reshape(3, 5), "logprobs": -torch.rand(3, 5),
                               "reward": torch.ones(3), "prompt": object_array(["a", None, "c"])},
                              lengths=torch.tensor([5, 2, 4]), schema=schema)
    return wire, schema


def with_group(header, **changes):
    return {**header, "groups": [{**header["groups"][0], **changes}]}


@pytest.mark.parametrize("claim", [1, 10**9])
def test_max_seqlen_claims_are_checked_against_the_offsets(claim):
    "A header claiming a longest row of 1 (rows would be cut) or 10**9 (24 GB for 3 rows) is refused."
    wire, schema = rl_wire()
    header, buffers = encode(wire, schema=schema)
    with pytest.raises(WireFormatError, match=r"claims rows of 2\.\.%d tokens, its offsets give 2\.\.5" % claim):
        decode(with_group(header, max_seqlen=claim), buffers, allow_pickle=True)
    with pytest.raises(WireFormatError, match=r"claims rows of 0\.\.5 tokens"):
        decode(with_group(header, min_seqlen=0), buffers, allow_pickle=True)
    back = decode(header, buffers, allow_pickle=True)
    assert back.get("input_ids")._max_seqlen == 5 and back.get("logprobs")._min_seqlen == 2
    assert torch.nested.to_padded_tensor(back.get("input_ids"), 0).shape == (3, 5)


def test_pickles_are_refused_by_default_and_say_how_to_opt_in():
    wire, schema = rl_wire()
    header, buffers = encode(wire, schema=schema)
    with pytest.raises(WireFormatError, match=r"\['prompt'\].*runs code chosen by the sender.*allow_pickle=True"):
        decode(header, buffers)
    assert decode(header, buffers, allow_pickle=True).get("prompt").tolist() == ["a", None, "c"]
    assert pickle.loads(pickle.dumps(WireBatch(wire), protocol=5)).td.get("prompt").tolist() == ["a", None, "c"]
    with pytest.raises(TypeError, match="allow_pickle: expected a bool"):
        decode(header, buffers, allow_pickle="yes")


def test_header_schema_binds_dtype_duplicates_and_groups():
    wire, schema = rl_wire()
    header, buffers = encode(wire, schema=schema)
    retyped = copy.deepcopy(header)
    retyped["fields"][0]["dtype"] = "float64"  # same size as int64: would load the ids as garbage floats
    with pytest.raises(WireFormatError, match="field 'input_ids': the header says dtype float64, its schema declares int64"):
        decode(retyped, buffers, allow_pickle=True)
    duplicated = copy.deepcopy(header)
    duplicated["fields"][1]["name"] = "input_ids"  # would silently drop a column
    with pytest.raises(WireFormatError, match=r"\['input_ids'\] appear more than once"):
        decode(duplicated, buffers, allow_pickle=True)
    regrouped = copy.deepcopy(header)
    regrouped["fields"][2]["group"] = "default"
    with pytest.raises(WireFormatError, match="field 'reward': the header says group 'default', its schema declares None"):
        decode(regrouped, buffers, allow_pickle=True)


BAD_HEADERS = {
    "not a dict": lambda h: [h],
    "fields not a list": lambda h: {**h, "fields": {"0": h["fields"][0]}},
    "n a string": lambda h: {**h, "n": "3"},
    "n a bool": lambda h: {**h, "n": True},
    "n negative": lambda h: {**h, "n": -3},
    "n huge": lambda h: {**h, "n": 10**40},
    "version a bool": lambda h: {**h, "version": True},
    "buffer index out of range": lambda h: {**h, "fields": [{**h["fields"][0], "buffer": 40}, *h["fields"][1:]]},
    "buffer index a float": lambda h: {**h, "fields": [{**h["fields"][0], "buffer": 1.0}, *h["fields"][1:]]},
    "total a string": lambda h: with_group(h, total="11"),
    "total huge": lambda h: with_group(h, total=2**63),
    "shape negative": lambda h: {**h, "fields": [{**h["fields"][0], "shape": [-1]}, *h["fields"][1:]]},
    "field entry a list": lambda h: {**h, "fields": [["input_ids"], *h["fields"][1:]]},
    "group entry missing a key": lambda h: {**h, "groups": [{k: v for k, v in h["groups"][0].items() if k != "total"}]},
    "schema not a dict": lambda h: {**h, "schema": "schema"},
    "schema with a duplicate": lambda h: {**h, "schema": {"fields": h["schema"]["fields"] * 2}},
    "kind unknown": lambda h: {**h, "fields": [{**h["fields"][0], "kind": "ragged"}, *h["fields"][1:]]},
}


@pytest.mark.parametrize("name", list(BAD_HEADERS))
def test_malformed_headers_raise_wire_format_error(name):
    wire, schema = rl_wire()
    header, buffers = encode(wire, schema=schema)
    with pytest.raises(WireFormatError):
        decode(BAD_HEADERS[name](copy.deepcopy(header)), buffers, allow_pickle=True)


def test_offsets_must_rise_from_zero_to_the_values_length():
    wire, schema = rl_wire()
    header, buffers = encode(wire, schema=schema)
    offsets = np.frombuffer(bytes(buffers[0]), np.int64)
    for bad, words in (([0, 5, 4, 11], "must not decrease: row 1 runs from 5 to 4"), ([1, 5, 7, 11], "from 0 to its total 11"),
                       ([0, 5, 7, 12], "from 0 to its total 11, got 0..12"),
                       ([0, 2**62 + 2**61, -2**62, 11], "must not decrease")):
        changed = [np.array(bad, np.int64).tobytes(), *buffers[1:]]
        with pytest.raises(WireFormatError, match=words):
            decode(header, changed, allow_pickle=True)
    assert offsets.tolist() == [0, 5, 7, 11]


def test_buffers_of_the_wrong_kind_or_size():
    wire, schema = rl_wire()
    header, buffers = encode(wire, schema=schema)
    for bad in (None, 7, b"bytes", [*buffers[:1], "text", *buffers[2:]], [*buffers, b""], buffers[:-1],
                [*buffers[:1], bytes(buffers[1]) + b"\0" * 8, *buffers[2:]],
                [*buffers[:-1], pickle.dumps(["only one item"])], [*buffers[:-1], b"\x80\x05\x95garbage"]):
        with pytest.raises(WireFormatError):
            decode(header, bad, allow_pickle=True)


def test_zero_size_rows_claiming_huge_lengths_stay_cheap():
    "A per-token shape of 0 carries no bytes whatever the rows claim: decoding and padding allocate nothing large."
    schema = Schema([FieldSpec("empty", "token", torch.float32, trailing_shape=(0,))])
    header = {"format": "xtoken_dp.wire", "version": 1, "n": 1, "schema": schema.to_dict(),
              "groups": [{"name": "default", "offsets": 0, "min_seqlen": 2**40, "max_seqlen": 2**40, "total": 2**40}],
              "fields": [{"name": "empty", "kind": "token", "buffer": 1, "group": "default", "dtype": "float32", "shape": [0]}]}
    td = decode(header, [np.array([0, 2**40], np.int64).tobytes(), b""])
    assert td.get("empty").values().shape == (2**40, 0)
    assert materialize(td)["empty"].shape == (1, 2**40, 0)
    with pytest.raises(WireFormatError, match="expected an int >= 0 and <= %d" % MAX_WIRE_COUNT):
        decode(with_group(header, total=2**62 + 1), [np.array([0, 2**62 + 1], np.int64).tobytes(), b""])
