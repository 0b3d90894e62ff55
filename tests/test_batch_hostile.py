"""Hostile batch directories: `DataProto.load` and `RewardData.load_memmap` treat every claim of a folder as a claim.

Valid `DataProto`s and `RewardData` (jagged and dense fields, object columns, `meta_info`, empty batches) are saved,
then their manifest or their data files are mutated at random: keys deleted or retyped, numbers made random, huge,
negative, bool or str, dtype names swapped, entries duplicated, bytes of the manifest flipped; data files truncated,
extended, deleted, given a stray neighbour, flipped in place, offsets made to decrease. Loading must then either
raise `BatchDirectoryError` / `FileNotFoundError`, or return what the folder truly holds:

* after a manifest edit, the original batch. The only claims with no second record to check them against are the
  names and declarations of object columns (`declared_schema`, an object column's key) and whether an empty
  batch is present (`batch_present` with no tensor field); an edit there may load the same data under the edited
  declaration, and nothing else;
* after bytes of a data file are flipped in place (no checksum can tell), a batch that passes every check of its
  class, of the original's structure, whose buffers are exactly the files' bytes.

Never any other exception, never loaded tensors larger than the folder, never a cached row length the offsets do
not have (it is what padding allocates). Set `XTOKEN_DP_HYPOTHESIS_EXAMPLES` to run more examples (default 25).
"""
import json
import os
import sys
import pickle
import resource
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from json_paths import json_paths

from xtoken_dp.batch import MANIFEST_NAME, BatchClassError, BatchDirectoryError, DataProto, DistillBatch, RewardData
from xtoken_dp.codec import object_array
from xtoken_dp.schema import FieldSpec, Schema, lengths_to_offsets, make_jagged
from xtoken_dp.tensorclasses import flatten_tensorclass

