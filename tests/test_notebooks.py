"""Every notebook in `nbs/` is one pytest test, run through nbdev's own runner so the skip flags hold.

Cells flagged with a `tst_flags` entry of `pyproject.toml` (`notest`, `slow`) are skipped. To run the slow cells
too, set `XTOKEN_DP_TEST_FLAGS=slow` (a space-separated list of flags to force), the equivalent of
`nbdev-test --flags slow`:

    XTOKEN_DP_TEST_FLAGS=slow .venv/bin/pytest tests/test_notebooks.py
"""
import os
from pathlib import Path

import pytest
import nbdev.test as nbdev_test
from nbdev.config import get_config

NBS = Path(__file__).resolve().parent.parent / "nbs"
NOTEBOOKS = sorted(p for p in NBS.glob("*.ipynb") if not p.name.startswith("_"))


def _flags():
    skip = set(str(get_config(NBS).tst_flags).split())
    force = set(os.environ.get("XTOKEN_DP_TEST_FLAGS", "").split())
    return sorted(skip - force), sorted(force)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(nb):
    skip, force = _flags()
    ok, seconds = nbdev_test.test_nb(nb, skip_flags=skip, force_flags=force, showerr=True)
    assert ok, f"{nb.name} failed (see the cell error above)"
