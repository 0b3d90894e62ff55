"""The README's Python code runs as shown: every ```python block, top to bottom, in one fresh interpreter.

README.md is generated from `nbs/index.ipynb` (tools/make_readme.py), whose hidden cells are left out of it; this test
is what keeps the README honest about what a new user must type, imports included.
"""
import os, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text):
    "The source of every ```python block of a markdown text, in order."
    return [m.group(1) for m in BLOCK.finditer(text)]


def test_python_blocks_are_found():
    blocks = python_blocks("x\n```python\na = 1\n```\n```sh\nmake\n```\n```python\nprint(a)\n```\n")
    assert blocks == ["a = 1\n", "print(a)\n"]


def test_readme_code_runs_in_a_fresh_interpreter(tmp_path):
    blocks = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 2, "README.md shows no Python code"
    script = tmp_path / "readme_code.py"
    script.write_text("\n".join(blocks), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg"}
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"README code failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
