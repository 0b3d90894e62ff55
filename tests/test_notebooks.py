"""Every notebook in `nbs/` is one pytest test, run through nbdev's own runner so the skip flags hold.

Each notebook runs in a fresh interpreter, as `nbdev-test` does: a notebook's `@patch` cells rebind methods of the
installed classes to functions defined in that notebook, which later notebooks in the same process would then call
(and fail to pickle by reference).

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


def _flags():
    skip = set(str(get_config(NBS).tst_flags).split())
    force = set(os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split())
    return sorted(skip - force), sorted(force)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(nb):
    skip, force = _flags()
    res = subprocess.run([sys.executable, "-c", RUNNER, str(nb), json.dumps(skip), json.dumps(force)],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"{nb.name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
