"""Write README.md from nbs/index.ipynb without Quarto.

Cells flagged `#| hide` are left out, directive lines are dropped from the rest, and outputs are kept as text
(markdown and plain text; images and HTML views are left to the docs site). A cell flagged `#| echo: false` contributes
its outputs only. Run with `--check` to fail instead of writing when
README.md is out of date.
"""
import re, sys
from pathlib import Path

import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parent.parent
_directive = re.compile(r"^\s*#\s*\|\s*(\S+)")


def _directives(src):
    return {m.group(1) for line in src.splitlines() if (m := _directive.match(line))}


def _as_markdown(out):
    "An output as markdown: its markdown, or its text in a fenced block."
    data = out.get("data", {})
    if "text/markdown" in data: return data["text/markdown"].strip("\n")
    text = data.get("text/plain") or out.get("text", "")
    return "```\n" + text.strip("\n") + "\n```" if text.strip() else ""


def readme_text(nb_path=ROOT / "nbs" / "index.ipynb"):
    "The README markdown rendered from the landing notebook."
    nb = nbformat.read(nb_path, as_version=4)
    cells = []
    for cell in nb.cells:
        flags = _directives(cell.source)
        if "hide" in flags or "exporti" in flags: continue
        if cell.cell_type == "markdown" and flags:  # an exported paragraph (the package docstring): its text only
            cell.source = "\n".join(l for l in cell.source.splitlines() if not _directive.match(l)).strip("\n")
        if cell.cell_type == "code":
            hidden_source = re.search(r"^\s*#\s*\|\s*echo:\s*false\s*$", cell.source, re.M) is not None
            cell.source = "" if hidden_source else "\n".join(l for l in cell.source.splitlines()
                                                            if not _directive.match(l)).strip("\n")
            keep = []
            for out in cell.get("outputs", []):
                if out.get("output_type") in ("display_data", "execute_result"):
                    rich = out["data"].keys() & {"text/markdown", "text/html", "image/png", "image/svg+xml"}
                    data = {k: v for k, v in out["data"].items() if k in ("text/markdown", "text/plain")}
                    # a rich output's plain-text fallback is a repr (an HTML string, "<Figure ...>"): the docs show it
                    if rich: data.pop("text/plain", None)
                    if not data: continue
                    out["data"] = data
                keep.append(out)
            cell.outputs = keep
        cell.metadata = {}
        if cell.cell_type == "code" and not cell.source:  # `echo: false`: its outputs stand alone as markdown
            cell = nbformat.v4.new_markdown_cell("\n\n".join(_as_markdown(out) for out in cell.outputs))
        cells.append(cell)
    nb.cells = cells
    nb.metadata["language_info"] = {"name": "python"}  # code cells become ```python blocks (tests/test_readme.py runs them)
    body, _ = MarkdownExporter().from_notebook_node(nb)
    body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
    return "<!-- Generated from nbs/index.ipynb by tools/make_readme.py: edit the notebook, not this file. -->\n\n" + body


def main(argv):
    text, dest = readme_text(), ROOT / "README.md"
    if "--check" in argv:
        if not dest.exists() or dest.read_text() != text:
            print("README.md is out of date with nbs/index.ipynb: run `make readme`.", file=sys.stderr)
            return 1
        return 0
    if not dest.exists() or dest.read_text() != text: dest.write_text(text)
    return 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
