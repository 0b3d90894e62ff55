"""Projection files and the pure cores: safety, parsing, declared sizes, and property tests against plain reference
implementations.

The builder on real tokenizers is in `test_projection_builder.py`, the command line in `test_projection_cli.py`.
"""
import collections, os, re, subprocess, sys, textwrap, warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from xtoken_dp.projection import (ProjectionFileError, UnsafeProjectionFileError, accumulate_triplets,
                                  check_projection_metadata, describe_projection_file, exact_token_map_from_topk,
                                  load_dense_projection, load_projection_object, parse_projection_file,
                                  projection_invariant_violations, read_projection_metadata, sort_and_cut,
                                  sparse_projection_from_coo)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("XTOKEN_DP_HYPOTHESIS_EXAMPLES", "60"))


# ---------------------------------------------------------------- safety

class Sentinel:
    "Unpickling this would create a file; a safe loader must never do it."
    def __init__(self, path): self.path = str(path)
    def __reduce__(self): return (Path.touch, (Path(self.path),))


class Printer:
    "Unpickling this would print."
    def __reduce__(self): return (print, ("unpickled",))


def test_custom_class_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "was_unpickled"
    path = tmp_path / "evil.pt"
    torch.save({"indices": torch.zeros(1, 1, dtype=torch.long), "likelihoods": torch.ones(1, 1),
                "payload": Sentinel(marker)}, path)
    with pytest.raises(UnsafeProjectionFileError, match="pathlib") as info:
        parse_projection_file(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value) and "convert" in str(info.value)
    assert not marker.exists()
    for reader in (read_projection_metadata, load_projection_object, load_dense_projection, describe_projection_file):
        with pytest.raises(UnsafeProjectionFileError): reader(path)
    assert not marker.exists()


def test_refusal_names_the_file_and_every_global(tmp_path):
    path = tmp_path / "two.pt"
    torch.save({"indices": torch.zeros(1, 1, dtype=torch.long), "likelihoods": torch.ones(1, 1),
                "a": Sentinel(tmp_path / "m1"), "b": Printer()}, path)
    with pytest.raises(UnsafeProjectionFileError) as info:
        parse_projection_file(path)
    e = info.value
    assert e.path == str(path) and {"builtins.print", "pathlib.Path"} <= set(e.unsafe_globals)
    for name in e.unsafe_globals: assert repr(name) in str(e)
    assert not (tmp_path / "m1").exists()
    assert str(path) in str(e) and "weights_only=True" in str(e) and "--trust-source" in str(e)
    assert UnsafeProjectionFileError.__doc__ and "names the file" in UnsafeProjectionFileError.__doc__


def test_numpy_scalar_keys_and_values_load(tmp_path):
    path = tmp_path / "np.pt"
    torch.save({(np.int64(2), np.int32(5)): np.float64(1.5), (np.uint8(0), np.int16(-1)): np.float32(2)}, path)
    coo, values, v_s, v_t = parse_projection_file(path)
    assert coo.tolist() == [[0, 2], [-1, 5]] and values.tolist() == [2.0, 1.5] and (v_s, v_t) == (3, 6)


def test_numpy_arrays_are_not_allowed(tmp_path):
    "Only numpy scalars are allowed: an ndarray needs `_reconstruct`, which the safe loader refuses."
    path = tmp_path / "arr.pt"
    torch.save({"indices": np.zeros((2, 2), dtype=np.int64), "likelihoods": np.ones((2, 2))}, path)
    with pytest.raises(UnsafeProjectionFileError, match="_reconstruct"):
        parse_projection_file(path)


def test_no_unsafe_load_outside_convert():
    "Grep the package: `weights_only=False` appears only inside `convert_projection_file`."
    pattern = re.compile(r"weights_only\s*=\s*False")
    offenders = []
    for module in sorted((ROOT / "xtoken_dp").glob("*.py")):
        lines = module.read_text().splitlines()
        for lineno, line in enumerate(lines, 1):
            if not pattern.search(line): continue
            enclosing = next((l for l in reversed(lines[:lineno]) if re.match(r"def \w+", l)), "")
            if not (module.name == "projection.py" and enclosing.startswith("def convert_projection_file(")):
                offenders.append(f"{module.name}:{lineno}: {line.strip()}")
    assert offenders == []
    assert pattern.search((ROOT / "xtoken_dp" / "projection.py").read_text())  # the grep can find it