EXAMPLES = int(os.environ.get("XTOKEN_DP_HYPOTHESIS_EXAMPLES", "25"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REFUSED = (BatchDirectoryError, FileNotFoundError)
DTYPES = ["int64", "float64", "int32", "float32", "bool", "bfloat16", "uint8", "int16", "float16", "complex64", "qint8"]


# ------------------------------------------------------------------------------------------------- valid batches
def data_proto(n: int, seed: int, declared: bool, meta: bool, tensors: bool = True) -> DataProto:
    "Two token groups (one with trailing dims), a bf16 sample, an int rect, a string column, maybe meta_info."
    g = torch.Generator().manual_seed(seed)
    tok = lengths_to_offsets(torch.randint(0, 5, (n,), generator=g))
    chunk = lengths_to_offsets(torch.randint(0, 3, (n,), generator=g))
    T, C = int(tok[-1]), int(chunk[-1])
    batch = TensorDict({"input_ids": make_jagged(torch.randint(0, 1000, (T,), generator=g), tok),
                        "logprobs": make_jagged(-torch.rand(T, generator=g), tok),
                        "mask": make_jagged(torch.rand(T, generator=g) < .5, tok),
                        "topk": make_jagged(torch.randint(0, 9, (C, 2), generator=g, dtype=torch.int32), chunk),
                        "reward": torch.rand(n, generator=g).to(torch.bfloat16),
                        "extra": torch.arange(3 * n).reshape(n, 3)}, batch_size=[n]) if tensors else None
    specs = [FieldSpec("input_ids", "token", torch.int64, pad_value=-1, group="tok"),
             FieldSpec("logprobs", "token", torch.float32, group="tok"), FieldSpec("mask", "token", torch.bool, group="tok"),
             FieldSpec("topk", "token", torch.int32, group="chunk", trailing_shape=(2,)),
             FieldSpec("reward", "sample", torch.bfloat16), FieldSpec("extra", "rect", torch.int64)] if tensors else []
    schema = Schema(specs + [FieldSpec("uid", "object")]) if declared else None
    return DataProto(batch, {"uid": object_array(f"u{seed}-{i}" for i in range(n))},
                     {"step": seed, "tags": ["a", 1.5]} if meta else {}, schema=schema)


def reward_data(n: int, seed: int, rewards: bool) -> RewardData:
    g = torch.Generator().manual_seed(seed)
    offsets = lengths_to_offsets(torch.randint(0, 5, (n,), generator=g))
    total = int(offsets[-1])
    return RewardData(make_jagged(torch.randint(0, 100, (total,), generator=g), offsets),
                      make_jagged(torch.rand(total, generator=g) < .8, offsets),
                      make_jagged(torch.randn(total, generator=g), offsets) if rewards else None,
                      torch.rand(n, generator=g), batch_size=[n])


def distill_batch(n: int, seed: int) -> DistillBatch:
    "Teacher 0 cross-tokenizer (alignment, top-k), teacher 1 same-vocab: a tree four levels deep."
    g = torch.Generator().manual_seed(seed)
    s_len, t_len = torch.randint(1, 5, (n,), generator=g), torch.randint(1, 4, (n,), generator=g)
    nc = torch.minimum(torch.minimum(s_len, t_len), torch.randint(1, 3, (n,), generator=g))
    S, T, P = int(s_len.max()) if n else 1, int(t_len.max()) if n else 1, int(nc.max()) if n else 1
    def chunk_ids(lengths, width):
        pos = torch.arange(width)[None, :]
        return torch.where(pos < lengths[:, None], (pos * nc[:, None]) // lengths[:, None].clamp(min=1), -1)
    s_cid, t_cid, valid = chunk_ids(s_len, S), chunk_ids(t_len, T), torch.arange(P) < nc[:, None]
    flat = {"input_ids": torch.randint(0, 99, (n, S), generator=g), "input_lengths": s_len,
            "token_mask": torch.arange(S) < s_len[:, None], "sample_mask": torch.ones(n), "idx": torch.arange(n),
            "teacher_0_input_ids": torch.randint(0, 99, (n, T), generator=g), "teacher_0_input_lengths": t_len,
            "teacher_0_token_mask": torch.arange(T) < t_len[:, None],
            "teacher_0_topk_ids": torch.zeros(n, T, 2, dtype=torch.int32), "teacher_0_topk_logprobs": torch.zeros(n, T, 2),
            "alignment_0_pair_valid": valid, "alignment_0_pair_is_correct": valid,
            "alignment_0_student_exact_partition_mask": s_cid == 0, "alignment_0_teacher_exact_partition_mask": t_cid == 0,
            "alignment_0_student_chunk_id": s_cid, "alignment_0_teacher_chunk_id": t_cid, "alignment_0_num_chunks": nc}
    return DistillBatch.from_flat(flat, teacher_layout=(True, False))


@st.composite
def saved_batches(draw):
    "('dp' | 'rd' | 'db', the batch)."
    n, seed = draw(st.integers(0, 4)), draw(st.integers(0, 10**6))
    kind = draw(st.sampled_from(["dp", "dp", "rd", "db"]))
    if kind == "dp":
        return "dp", data_proto(n, seed, draw(st.booleans()), draw(st.booleans()), tensors=draw(st.integers(0, 5)) > 0)
    if kind == "db": return "db", distill_batch(n, seed)
    return "rd", reward_data(n, seed, draw(st.booleans()))


def load(kind: str, folder: Path, device=None):
    if kind == "dp": return DataProto.load(folder, device=device, allow_pickle=True)
    return (RewardData if kind == "rd" else DistillBatch).load_memmap(folder, device=device)


# ------------------------------------------------------------------------------------------------- what came back
def raw(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def file_values(t: torch.Tensor, data: bytes) -> bool:
    "The tensor holds the file's bytes; a bool byte other than 0 or 1 holds True (a copy writes it as 1)."
    if t.dtype != torch.bool: return raw(t) == data
    return (np.frombuffer(raw(t), np.uint8) != 0).tolist() == (np.frombuffer(data, np.uint8) != 0).tolist()


def columns_of(kind: str, obj) -> dict:
    "The tensor columns of a loaded batch by the manifest's field keys."
    if kind == "dp": return {} if obj.batch is None else {k: obj.batch.get(k) for k in obj.batch.keys()}
    return flatten_tensorclass(obj)[1]


def same_tensors(a: dict, b: dict) -> bool:
    if a.keys() != b.keys(): return False
    for key in a:
        x, y = a[key], b[key]
        if x.is_nested != y.is_nested or x.dtype != y.dtype: return False
        pairs = [(x.values(), y.values()), (x.offsets(), y.offsets())] if x.is_nested else [(x, y)]
        if any(p.shape != q.shape or raw(p) != raw(q) for p, q in pairs): return False
    return True


def same_objects(a: dict, b: dict, names_may_differ: bool) -> bool:
    if not names_may_differ and list(a) != list(b): return False
    return len(a) == len(b) and all(x.tolist() == y.tolist() for x, y in zip(a.values(), b.values()))


def same_batch(kind: str, loaded, original, lenient: bool) -> bool:
    if not same_tensors(columns_of(kind, loaded), columns_of(kind, original)): return False
    if kind == "rd": return type(loaded) is RewardData and (loaded.rewards is None) == (original.rewards is None)
    if kind == "db": return type(loaded) is DistillBatch and loaded.teacher_layout == original.teacher_layout
    if not same_objects(loaded.non_tensor_batch, original.non_tensor_batch, lenient): return False
    if pickle.dumps(loaded.meta_info) != pickle.dumps(original.meta_info): return False
    return lenient or (loaded.schema == original.schema and (loaded.batch is None) == (original.batch is None))


def tensor_nbytes(kind: str, obj) -> int:
    "Bytes of every distinct buffer of a loaded batch (values, offsets, dense)."
    seen, total = set(), 0
    for t in columns_of(kind, obj).values():
        for part in ((t.values(), t.offsets()) if t.is_nested else (t,)):
            key = (part.untyped_storage().data_ptr(), part.storage_offset(), part.numel())
            if key not in seen: seen.add(key); total += part.numel() * part.element_size()
    return total


def assert_honest(kind: str, obj, folder: Path):
    "Loaded tensors no larger than the folder; every cached row length is the offsets' (what padding sizes from)."
    folder_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert tensor_nbytes(kind, obj) <= 2 * folder_bytes + 4096
    for t in columns_of(kind, obj).values():
        if not t.is_nested or t.device.type == "meta": continue
        lengths = t.offsets().diff()
        real = (int(lengths.min()), int(lengths.max())) if lengths.numel() else (0, 0)
        assert (t._min_seqlen, t._max_seqlen) == real


def assert_is_the_files(kind: str, obj, folder: Path, original):
    "After bytes flipped in place: the structure of the original, every buffer exactly the bytes of its file."
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    columns, before = columns_of(kind, obj), columns_of(kind, original)
    assert columns.keys() == before.keys()
    offsets_of = {}
    for f in manifest["fields"]:
        t = columns[f["key"]]
        assert t.dtype == before[f["key"]].dtype and t.shape[1:] == before[f["key"]].shape[1:] or t.is_nested
        assert file_values(t.values() if t.is_nested else t, (folder / f["file"]).read_bytes()), f["key"]
        if t.is_nested: offsets_of[f["group"]] = t.offsets()
    for g in manifest["groups"]: assert raw(offsets_of[g["name"]]) == (folder / g["file"]).read_bytes(), g["name"]
    if kind == "dp":
        obj.validate(deep=True)
        for o in manifest["objects"]:
            assert obj.non_tensor_batch[o["key"]].tolist() == pickle.loads((folder / o["file"]).read_bytes()).tolist()
    elif kind == "rd": obj.validate()
    else:  # the alignments' own invariants are read by validate(), not on loading: only the rows are checked here
        assert obj.student.token_mask.offsets() is obj.student.offsets
        assert obj.teacher(0).alignment.student_chunk_id.offsets() is obj.student.offsets


# ------------------------------------------------------------------------------------------------- mutations
def changed_paths(a, b, path=()):
    "The paths where two JSON documents differ."
    if type(a) is not type(b): return [path]
    if isinstance(a, dict):
        return [p for k in a.keys() | b.keys()
                for p in ([path + (k,)] if k not in a or k not in b else changed_paths(a[k], b[k], path + (k,)))]
    if isinstance(a, list):
        if len(a) != len(b): return [path]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in changed_paths(x, y, path + (i,))]
    return [] if a == b or (a != a and b != b) else [path]


def recorded_once(path: tuple) -> bool:
    "A claim with no second record in the folder: the object columns' declarations and names, an empty batch's presence."
    return bool(path) and (path[0] in ("declared_schema", "batch_present") or
                           (path[0] == "objects" and len(path) >= 3 and path[2] == "key"))


VALUES = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2, 2**62, 2**63, 10**12, 10**18]),
                   st.booleans(), st.text(max_size=6), st.none(), st.floats(), st.just([]), st.just({}),
                   st.sampled_from(DTYPES))


