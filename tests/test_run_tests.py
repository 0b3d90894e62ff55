"""`tools/run_tests.py`, the two-process runner behind `make test`: its halves cover every test once, and its progress
lines count what a real `pytest -q` run reports."""
import importlib.util, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("run_tests", ROOT / "tools" / "run_tests.py")
run_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_tests)


def test_halves_run_every_test_file_once_and_move_whole_notebook_tests():
    first, second = run_tests.halves()
    deselected = {a.removeprefix("--deselect=") for a in first if a.startswith("--deselect=")}
    first_files = [a for a in first if not a.startswith("--")]
    moved = [a for a in second if "::" in a]
    second_files = [a for a in second if "::" not in a]
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    assert sorted(first_files + second_files) == every and not set(first_files) & set(second_files)
    assert deselected == set(moved) == set(run_tests.MOVED)
    for test_id in moved:  # each names a test of a first-half file, and a notebook that exists
        assert test_id.split("::")[0] in first_files
        assert (ROOT / "nbs" / f"{test_id.split('[')[1].rstrip(']')}.ipynb").exists(), test_id


def test_progress_counts_what_pytest_q_printed(tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text("import pytest\n"
                     "@pytest.mark.parametrize('i', range(75))\ndef test_ok(i): pass\n"
                     "def test_bad(): assert False\n"
                     "@pytest.mark.skip\ndef test_skipped(): pass\n")
    log = tmp_path / "half.log"
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)], cwd=tmp_path,
                       stdout=out, stderr=subprocess.STDOUT)
    assert "1 failed, 75 passed, 1 skipped" in log.read_text()
    # 77 marks over two lines, the second padded before its "[100%]"; the failure report's lines are not marks
    assert run_tests._done(log) == "77 done, 1 failed"
    assert run_tests._done(tmp_path / "not_yet.log") == "0 done"
