"""Projection caches: thread safety, fork scope, replacement by rename, symlinks, key contents.

The notebook `06_caches.ipynb` covers the single-threaded behaviour; this file hosts what needs real threads,
real forked processes and file-system tricks.
"""
import gc, multiprocessing as mp, os, threading, time, warnings, weakref

import pytest
import torch

from xtoken_dp import caches
from xtoken_dp.caches import (build_exact_token_map, cache_info, clear_caches, get_sparse_projection_matrix,
                              get_topk_projection)


@pytest.fixture(autouse=True)
def fresh_caches():
    clear_caches()
    yield
    clear_caches()


def write(path, indices, likelihoods, **meta):
    torch.save({"indices": torch.tensor(indices), "likelihoods": torch.tensor(likelihoods), **meta}, path)
    return path


@pytest.fixture
def projection(tmp_path):
    return write(tmp_path / "p.pt", [[1, -1], [2, 0], [1, -1]], [[1.0, 0.0], [0.7, 0.3], [1.0, 0.0]])


def test_threads_asking_for_one_key_get_one_object(projection):
    barrier = threading.Barrier(8)
    results = [None] * 8
    def worker(i):
        barrier.wait()
        results[i] = (get_sparse_projection_matrix(projection, "cpu", student_vocab_size=3, teacher_vocab_size=3),
                      get_topk_projection(projection, "cpu"),
                      build_exact_token_map(projection, "cpu", xtoken_loss=False, teacher_vocab_size=3))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    for j in range(3): assert all(r[j] is results[0][j] for r in results)
    assert cache_info() == {"sparse_projection": 1, "topk_projection": 1, "exact_token_map": 1}


def _child_reports(path, queue):
    "Runs in a forked child: are the inherited entries reused?"
    before = caches._TOPK_PROJECTION_CACHE.copy()
    inherited = next(iter(before.values())).value
    fresh = get_topk_projection(path, "cpu")
    queue.put((len(before), fresh is inherited, torch.equal(fresh[0], inherited[0]),
               {e.pid for e in caches._TOPK_PROJECTION_CACHE.values()} == {os.getpid()}))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_does_not_reuse_parent_entries(projection):
    parent_value = get_topk_projection(projection, "cpu")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_reports, args=(str(projection), queue))
    child.start(); child.join(60)
    assert child.exitcode == 0
    inherited_count, reused, equal, own_pid_only = queue.get(timeout=5)
    assert (inherited_count, reused, equal, own_pid_only) == (1, False, True, True)
    assert get_topk_projection(projection, "cpu") is parent_value  # the parent's entry is untouched


def test_replacement_by_rename_reloads_and_frees_the_stale_entry(projection, tmp_path):
    old = get_topk_projection(projection, "cpu")
    old_ref = weakref.ref(old[0])
    replacement = write(tmp_path / "new.pt", [[0, -1], [0, -1], [0, -1]], [[1.0, 0.0]] * 3)
    os.replace(replacement, projection)  # new inode, same path
    new = get_topk_projection(projection, "cpu")
    assert new is not old and new[0][:, 0].tolist() == [0, 0, 0]
    assert cache_info()["topk_projection"] == 1
    del old; gc.collect()
    assert old_ref() is None  # evicted entries free their memory


def test_symlink_and_relative_paths_share_an_entry(projection, tmp_path, monkeypatch):
    link = tmp_path / "link.pt"
    link.symlink_to(projection)
    first = get_topk_projection(projection, "cpu")
    assert get_topk_projection(link, "cpu") is first
    monkeypatch.chdir(tmp_path)
    assert get_topk_projection("./p.pt", torch.device("cpu")) is first
    assert get_topk_projection("p.pt", "cpu") is first


def test_missing_file_raises_even_when_cached(projection):
    get_topk_projection(projection, "cpu")
    build_exact_token_map(projection, "cpu", xtoken_loss=True, teacher_vocab_size=3)
    os.remove(projection)
    for call in (lambda: get_topk_projection(projection, "cpu"),
                 lambda: build_exact_token_map(projection, "cpu", xtoken_loss=True, teacher_vocab_size=3),
                 lambda: get_sparse_projection_matrix(projection, "cpu", student_vocab_size=3, teacher_vocab_size=3)):
        with pytest.raises(FileNotFoundError, match="p.pt"): call()


def test_exact_map_key_holds_every_parameter(projection):
    base = dict(xtoken_loss=False, teacher_vocab_size=3)
    first = build_exact_token_map(projection, "cpu", **base)
    variants = [dict(base, xtoken_loss=True), dict(base, teacher_vocab_size=4), dict(base, student_vocab_size=5),
                dict(base, exact_tolerance=0.3), dict(base, relaxed_threshold=0.7)]
    results = [build_exact_token_map(projection, "cpu", **v) for v in variants]
    assert all(r is not first for r in results)
    assert len({id(r) for r in results}) == len(results)
    assert cache_info()["exact_token_map"] == 1 + len(variants)
    assert cache_info()["topk_projection"] == 1  # they all share one top-k entry
    assert results[2]["uncommon_student"].tolist() == [1, 2, 3, 4]  # row 2 loses its collision with row 0
    assert results[3]["common_student"].tolist() == [0, 1]  # row 1 (0.7/0.3) is exact within tolerance 0.3


