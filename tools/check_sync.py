"""Fail when the notebooks and what is generated from them disagree.

Runs `nbdev-export`, `nbdev-clean` and the README generator, and fails (listing the files) if any of them changed
a file: the library was out of sync with the notebooks, a notebook was not clean, or README.md was stale.
The changes are left in place, so `git diff` shows them.
"""
import hashlib, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def snapshot():
    files = [*ROOT.glob("nbs/**/*.ipynb"), *ROOT.glob("xtoken_dp/**/*.py"), ROOT / "README.md", ROOT / "nbs" / "llms.txt"]
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files if p.is_file() and ".ipynb_checkpoints" not in p.parts}


def main():
    before = snapshot()
    for cmd in ([str(BIN / "nbdev-export")], [str(BIN / "nbdev-clean")],
                [sys.executable, str(ROOT / "tools" / "make_readme.py")]):
        subprocess.run(cmd, cwd=ROOT, check=True)
    after = snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        print("Out of sync: nbdev-export / nbdev-clean / make_readme changed these files:", file=sys.stderr)
        for name in changed: print(f"  {name}", file=sys.stderr)
        print("Review the changes (git diff) and commit them.", file=sys.stderr)
        return 1
    print(f"sync check: {len(after)} notebooks, modules and README.md in sync")
    return 0


if __name__ == "__main__": sys.exit(main())
