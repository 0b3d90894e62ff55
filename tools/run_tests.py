"""Run the test suite as two pytest processes side by side, one per core of a 2-core machine.

Most tests keep one core busy (tokenizers, Python-heavy alignment, notebook kernels), so two processes finish sooner
than one. The notebooks, the docs build (which renders them) and the demo's tests (which share its cache with the demo
notebooks) run in one process; every other test file, and two long benchmark notebooks (12c_bench_align,
12j_bench_scale), in the other. On a 2-core machine the halves took 907 s and 926 s.

Each process runs torch on one thread (`OMP_NUM_THREADS=1` unless it is set). With two threads per process on two
cores, each multi-threaded kernel waited for a core the other process held: with only 12c_bench_align moved, the
halves took 1,294 s and 1,227 s, and 996 s and 911 s with one thread (the demo notebook 202 s and 66 s). Each process
has its own pytest temporary folder; they share the project's caches, whose entries are written under a temporary name
and renamed into place.

Each half's output goes to a log file that is printed whole once both have finished (a line every minute says how
far each has got). The exit status is the first non-zero one of the two halves.

    python tools/run_tests.py [pytest options...]     # e.g. -x, -k name, --durations=25
    XTOKEN_DP_TEST_JOBS=1 python tools/run_tests.py   # one process, output as it comes
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The first half runs these files; the second, every other test file and the `MOVED` tests of these files.
FIRST_HALF = ("tests/test_notebooks.py", "tests/test_docs.py", "tests/test_distill.py")
MOVED = tuple(f"tests/test_notebooks.py::test_notebook[{name}]" for name in ("12c_bench_align", "12j_bench_scale"))


def halves() -> list[list[str]]:
    "The two halves' pytest arguments: `FIRST_HALF` less `MOVED`, then `MOVED` and every other `tests/test_*.py`."
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    missing = [f for f in FIRST_HALF if f not in files]
    if missing: raise SystemExit(f"run_tests: {missing} not found under tests/")
    return [[*FIRST_HALF, *(f"--deselect={t}" for t in MOVED)], [*MOVED, *(f for f in files if f not in FIRST_HALF)]]


def _done(log: Path) -> str:
    "How many tests pytest -q has reported in `log` so far, and how many of them failed."
    text = log.read_text(errors="replace") if log.exists() else ""
    heads = (line.split(" [")[0].rstrip() for line in text.splitlines())  # "..F.s    [100%]" -> "..F.s"
    marks = "".join(h for h in heads if h and set(h) <= set(".sFExX"))
    failed = sum(marks.count(c) for c in "FE")
    return f"{len(marks)} done" + (f", {failed} failed" if failed else "")


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    if os.environ.get("XTOKEN_DP_TEST_JOBS") == "1":
        return subprocess.call([*pytest, "tests/"], cwd=ROOT)
    moved = ", ".join(t.split("[")[-1].rstrip("]") for t in MOVED)
    start, names = time.monotonic(), ("notebooks, docs and demo", f"other tests, {moved}")
    with tempfile.TemporaryDirectory(prefix="xtoken_dp_tests_") as tmp:
        logs = [Path(tmp) / f"half{i}.log" for i in range(2)]
        procs, env = [], {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **os.environ}
        for i, files in enumerate(halves()):
            with open(logs[i], "w") as out:
                procs.append(subprocess.Popen([*pytest, f"--basetemp={tmp}/basetemp{i}", *files], cwd=ROOT, stdout=out,
                                              stderr=subprocess.STDOUT, env=env))
        print(f"run_tests: two pytest processes, {names[0]!r} and {names[1]!r}; logs in {tmp}", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM ends both halves too (finally below)
        try:
            report = start + 60
            while any(p.poll() is None for p in procs):
                time.sleep(1)
                if time.monotonic() >= report:
                    report += 60
                    state = "; ".join(f"{n}: {_done(log)}{' (finished)' if p.poll() is not None else ''}"
                                      for n, p, log in zip(names, procs, logs))
                    print(f"[{(time.monotonic() - start) / 60:.0f} min] {state}", flush=True)
        finally:
            for p in procs:
                if p.poll() is None: p.terminate()
        codes = [p.wait() for p in procs]
        for name, log, code in zip(names, logs, codes):
            print(f"\n===== {name} (exit status {code}) =====", flush=True)
            sys.stdout.write(log.read_text(errors="replace"))
        print(f"\nrun_tests: {time.monotonic() - start:.0f} s; exit status {codes[0]} ({names[0]}), "
              f"{codes[1]} ({names[1]})")
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
