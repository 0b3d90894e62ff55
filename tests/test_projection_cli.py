"""P13: the `projection build | inspect | convert` command, through `xtoken_dp.cli.main` and in a subprocess."""
import json, os, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch

from xtoken_dp.cli import main as cli_main
from xtoken_dp.projection import load_dense_projection, parse_projection_file
from xtoken_dp.tokenizers import train_toy_tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    "Two small tokenizers saved as folders and as bare tokenizer.json files."
    root = tmp_path_factory.mktemp("toks")
    out = {}
    for name, kind, size in (("student", "bpe_bytelevel", 600), ("teacher", "bpe_bytelevel_digits", 700)):
        tok = train_toy_tokenizer(kind, vocab_size=size)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def run(argv, capsys):
    code = cli_main(["projection", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_build_inspect_round_trip(toy_dirs, tmp_path, capsys):
    out = tmp_path / "proj.pt"
    code, stdout, stderr = run(["build", "--student", str(toy_dirs["student"]), "--teacher", str(toy_dirs["teacher"]),
                                "--out", str(out), "--no-progress"], capsys)
    assert code == 0, stderr
    assert "exact rows" in stdout and "invariants      ok" in stdout
    report = json.loads(Path(f"{out}.report.json").read_text())
    dense = load_dense_projection(out)
    assert dense.indices.shape == (report["student_vocab_size"], 4)
    assert dense.metadata["student_model_id"] == str(toy_dirs["student"])
    assert report["violations"] == [] and report["exact_rows"] == dense.exact_student_ids.numel()
    code, stdout, _ = run(["inspect", str(out)], capsys)
    assert code == 0
    assert f"student rows {report['student_vocab_size']:,}" in stdout
    assert f"teacher vocab {report['teacher_vocab_size']:,}" in stdout
    assert f"strict: {report['common_strict']:,} common ids" in stdout


def test_build_options_and_report_path(toy_dirs, tmp_path, capsys):
    out, report = tmp_path / "p2.pt", tmp_path / "r" / "custom.json"
    report.parent.mkdir()
    code, _, err = run(["build", "--student", str(toy_dirs["student"]), "--teacher", str(toy_dirs["teacher"] / "tokenizer.json"),
                        "--out", str(out), "--top-k", "2", "--max-pieces", "3", "--decay", "0.5", "--no-reverse",
                        "--no-exact", "--report", str(report), "--no-progress"], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    assert data["parameters"] == {"top_k": 2, "max_pieces": 3, "decay": 0.5, "reverse": False, "reverse_weight": 1.0,
                                  "exact": False, "pair_specials": True}
    assert load_dense_projection(out).indices.shape[1] == 2
    assert not Path(f"{out}.report.json").exists()


@pytest.mark.parametrize("argv", [
    [], ["build"], ["build", "--student", "a", "--teacher", "b"], ["inspect"], ["frobnicate"],
    ["build", "--student", "a", "--teacher", "b", "--out", "x.pt", "--top-k", "many"],
    ["convert", "in.pt"],
])
def test_usage_errors_exit_2(argv, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("xtoken-dp projection") and "error:" in err, err


def test_unknown_tokenizer_name_exits_2(tmp_path, capsys):
    code, _, err = run(["build", "--student", "no_such_tokenizer", "--teacher", "mistral_spm", "--out",
                        str(tmp_path / "x.pt")], capsys)
    assert code == 2 and "no_such_tokenizer" in err
    assert not (tmp_path / "x.pt").exists()


def test_invalid_parameter_exits_1(toy_dirs, tmp_path, capsys):
    code, _, err = run(["build", "--student", str(toy_dirs["student"]), "--teacher", str(toy_dirs["teacher"]),
                        "--out", str(tmp_path / "x.pt"), "--top-k", "0", "--no-progress"], capsys)
    assert code == 1 and "top_k: expected an int >= 1" in err


def test_inspect_errors_exit_1(tmp_path, capsys):
    assert run(["inspect", str(tmp_path / "missing.pt")], capsys)[0] == 1
    (tmp_path / "junk.pt").write_bytes(b"junk")
    assert run(["inspect", str(tmp_path / "junk.pt")], capsys)[0] == 1


def test_inspect_sparse(tmp_path, capsys):
    torch.save({(0, 1): 2.0, (5, 3): 1.0}, tmp_path / "s.pt")
    code, out, _ = run(["inspect", str(tmp_path / "s.pt")], capsys)
    assert code == 0 and "sparse projection" in out and "student 6 x teacher 4" in out


class Legacy:
    "A stand-in for the objects legacy projection files pickled."
    def __init__(self): self.note = "legacy"


def test_convert_requires_trust_and_produces_a_safe_file(tmp_path, capsys):
    src, dst = tmp_path / "legacy.pt", tmp_path / "safe.pt"
    torch.save({"indices": np.array([[2, -1], [0, 1]]), "likelihoods": np.array([[1.0, 0.0], [0.5, 0.5]]),
                "enable_scale_trick": np.bool_(True), "tool": Legacy()}, src)
    with pytest.raises(ValueError, match="convert"): parse_projection_file(src)
    code, _, err = run(["convert", str(src), str(dst)], capsys)
    assert code == 2 and "--trust-source" in err and not dst.exists()
    code, out, err = run(["convert", str(src), str(dst), "--trust-source"], capsys)
    assert code == 0, err
    assert err.startswith("xtoken-dp projection: warning: convert: file['tool'] holds a Legacy"), err  # one line
    dense = load_dense_projection(dst)
    assert dense.indices.tolist() == [[2, -1], [0, 1]] and dense.metadata["enable_scale_trick"] is True
    assert dense.metadata["tool"].startswith("<")


def test_python_dash_m_entry(toy_dirs, tmp_path):
    out = tmp_path / "m.pt"
    done = subprocess.run([sys.executable, "-m", "xtoken_dp.cli", "projection", "build", "--student", str(toy_dirs["student"]),
                           "--teacher", str(toy_dirs["teacher"]), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "projection:" not in done.stderr  # stderr is not a TTY: no progress bar by default
    done = subprocess.run([sys.executable, "-m", "xtoken_dp.cli", "projection", "inspect", str(out)], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0 and "dense top-k projection" in done.stdout
    done = subprocess.run([sys.executable, "-m", "xtoken_dp.cli", "projection", "build", "--student", "x"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "--teacher" in done.stderr