def mutate_manifest(data, manifest: dict) -> dict:
    "One random edit of a copy of the manifest."
    manifest = json.loads(json.dumps(manifest))
    path = data.draw(st.sampled_from(list(json_paths(manifest))))
    parent = manifest
    for key in path[:-1]: parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    op = data.draw(st.sampled_from(["delete", "replace", "nudge", "duplicate", "dtype"]))
    if op == "delete": del parent[key]
    elif op == "duplicate" and isinstance(parent, list): parent.insert(key, json.loads(json.dumps(value)))
    elif op == "nudge" and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = value + data.draw(st.sampled_from([-1, 1, 2, -(2**40), 2**62]))
    elif op == "dtype" and key == "dtype": parent[key] = data.draw(st.sampled_from(DTYPES))
    else: parent[key] = data.draw(VALUES)
    return manifest


def mutate_files(data, folder: Path) -> str:
    "One random change to the data files; returns what it did ('flip' keeps every size)."
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    offsets = [p for p in files if p.parent.name == "offsets" and p.stat().st_size >= 16]
    ops = ["delete", "extend", "stray"] + (["truncate", "flip"] if any(p.stat().st_size for p in files) else []) \
        + (["decrease"] if offsets else [])
    op = data.draw(st.sampled_from(ops))
    if op == "stray": (folder / "tensors" / "9999.bin").write_bytes(b"\0" * 8); return op
    pool = offsets if op == "decrease" else [p for p in files if p.stat().st_size] if op in ("truncate", "flip") else files
    target = data.draw(st.sampled_from(pool))
    content = bytearray(target.read_bytes())
    if op == "delete": target.unlink()
    elif op == "extend": target.write_bytes(bytes(content) + data.draw(st.binary(min_size=1, max_size=16)))
    elif op == "truncate": target.write_bytes(bytes(content[:data.draw(st.integers(0, len(content) - 1))]))
    elif op == "flip":
        for _ in range(data.draw(st.integers(1, 3))):
            content[data.draw(st.integers(0, len(content) - 1))] ^= data.draw(st.integers(1, 255))
        target.write_bytes(bytes(content))
    else:
        values = np.frombuffer(bytes(content), dtype=np.int64).copy()
        i = data.draw(st.integers(1, len(values) - 1))
        values[i] = values[i - 1] - data.draw(st.integers(1, 2**40))
        target.write_bytes(values.tobytes())
    return op