def test_corrupt_and_missing_files(tmp_path):
    (tmp_path / "zip.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ValueError, match="zip.pt") as info:
        parse_projection_file(tmp_path / "zip.pt")
    assert info.value.__cause__ is not None
    with pytest.raises(FileNotFoundError, match="absent.pt"):
        parse_projection_file(tmp_path / "absent.pt")


# ---------------------------------------------------------------- parsing real files

def test_int32_indices_and_half_weights_are_widened(tmp_path):
    path = tmp_path / "d.pt"
    torch.save({"indices": torch.tensor([[3, -1]], dtype=torch.int32),
                "likelihoods": torch.tensor([[1.0, 0.0]], dtype=torch.float16), "model_A_id": "s", "model_B_id": "t"},
               path)
    coo, values, v_s, v_t = parse_projection_file(path)
    assert (coo.dtype, values.dtype, v_s, v_t) == (torch.int64, torch.float32, 1, 4)
    meta = read_projection_metadata(path)
    assert (meta["student_model_id"], meta["teacher_model_id"]) == ("s", "t")


@pytest.mark.parametrize("obj, field", [
    ({"indices": torch.zeros(2, 2), "likelihoods": torch.zeros(2, 2)}, "'indices' must be an integer"),
    ({"indices": torch.zeros(2, 2, dtype=torch.long), "likelihoods": torch.zeros(2, 2, dtype=torch.long)},
     "'likelihoods' must be a floating"),
    ({"indices": torch.zeros(2, dtype=torch.long), "likelihoods": torch.zeros(2)}, "'indices' must be a dense 2-D"),
    ({"indices": [[0]], "likelihoods": torch.zeros(1, 1)}, "'indices' must be a torch.Tensor"),
    ({"indices": torch.zeros(1, 1, dtype=torch.long), "likelihoods": torch.tensor([[float("inf")]])}, "finite"),
    ({(0, 1): 1.0, (2, 3, 4): 1.0}, "(2, 3, 4)"),
    ({(0.5, 1): 1.0}, "integer pairs"),
    ({(0, 1): float("inf")}, "finite"),
    ({(0, 1): 1e39}, "finite float32"),
    ({(0, 1): True}, "numbers"),
    ({"a": 1}, "['a']"),
    ("text", "got str"),
])
def test_invalid_files_name_the_field(tmp_path, obj, field):
    path = tmp_path / "bad.pt"
    torch.save(obj, path)
    with pytest.raises(ValueError, match=re.escape(field)):
        parse_projection_file(path)


# ---------------------------------------------------------------- declared sizes against the tensors

DENSE = {"indices": torch.tensor([[0, 1], [2, -1], [-1, -1]]), "likelihoods": torch.tensor([[.5, .5], [1., 0.], [0., 0.]])}
READERS = [read_projection_metadata, parse_projection_file, load_dense_projection, describe_projection_file]


@pytest.mark.parametrize("metadata, field, expected, found", [
    ({"student_vocab_size": 4}, "student_vocab_size", "3, the rows of 'indices'", "4"),
    ({"teacher_vocab_size": 2}, "teacher_vocab_size", ">= 3, one more than the largest teacher id", "2"),
    ({"teacher_vocab_size": 5e9}, "teacher_vocab_size", "an int, >= 3", "float 5000000000.0"),
    ({"teacher_vocab_size": 5_000_000_000, "report": {"teacher_vocab_size": 3}}, "report['teacher_vocab_size']",
     "5000000000, as 'teacher_vocab_size' declares", "3"),
    ({"report": {"student_vocab_size": 5_000_000_000}}, "report['student_vocab_size']", "3", "5000000000"),
    ({"builder": {"top_k": 4}}, "builder['top_k']", "2, the slots per row", "4"),
    ({"report": {"top_k": -1}}, "report['top_k']", "2", "-1"),
    ({"report": {"nonempty_rows": 3}}, "report['nonempty_rows']", "2, the rows of 'indices' holding a teacher id", "3"),
    ({"report": {"empty_rows": 0}}, "report['empty_rows']", "1", "0"),
    ({"report": {"entries_per_row": [1, 1, 1]}}, "report['entries_per_row']", "[1, 1, 1]", None),
    ({"report": {"entries_per_row": [1, 1, 2]}}, "report['entries_per_row']", "[1, 1, 1], counted", "[1, 1, 2]"),
    ({"report": {"exact_rows": 2}, "exact_student_ids": torch.tensor([1])}, "report['exact_rows']", "1", "2"),
    ({"exact_student_ids": torch.tensor([3])}, "exact_student_ids", "row ids in [0, 3)", "ids from 3 to 3"),
    ({"exact_student_ids": torch.tensor([[1]])}, "exact_student_ids", "a 1-D integer tensor", "a Tensor with 2 dimensions"),
    ({"report": "fine"}, "report", "a dict", "str"),
])
def test_declared_sizes_must_match_the_tensors(tmp_path, metadata, field, expected, found):
    path = tmp_path / "declares.pt"
    torch.save({**DENSE, **metadata}, path)
    if found is None:                                                  # consistent: every reader accepts it
        for reader in READERS: reader(path)
        return
    for reader in READERS:
        with pytest.raises(ProjectionFileError) as info:
            reader(path)
        e = info.value
        assert isinstance(e, ValueError) and (e.path, e.field) == (str(path), field)
        assert expected in str(e.expected) and str(e.found).startswith(found)
        assert str(e).startswith(f"{path}: {field}: expected ")


def test_consistent_metadata_of_a_built_file_passes(tmp_path):
    from xtoken_dp.projection import build_projection, PieceVocabulary
    pieces = [None, None, b"a", b"b", b"ab", b" "]
    encode = lambda texts: [[{"a": 2, "b": 3, " ": 5}[c] for c in t] for t in texts]
    vocab = PieceVocabulary(pieces, {0: ("bos",), 1: ("eos",)}, False, encode, "toy")
    built = build_projection(vocab, vocab, progress=False)
    path = built.save(tmp_path / "built.pt")
    meta = read_projection_metadata(path)
    assert meta["report"]["top_k"] == 4 and meta["student_vocab_size"] == len(pieces)
    assert "exact map" in describe_projection_file(path)


def test_inspect_allocates_nothing_for_a_declared_vocabulary(tmp_path):
    "A file may declare a teacher vocabulary far larger than its ids: inspect must not size anything by it."
    path, warm = tmp_path / "big.pt", tmp_path / "warm.pt"
    torch.save({**DENSE, "teacher_vocab_size": 5_000_000_000}, path)
    torch.save(DENSE, warm)
    script = textwrap.dedent(f"""
        import re, resource
        from xtoken_dp.projection import describe_projection_file
        describe_projection_file({str(warm)!r})      # imports and a first parse happen before the limit
        vm = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 768 * 2**20, resource.RLIM_INFINITY))   # 5 GB cannot fit
        text = describe_projection_file({str(path)!r})
        assert "teacher vocab 5,000,000,000" in text, text
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


class TensorOfDeclaredShape:
    "Pickles as a tensor whose declared shape is far larger than the 32 bytes of data the file holds."
    def __reduce__(self):
        storage = torch.storage.TypedStorage(wrap_storage=torch.zeros(4, dtype=torch.long).untyped_storage(),
                                             dtype=torch.long, _internal=True)
        return (torch._utils._rebuild_tensor_v2, (storage, 0, (2_500_000_000, 2), (2, 1), False, collections.OrderedDict()))


def test_a_tensor_shape_beyond_its_data_is_refused(tmp_path):
    path = tmp_path / "shape.pt"
    torch.save({"indices": TensorOfDeclaredShape(), "likelihoods": torch.zeros(1, 2)}, path)
    for reader in READERS:
        with pytest.raises(ValueError, match=re.escape(str(path))): reader(path)


@st.composite
def odd_values(draw):
    "Scalars, tensors of any dtype and shape, and small containers of them: what a malformed file may hold."
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32, torch.float16,
                                  torch.complex64]))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    tensor = (torch.arange(int(np.prod(shape)) if shape else 1) - 2).reshape(shape or ()).to(dtype)
    scalar = draw(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=3)))
    return draw(st.sampled_from([tensor, scalar, [scalar, tensor], {"top_k": scalar}, (scalar,), {scalar: tensor}
                                 if not isinstance(scalar, float) else {}]))


KEYS = ["indices", "likelihoods", "exact_student_ids", "student_vocab_size", "teacher_vocab_size", "builder", "report",
        "canonical_student_ids"]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(obj=st.one_of(
    st.dictionaries(st.sampled_from(KEYS), odd_values(), max_size=5),
    st.builds(lambda extra: {**DENSE, **extra}, st.dictionaries(st.sampled_from(KEYS[2:]), odd_values(), max_size=3)),
    st.dictionaries(st.tuples(st.integers(-3, 2**64), st.integers(-3, 5)), odd_values(), max_size=3),
    odd_values()))
def test_malformed_files_raise_value_errors_only(tmp_path, obj):
    path = tmp_path / "odd.pt"
    torch.save(obj, path)
    for reader in READERS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reader(path)
        except ValueError as e:
            assert str(path) in str(e) or "projection" in str(e), str(e)

# ---------------------------------------------------------------- property tests against references

def dense_reference(coo, values, v_s, v_t):
    "The matrix the sparse loader must equal, built entry by entry."
    out = np.zeros((v_s, v_t), dtype=np.float64)
    for (s, t), v in zip(coo.T.tolist(), values.tolist()):
        if t >= 0: out[s, t] += v
    return torch.from_numpy(out).float()


@st.composite
def dense_files(draw, max_rows=12, max_k=4, max_teacher=10):
    rows, k = draw(st.integers(0, max_rows)), draw(st.integers(1, max_k))
    ids = draw(st.lists(st.integers(-1, max_teacher - 1), min_size=rows * k, max_size=rows * k))
    weights = draw(st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.4, 0.5, 0.6, 0.7, 0.9, 1.0]),
                            min_size=rows * k, max_size=rows * k))
    return torch.tensor(ids, dtype=torch.long).reshape(rows, k), torch.tensor(weights).reshape(rows, k)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=dense_files(), extra_s=st.integers(0, 5), extra_t=st.integers(0, 5), normalize=st.booleans())
def test_sparse_matrix_equals_dense_reference(tmp_path, data, extra_s, extra_t, normalize):
    indices, likelihoods = data
    path = tmp_path / "p.pt"
    torch.save({"indices": indices, "likelihoods": likelihoods}, path)
    coo, values, v_rows, v_t = parse_projection_file(path)
    assert coo.shape == (2, indices.numel()) and v_rows == indices.shape[0]
    kept_t = coo[1][coo[1] >= 0]
    kept_s = coo[0][coo[1] >= 0]
    size_s = max(extra_s, int(kept_s.max()) + 1 if kept_s.numel() else 0)
    size_t = max(extra_t, int(kept_t.max()) + 1 if kept_t.numel() else 0)
    m = sparse_projection_from_coo(coo, values, student_vocab_size=extra_s, teacher_vocab_size=extra_t,
                                   row_normalize=normalize, device="cpu")
    assert m.is_coalesced() and m.dtype == torch.float32 and m.shape == (size_s, size_t)
    reference = dense_reference(coo, values, size_s, size_t)
    if normalize:
        sums = reference.sum(1, keepdim=True)
        reference = torch.where(sums > 0, reference / sums.clamp_min(1e-30), reference)
    torch.testing.assert_close(m.to_dense(), reference)


def exact_map_reference(indices, likelihoods, *, xtoken_loss, teacher_vocab_size, student_vocab_size=None,
                        tol=1e-6, threshold=0.6, certified=None, canonical=None):
    "The strict and relaxed exact-map rules transcribed row by row, in plain Python (canonical rows win collisions)."
    winners = {}
    for s, (ids, ws) in enumerate(zip(indices.tolist(), likelihoods.tolist())):
        live = [(w if t >= 0 else 0.0) for t, w in zip(ids, ws)]
        w1 = max(live)
        if w1 <= 0: continue
        j1 = live.index(w1)
        t1 = ids[j1]
        if xtoken_loss: ok = w1 >= threshold
        else:
            ok = w1 >= 1 - tol and all(w <= tol for j, w in enumerate(live) if j != j1)
            if certified is not None: ok = ok and s in certified
        if not ok or not (0 <= t1 < teacher_vocab_size): continue
        preferred = canonical is not None and s in canonical
        best = winners.get(t1)
        if best is None or (preferred and not best[2]): winners[t1] = (s, w1, preferred)
        elif preferred == best[2] and xtoken_loss and w1 > best[1]: winners[t1] = (s, w1, preferred)
    pairs = sorted((s, t) for t, (s, _, _) in winners.items())
    n_s = max(indices.shape[0], student_vocab_size or 0)
    common_s, common_t = [s for s, _ in pairs], [t for _, t in pairs]
    return [common_s, common_t, [s for s in range(n_s) if s not in set(common_s)],
            [t for t in range(teacher_vocab_size) if t not in set(common_t)]]


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(data=dense_files(), xtoken_loss=st.booleans(), v_t=st.integers(0, 12), v_s=st.none() | st.integers(0, 15),
       certified=st.none() | st.sets(st.integers(0, 12), max_size=6),
       canonical=st.none() | st.sets(st.integers(0, 12), max_size=6))
def test_exact_map_matches_row_by_row_reference(data, xtoken_loss, v_t, v_s, certified, canonical):
    indices, likelihoods = data
    expected = exact_map_reference(indices, likelihoods, xtoken_loss=xtoken_loss, teacher_vocab_size=v_t,
                                   student_vocab_size=v_s, certified=None if xtoken_loss else certified,
                                   canonical=canonical)
    ids = None if certified is None else torch.tensor(sorted(certified), dtype=torch.long)
    preferred = None if canonical is None else torch.tensor(sorted(canonical), dtype=torch.long)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = exact_token_map_from_topk(indices, likelihoods, xtoken_loss=xtoken_loss, teacher_vocab_size=v_t,
                                           student_vocab_size=v_s, allow_empty=True, exact_student_ids=ids,
                                           canonical_student_ids=preferred)
    got = [result[k].tolist() for k in ("common_student", "common_teacher", "uncommon_student", "uncommon_teacher")]
    assert got == expected
    assert [w.category for w in caught] == ([RuntimeWarning] if not expected[0] else [])
    if not expected[0]:
        with pytest.raises(ValueError, match="tail L1"):
            exact_token_map_from_topk(indices, likelihoods, xtoken_loss=xtoken_loss, teacher_vocab_size=v_t,
                                      student_vocab_size=v_s, exact_student_ids=ids)


def test_exact_map_keyword_only_and_types():
    i, w = torch.tensor([[0]]), torch.tensor([[1.0]])
    with pytest.raises(TypeError): exact_token_map_from_topk(i, w, False, 1)
    with pytest.raises(TypeError, match="teacher_vocab_size"):
        exact_token_map_from_topk(i, w, xtoken_loss=False, teacher_vocab_size=True)


# ---------------------------------------------------------------- builder arithmetic against references

@settings(max_examples=EXAMPLES, deadline=None)
@given(triplets=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 8), st.sampled_from([0.0, 0.001, 0.1, 0.5, 1.0, 2.0])),
                         max_size=40),
       top_k=st.integers(1, 4))
def test_accumulate_and_cut_match_reference(triplets, top_k):
    s = np.array([a for a, _, _ in triplets], dtype=np.int64)
    t = np.array([b for _, b, _ in triplets], dtype=np.int64)
    w = np.array([c for _, _, c in triplets], dtype=np.float64)
    rows = {}
    for a, b, c in triplets: rows.setdefault(a, {}).setdefault(b, 0.0); rows[a][b] += c
    ss, tt, ww = accumulate_triplets(s, t, w, 9)
    assert list(zip(ss.tolist(), tt.tolist())) == sorted((a, b) for a, d in rows.items() for b, c in d.items() if c)
    indices, likelihoods, dropped = sort_and_cut(ss, tt, ww, 7, top_k)
    assert projection_invariant_violations(indices, likelihoods, 9) == []
    for a in range(7):
        entries = sorted(((-c, b) for b, c in rows.get(a, {}).items() if c), key=lambda x: (x[0], x[1]))
        total = -sum(c for c, _ in entries)
        kept = entries[:top_k]
        expected_ids = [b for _, b in kept] + [-1] * (top_k - len(kept))
        assert indices[a].tolist() == expected_ids
        if kept:
            kept_total = -sum(c for c, _ in kept)
            np.testing.assert_allclose(likelihoods[a, :len(kept)].numpy(), [-c / kept_total for c, _ in kept], rtol=1e-6)
            np.testing.assert_allclose(dropped[a], 1 - kept_total / total, atol=1e-12)
