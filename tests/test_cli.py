"""The `xtoken-dp` command line as a user meets it: a real subprocess, real files, argv as raw bytes.

Every failure is one line on stderr with exit status 1 (2 for a usage error), never a traceback; an unwritable output
folder is refused before any work starts.
"""
import os, re, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg",
       "TOKENIZERS_PARALLELISM": "false"}


def cli(*args, timeout=300):
    "Run `python -m xtoken_dp.cli ARGS` (str or raw bytes arguments); return (status, stdout, stderr)."
    argv = [os.fsencode(sys.executable), b"-m", b"xtoken_dp.cli", *(a if isinstance(a, bytes) else os.fsencode(a)
                                                                     for a in args)]
    res = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, timeout=timeout)
    return res.returncode, res.stdout.decode("utf-8", "replace"), res.stderr.decode("utf-8", "replace")


def one_line_failure(status, err, expected_status):
    assert status == expected_status, (status, err)
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("xtoken-dp"), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def blocked(tmp_path_factory):
    "A path under a regular file: no folder can be created there, whoever we run as."
    f = tmp_path_factory.mktemp("cli") / "a_file"
    f.write_text("x")
    return f / "out"


@pytest.fixture(scope="module")
def garbage_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("garbage")
    (d / "tokenizer.json").write_bytes(b"\x00\x01 not json at all")
    (d / "proj.pt").write_bytes(b"PK\x03\x04 this is not a torch file")
    return d


def test_usage_errors_are_one_line_with_status_2(blocked):
    assert "unknown command 'frobnicate'" in one_line_failure(*cli("frobnicate")[::2], 2)
    one_line_failure(*cli("bench", "no_such_benchmark")[::2], 2)
    one_line_failure(*cli("align", "text", "--student", "qwen2")[::2], 2)  # --teacher is required
    one_line_failure(*cli("demo", "--arms", "ce,bogus")[::2], 2)


@pytest.mark.parametrize("command", [
    ("demo", "--preset", "quick", "--out", "{out}"),
    ("padding-tax", "--out", "{out}", "--n", "8", "--s", "64", "--repeats", "1"),
    ("projection", "build", "--student", "qwen2", "--teacher", "mistral_tekken", "--out", "{out}/p.pt"),
    ("fetch-tokenizers", "qwen2", "--dest", "{out}"),
    ("align", "hello", "--student", "qwen2", "--teacher", "mistral_tekken", "--html", "{out}/a.html"),
], ids=lambda c: c[0])
def test_unwritable_output_is_refused_before_the_work(command, blocked):
    args = [a.format(out=blocked) for a in command]
    line = one_line_failure(*cli(*args)[::2], 2)
    assert str(blocked.parent) in line, line


def test_garbage_files_are_one_line_errors(garbage_files):
    line = one_line_failure(*cli("align", "x", "--student", str(garbage_files / "tokenizer.json"),
                                 "--teacher", "qwen2")[::2], 1)
    assert "tokenizer.json" in line, line
    line = one_line_failure(*cli("projection", "inspect", str(garbage_files / "proj.pt"))[::2], 1)
    assert "proj.pt" in line, line


def test_undecodable_argv_is_an_error_not_a_traceback():
    line = one_line_failure(*cli("align", b"caf\xe9 latin-1", "--student", "qwen2", "--teacher", "mistral_tekken")[::2], 1)
    assert "not valid" in line.lower() or "utf-8" in line.lower(), line
    one_line_failure(*cli("align", "x", "--student", b"\xff\xfe", "--teacher", "qwen2")[::2], 2)


def test_a_good_run_still_prints_its_table():
    status, out, err = cli("align", "Hello world", "--student", "qwen2", "--teacher", "mistral_tekken")
    assert status == 0, err
    assert "chunk" in out.splitlines()[0] and "byte_coverage" in out


def test_tune_offers_exactly_the_protocols_factor_studies(capsys):
    "The CLI lists the studies without importing the protocol (torch) at start-up; the two lists must not drift."
    from xtoken_dp.cli import main
    from xtoken_dp.protocol import FACTOR_STUDIES
    assert main(["tune", "--study", "no_such_study"]) == 2
    offered = re.findall(r"'([a-z_]+)'", capsys.readouterr().err.split("choose from", 1)[1])
    assert sorted(offered) == sorted(FACTOR_STUDIES)


def test_demo_teacher_store_and_onpolicy_flags_reach_the_config(tmp_path):
    from xtoken_dp.cli import _demo_config, _demo_parser
    parse = lambda *a: _demo_config(_demo_parser().parse_args([*a, "--out", str(tmp_path / "out")]))
    config = parse("--arms", "ce,gold:cached,hkl:onpolicy", "--teacher-k", "32", "--teacher-store", str(tmp_path / "store"),
                   "--student-tokenizer", "bpe", "--lmbda", "0.25", "--max-new-tokens", "16", "--temperature", "0.7",
                   "--seq-kd", "--beta", "1")
    assert (config.teacher_k, config.teacher_store, config.student_tokenizer) == (32, str(tmp_path / "store"), "bpe")
    assert (config.onpolicy_settings.lmbda, config.onpolicy_settings.max_new_tokens, config.onpolicy_settings.temperature,
            config.onpolicy_settings.seq_kd, config.beta) == (0.25, 16, 0.7, True, 1.0)
    specs = {a.name: a for a in config.arm_specs()}
    assert specs["gold:cached"].teacher == "cached" and specs["hkl:onpolicy"].onpolicy and not specs["ce"].onpolicy
    # --teacher cached renames every KD arm that reads a teacher per step; an on-policy arm keeps the live teacher
    assert [a.name for a in parse("--teacher", "cached", "--arms", "ce,gold,hkl:onpolicy").arm_specs()] == ["ce", "gold:cached", "hkl:onpolicy"]


def test_demo_flag_mistakes_are_usage_errors():
    assert "lmbda" in one_line_failure(*cli("demo", "--lmbda", "2")[::2], 2)
    assert "distinct names" in one_line_failure(*cli("demo", "--teacher", "cached", "--arms", "gold,gold:cached")[::2], 2)
    assert "ARM:onpolicy" in one_line_failure(*cli("demo", "--arms", "ce,bogus:cached")[::2], 2)
    assert "not defined for the arms ['uld']" in one_line_failure(*cli("demo", "--arms", "ce,uld", "--beta", "0.5")[::2], 2)