def save(kind: str, obj, folder: Path):
    if kind == "dp": obj.save(folder)
    else: obj.memmap(folder)


# ------------------------------------------------------------------------------------------------- properties
@PROPERTY
@given(saved_batches(), st.sampled_from([None, "cpu"]), st.data())
def test_property_manifest_edits_are_refused_or_change_nothing(case, device, data):
    kind, original = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "batch"
        save(kind, original, folder)
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        if data.draw(st.booleans()):
            edited = mutate_manifest(data, manifest)
            (folder / MANIFEST_NAME).write_text(json.dumps(edited))
        else:  # a flipped byte of the JSON text
            text = bytearray((folder / MANIFEST_NAME).read_bytes())
            text[data.draw(st.integers(0, len(text) - 1))] ^= data.draw(st.integers(1, 255))
            (folder / MANIFEST_NAME).write_bytes(bytes(text))
            try: edited = json.loads(text)
            except ValueError: edited = None
        try: loaded = load(kind, folder, device)
        except REFUSED: return
        assert_honest(kind, loaded, folder)
        paths = changed_paths(manifest, edited)
        if paths and all(empty_field_shape(manifest, p) for p in paths):
            # no byte contradicts a new per-row shape of a field without values: the field follows it, still empty
            loaded_cols, original_cols = columns_of(kind, loaded), columns_of(kind, original)
            assert loaded_cols.keys() == original_cols.keys(), paths
            assert all(values_of(loaded_cols[k]).numel() == 0 for k in loaded_cols
                       if values_of(original_cols[k]).numel() == 0), paths
            return
        assert same_batch(kind, loaded, original, lenient=all(recorded_once(p) for p in paths) and bool(paths)), paths


