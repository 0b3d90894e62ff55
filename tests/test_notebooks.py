"""Every notebook in `nbs/` is one pytest test, run through nbdev's own runner so the skip flags hold.

Each notebook runs in a process of its own, as `nbdev-test` does: a notebook's `@patch` cells rebind methods of the
installed classes to functions defined in that notebook, which later notebooks in the same process would then call
(and fail to pickle by reference). The processes are forked from one that has already imported what every notebook
imports (torch, numpy, tensordict, matplotlib, transformers, nbdev), which saves those seconds per notebook; the
parent only imports (no tensor work runs there before a fork). Set `XTOKEN_DP_NOTEBOOK_FORK=0` to start each
notebook in a new interpreter instead.

Cells flagged with a `tst_flags` entry of `pyproject.toml` (`notest`, `slow`) are skipped. To run the slow cells
too, set `XTOKEN_DP_TEST_FLAGS=slow` (a space-separated list of flags to force), the equivalent of
`nbdev-test --flags slow`:

    XTOKEN_DP_TEST_FLAGS=slow .venv/bin/pytest tests/test_notebooks.py
"""
import json, os, subprocess, sys
from pathlib import Path

import pytest
from nbdev.config import get_config

NBS = Path(__file__).resolve().parent.parent / "nbs"
NOTEBOOKS = sorted(p for p in NBS.glob("*.ipynb") if not p.name.startswith("_"))
RUNNER = """
import json, sys
import nbdev.test as nbdev_test
path, skip, force = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
ok, seconds = nbdev_test.test_nb(path, skip_flags=skip, force_flags=force, showerr=True)
sys.exit(0 if ok else 1)
"""
# Reads one JSON request per line, forks a child that runs that notebook with its output in the request's log file,
# and answers with the child's exit status.
FORK_SERVER = """
import json, os, sys
import torch, numpy, tensordict, matplotlib.pyplot, transformers, IPython, fastcore.test, nbdev.showdoc
import nbdev.test as nbdev_test
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1); os.dup2(log, 2); os.close(log)
        ok = False
        try: ok = nbdev_test.test_nb(req["path"], skip_flags=req["skip"], force_flags=req["force"], showerr=True)[0]
        except BaseException:
            import traceback; traceback.print_exc()
        sys.exit(0 if ok else 1)
    print(json.dumps({"status": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
"""
FORK = os.environ.get("XTOKEN_DP_NOTEBOOK_FORK", "1") != "0"


def _flags():
    skip = set(str(get_config(NBS).tst_flags).split())
    force = set(os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split())
    return sorted(skip - force), sorted(force)


@pytest.fixture(scope="module")
def fork_server():
    "The process the notebooks fork from (None when `XTOKEN_DP_NOTEBOOK_FORK=0`)."
    if not FORK:
        yield None
        return
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    yield server
    server.stdin.close()
    server.wait(timeout=120)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(nb, fork_server, tmp_path):
    skip, force = _flags()
    if fork_server is None:
        res = subprocess.run([sys.executable, "-c", RUNNER, str(nb), json.dumps(skip), json.dumps(force)],
                             capture_output=True, text=True)
        assert res.returncode == 0, f"{nb.name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
        return
    log = tmp_path / "notebook.log"
    fork_server.stdin.write(json.dumps(dict(path=str(nb), skip=skip, force=force, log=str(log))) + "\n")
    fork_server.stdin.flush()
    reply = fork_server.stdout.readline()
    assert reply, f"the notebook fork server exited (status {fork_server.poll()}) before running {nb.name}"
    status = json.loads(reply)["status"]
    assert status == 0, f"{nb.name} failed (exit status {status}):\n{log.read_text(errors='replace')[-9000:]}"