def test_allow_empty_is_checked_on_hits(tmp_path):
    fuzzy = write(tmp_path / "fuzzy.pt", [[0, 1]], [[0.5, 0.5]])
    with pytest.warns(RuntimeWarning, match="tail L1"):
        empty = build_exact_token_map(fuzzy, "cpu", xtoken_loss=False, teacher_vocab_size=2, allow_empty=True)
    assert empty["common_student"].numel() == 0 and empty["uncommon_teacher"].tolist() == [0, 1]
    with pytest.raises(ValueError, match="fuzzy.pt"):
        build_exact_token_map(fuzzy, "cpu", xtoken_loss=False, teacher_vocab_size=2)
    with pytest.warns(RuntimeWarning):
        again = build_exact_token_map(fuzzy, "cpu", xtoken_loss=False, teacher_vocab_size=2, allow_empty=True)
    assert again is empty


def test_certified_rows_come_from_the_same_file_read(tmp_path):
    path = write(tmp_path / "x7.pt", [[1, -1], [1, -1], [2, 0], [0, -1]], [[1.0, 0], [1.0, 0], [.7, .3], [1.0, 0]],
                 exact_student_ids=torch.tensor([0]))
    strict = build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=3)
    assert strict["common_student"].tolist() == [0]
    write(path, [[1, -1], [1, -1], [2, 0], [0, -1]], [[1.0, 0], [1.0, 0], [.7, .3], [1.0, 0]],
          exact_student_ids=torch.tensor([0, 3]))
    os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns + 10**9))
    assert build_exact_token_map(path, "cpu", xtoken_loss=False, teacher_vocab_size=3)["common_student"].tolist() == [0, 3]


def test_argument_errors(projection):
    with pytest.raises(TypeError): get_sparse_projection_matrix(projection, "cpu", 3, 3)
    with pytest.raises(TypeError, match="teacher_vocab_size"):
        get_sparse_projection_matrix(projection, "cpu", student_vocab_size=3, teacher_vocab_size=True)
    with pytest.raises(ValueError, match="student_vocab_size: expected an int >= 0"):
        get_sparse_projection_matrix(projection, "cpu", student_vocab_size=-1, teacher_vocab_size=3)
    with pytest.raises(TypeError, match="xtoken_loss"):
        build_exact_token_map(projection, "cpu", xtoken_loss=1, teacher_vocab_size=3)
    assert cache_info() == {"sparse_projection": 0, "topk_projection": 0, "exact_token_map": 0}


def test_nothing_is_filled_at_import():
    import subprocess, sys
    code = ("import xtoken_dp.caches as c, xtoken_dp.projection; "
            "assert c.cache_info() == {'sparse_projection': 0, 'topk_projection': 0, 'exact_token_map': 0}")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_is_normalised(projection):
    a = get_topk_projection(projection, "cuda")
    b = get_topk_projection(projection, f"cuda:{torch.cuda.current_device()}")
    assert a is b and a[0].device.type == "cuda"
    m = get_sparse_projection_matrix(projection, "cuda", student_vocab_size=3, teacher_vocab_size=3, row_normalize=True)
    assert m.is_coalesced() and m.device.type == "cuda"
    cpu = get_sparse_projection_matrix(projection, "cpu", student_vocab_size=3, teacher_vocab_size=3, row_normalize=True)
    torch.testing.assert_close(m.to_dense().cpu(), cpu.to_dense())
    e = build_exact_token_map(projection, "cuda", xtoken_loss=True, teacher_vocab_size=3)
    assert e["common_student"].device.type == "cuda"


def test_getters_refuse_a_file_whose_metadata_contradicts_its_tensors(tmp_path):
    from xtoken_dp.projection import ProjectionFileError
    path = write(tmp_path / "claims.pt", [[1, -1], [2, 0]], [[1.0, 0.0], [0.7, 0.3]], student_vocab_size=5_000_000_000)
    for get in (lambda: get_topk_projection(path, "cpu"),
                lambda: get_sparse_projection_matrix(path, "cpu", student_vocab_size=2, teacher_vocab_size=3),
                lambda: build_exact_token_map(path, "cpu", xtoken_loss=True, teacher_vocab_size=3)):
        with pytest.raises(ProjectionFileError, match=rf"{path}: student_vocab_size: expected 2, the rows of 'indices', "
                                                      rf"found 5000000000"):
            get()
    assert cache_info() == {"sparse_projection": 0, "topk_projection": 0, "exact_token_map": 0}