def values_of(t: torch.Tensor) -> torch.Tensor:
    return t.values() if t.is_nested else t


def empty_field_shape(manifest: dict, path: tuple) -> bool:
    "The per-row shape of a field with no values and no declared trailing shape: no byte in the folder contradicts it."
    if len(path) < 3 or path[0] != "fields" or path[2] != "shape": return False
    fields = manifest.get("fields", [])
    if not isinstance(path[1], int) or path[1] >= len(fields): return False
    field = fields[path[1]]
    declared = {f.get("name"): f.get("trailing_shape") for f in manifest.get("schema", {}).get("fields", [])}
    return field.get("nbytes") == 0 and declared.get(field.get("key")) is None


@PROPERTY
@given(saved_batches(), st.sampled_from([None, "cpu"]), st.data())
def test_property_file_changes_are_refused_or_are_what_the_files_hold(case, device, data):
    kind, original = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "batch"
        save(kind, original, folder)
        op = mutate_files(data, folder)
        try: loaded = load(kind, folder, device)
        except REFUSED: return
        assert op == "flip", f"{op} was not refused"
        assert_honest(kind, loaded, folder)
        assert_is_the_files(kind, loaded, folder, original)


@PROPERTY
@given(saved_batches(), st.data())
def test_property_meta_loads_check_the_manifest_alone(case, data):
    kind, original = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "batch"
        save(kind, original, folder)
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        edited = mutate_manifest(data, manifest)
        (folder / MANIFEST_NAME).write_text(json.dumps(edited))
        try: loaded = load(kind, folder, "meta")
        except REFUSED: return
        for key, t in columns_of(kind, loaded).items():
            assert t.device.type == "meta", key  # nothing was allocated, whatever the claims


@PROPERTY
@given(saved_batches())
def test_property_unedited_folders_load_equal(case):
    kind, original = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "batch"
        save(kind, original, folder)
        for device in (None, "cpu"):
            loaded = load(kind, folder, device)
            assert_honest(kind, loaded, folder)
            assert same_batch(kind, loaded, original, lenient=False)


# ------------------------------------------------------------------------------------------------- huge claims
def edit(folder: Path, change):
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    change(manifest)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_huge_claimed_max_row_length_is_refused_before_anything_is_allocated(tmp_path):
    before = max_rss_mib()
    dp = data_proto(4, 1, declared=True, meta=False)
    dp.save(tmp_path / "dp")
    T = 10**12
    def claim(m):  # a group of four rows of up to 10^12 tokens, the field sizes to match: consistent, and false
        g = m["groups"][0]
        g.update(max_seqlen=T, total=T + g["total"])
        for f in m["fields"]:
            if f["group"] == g["name"]:
                f["shape"][0] = g["total"]
                f["nbytes"] = int(np.prod(f["shape"])) * torch.empty(0, dtype=getattr(torch, f["dtype"])).element_size()
    edit(tmp_path / "dp", claim)
    with pytest.raises(BatchDirectoryError, match="holds .* bytes, the manifest says"):
        DataProto.load(tmp_path / "dp", allow_pickle=True)
    meta = DataProto.load(tmp_path / "dp", device="meta", allow_pickle=True)  # the manifest alone: meta tensors only
    assert meta.batch.get("input_ids").device.type == "meta" and meta.batch.get("input_ids")._max_seqlen == T
    rd = reward_data(4, 2, rewards=True)
    rd.save(tmp_path / "rd")
    edit(tmp_path / "rd", lambda m: m["groups"][0].update(max_seqlen=T))
    with pytest.raises(BatchDirectoryError, match="cannot describe 4 rows"): RewardData.load(tmp_path / "rd")
    assert max_rss_mib() - before < 256


def test_a_huge_claimed_row_count_is_refused_before_anything_is_allocated(tmp_path):
    before = max_rss_mib()
    dp = data_proto(3, 3, declared=False, meta=True)
    dp.save(tmp_path / "dp")
    edit(tmp_path / "dp", lambda m: m.update(batch_size=[10**12]))
    with pytest.raises(BatchDirectoryError, match="offsets of N=1000000000000 rows take 8000000000008 bytes"):
        DataProto.load(tmp_path / "dp", allow_pickle=True)
    rd = reward_data(3, 4, rewards=False)
    rd.save(tmp_path / "rd")
    edit(tmp_path / "rd", lambda m: (m.update(batch_size=[2**62]), m["tree"].update(batch_size=[2**62])))
    with pytest.raises(BatchDirectoryError, match="take"): RewardData.load(tmp_path / "rd")
    edit(tmp_path / "rd", lambda m: m.update(batch_size=[2**63]))
    with pytest.raises(BatchDirectoryError, match="batch_size"): RewardData.load(tmp_path / "rd", device="meta")
    assert max_rss_mib() - before < 256


def test_a_class_mismatch_is_both_a_directory_and_a_type_error(tmp_path):
    reward_data(2, 5, rewards=False).save(tmp_path / "rd")
    with pytest.raises(BatchClassError, match="holds a xtoken_dp.batch.RewardData, not a xtoken_dp.batch.DataProto") as info:
        DataProto.load(tmp_path / "rd")
    assert isinstance(info.value, TypeError) and isinstance(info.value, BatchDirectoryError)


def test_pickles_need_allow_pickle_and_say_why(tmp_path):
    data_proto(2, 6, declared=False, meta=True).save(tmp_path / "dp")
    with pytest.raises(BatchDirectoryError) as info: DataProto.load(tmp_path / "dp")
    message = str(info.value)
    assert "allow_pickle=True" in message and "runs whatever code" in message and "objects/0000.pkl" in message
    with pytest.raises(TypeError, match="allow_pickle: expected a bool"): DataProto.load(tmp_path / "dp", allow_pickle=1)
    (tmp_path / "dp" / "objects" / "0000.pkl").write_bytes(pickle.dumps(["not", "an", "array"]))
    edit(tmp_path / "dp", lambda m: m["objects"][0].update(nbytes=(tmp_path / "dp" / "objects" / "0000.pkl").stat().st_size))
    with pytest.raises(BatchDirectoryError, match="column 'uid' must be an np.ndarray with N=2 rows"):
        DataProto.load(tmp_path / "dp", allow_pickle=True)


# ------------------------------------------------------------------------------------------ tensordict's format
def dense_reward_data(full: bool) -> RewardData:
    "A padded RewardData (no jagged leaf, so it saves in tensordict's format), with every field or with two left None."
    g = torch.Generator().manual_seed(0)
    return RewardData(torch.randint(0, 100, (3, 6), generator=g), torch.rand(3, 6, generator=g) < .8,
                      torch.randn(3, 6, generator=g) if full else None, torch.rand(3, generator=g) if full else None,
                      batch_size=[3])


@pytest.mark.parametrize("full", [True, False])
def test_tensordict_format_columns_are_checked_against_their_meta_json(tmp_path, full):
    original = dense_reward_data(full)
    folder = tmp_path / "saved"
    original.save(folder)
    assert not (folder / MANIFEST_NAME).exists() and (folder / "meta.json").is_file()  # tensordict's format
    columns = sorted(folder.rglob("*.memmap"))
    assert len(columns) == (4 if full else 2)
    assert same_batch("rd", RewardData.load_memmap(folder), original, lenient=False)
    for column in columns:
        data = column.read_bytes()
        for changed in (data[:-1], data + b"\0"):
            column.write_bytes(changed)
            with pytest.raises(BatchDirectoryError, match=f"{column.name} holds {len(changed)} bytes"):
                RewardData.load_memmap(folder)
        column.unlink()
        with pytest.raises(FileNotFoundError, match=column.name):
            RewardData.load_memmap(folder)
        column.write_bytes(data)
    assert same_batch("rd", RewardData.load(folder), original, lenient=False)
