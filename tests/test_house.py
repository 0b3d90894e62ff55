"""The house rules, checked on the exported library and the notebooks.

* Imports flow one way: a module may import any module exported from an earlier notebook (the numbered reading
  order of `nbs/`), never a later one.
* No module imports another module's private (`_name`) names; what another module needs is public where it lives.
* No exported function or method is longer than 60 lines.
* `help(xtoken_dp)` and `nbs/llms.txt` list every public module with its purpose.
* A notebook's imports have cells of their own (the docs build runs import cells alone).
* Every module notebook opens with its use: the first code cell after the title that is not hidden and not only
  imports is a usage example (no definition) with its output committed.
"""
import ast, json, re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS, LIB = ROOT / "nbs", ROOT / "xtoken_dp"
MAX_FUNCTION_LINES = 60


def _cells(nb_path):
    return json.loads(nb_path.read_text(encoding="utf-8"))["cells"]


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _default_exp(nb_path):
    for cell in _cells(nb_path):
        m = re.search(r"^#\|\s*default_exp\s+(\S+)", _source(cell), re.M)
        if m: return m.group(1)
    return None


def _module_notebooks():
    "(notebook, module) in reading order, for every notebook that exports a module."
    out = []
    for nb in sorted(NBS.glob("*.ipynb")):
        if nb.name.startswith("_"): continue
        mod = _default_exp(nb)
        if mod: out.append((nb, "xtoken_dp." + mod.removesuffix(".__init__")))
    return out


def _module_file(module):
    rel = Path(*module.split(".")[1:])
    return LIB / (str(rel) + ".py") if (LIB / (str(rel) + ".py")).exists() else LIB / rel / "__init__.py"


def _imports(path):
    "Every (module, name or None, line) imported anywhere in the file, top level or inside functions."
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names: yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names: yield base, a.name, node.lineno


def _owner(imported, modules):
    "The library module an import refers to (the longest exported module that prefixes it), or None."
    hits = [m for m in modules if imported == m or imported.startswith(m + ".")]
    return max(hits, key=len) if hits else None


def _library_files():
    return sorted(p for p in LIB.rglob("*.py") if p.name != "_modidx.py")


def test_every_library_file_comes_from_a_notebook():
    exported = {_module_file(m).resolve() for _, m in _module_notebooks()}
    stray = [str(p.relative_to(ROOT)) for p in _library_files()
             if p.resolve() not in exported and p.name != "__init__.py" or
             (p.name == "__init__.py" and p.parent != LIB and p.resolve() not in exported and p.read_text().strip())]
    assert not stray, f"library files that no notebook exports: {stray}"


def test_imports_follow_the_reading_order():
    order = [m for _, m in _module_notebooks()]
    rank = {m: i for i, m in enumerate(order)}
    bad = []
    for nb, module in _module_notebooks():
        for imported, name, line in _imports(_module_file(module)):
            target = _owner(f"{imported}.{name}" if name else imported, order)
            if target is None or target == module: continue
            if rank[target] > rank[module]:
                bad.append(f"{module} (line {line}) imports {target}, which comes later in the reading order")
    assert not bad, "\n".join(bad)


def test_no_private_names_cross_modules():
    modules = [m for _, m in _module_notebooks()] + ["xtoken_dp"]
    bad = []
    for path in _library_files():
        for imported, name, line in _imports(path):
            if not imported.startswith("xtoken_dp"): continue
            if name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} from {imported}")
    assert not bad, "\n".join(bad)


def test_no_exported_function_is_longer_than_60_lines():
    long = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES: long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


_DIRECTIVE = re.compile(r"^\s*#\|\s*(\S+)")


def _only_imports(src):
    code = [l for l in src.splitlines() if l.strip() and not l.lstrip().startswith("#")]
    return all(re.match(r"\s*(from\s+\S+\s+)?import\s", l) for l in code)


def _flags(src):
    return {m.group(1) for line in src.splitlines() if (m := _DIRECTIVE.match(line))}


def _first_code_after_title(cells):
    "The first code cell after the `# Title` that is neither hidden nor only imports."
    title = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                  and re.match(r"^#\s", _source(c).lstrip())), None)
    if title is None: return None
    return next((c for c in cells[title + 1:] if c["cell_type"] == "code" and _source(c).strip()
                 and not _only_imports(_source(c)) and "hide" not in _flags(_source(c))), None)


@pytest.mark.parametrize("nb", [nb for nb, _ in _module_notebooks()], ids=lambda p: p.stem)
def test_module_notebook_opens_with_its_use(nb):
    cell = _first_code_after_title(_cells(nb))
    assert cell is not None, f"{nb.name}: no code cell after the title"
    flags = _flags(_source(cell))
    assert not flags & {"export", "exporti", "exports"}, \
        f"{nb.name}: the first code cell after the title is a definition ({sorted(flags)}), not a usage example"
    assert cell.get("outputs"), f"{nb.name}: the usage cell after the title has no committed output"


def test_every_module_is_listed_with_its_purpose():
    "`help(xtoken_dp)` and `nbs/llms.txt` list every public module with its one-line purpose."
    import xtoken_dp
    llms = (NBS / "llms.txt").read_text(encoding="utf-8")
    modules = [m for _, m in _module_notebooks() if not m.split(".")[-1].startswith("_")]
    missing_doc = [m for m in modules if f"- `{m}`: " not in (xtoken_dp.__doc__ or "")]
    missing_llms = [m for m in modules if f"[{m}](" not in llms and f"- `{m}`: " not in llms]
    assert not missing_doc and not missing_llms, f"help(xtoken_dp) lacks {missing_doc}; llms.txt lacks {missing_llms}"


def _mixes_imports_and_code(source):
    "Whether a cell's top level holds an import and any other statement (magics and shell lines aside)."
    body = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    kinds = {isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.parse(body).body}
    return kinds == {True, False}


def test_imports_have_cells_of_their_own():
    "The docs build runs a notebook's import cells alone, so an import never shares a cell with other code (exported cells aside: the module runs them whole)."
    assert _mixes_imports_and_code("import os\nx = 1") and _mixes_imports_and_code("from a import b\ndef f(): pass")
    assert not _mixes_imports_and_code("import os\nfrom a import b") and not _mixes_imports_and_code("x = 1\n%time y = 2")
    mixed = []
    for nb in sorted(NBS.glob("*.ipynb")):
        for cell in _cells(nb):
            source = _source(cell)
            if cell["cell_type"] != "code" or re.search(r"^#\|\s*(export|exports|exporti)\b", source, re.M): continue
            if _mixes_imports_and_code(source): mixed.append(f"{nb.name} cell {cell.get('id')}")
    assert mixed == [], mixed


MAX_MODULE_LINES, MAX_NOTEBOOK_CODE_LINES = 1400, 2000


def _notebook_code_lines(nb_path):
    "Lines of every code cell of a notebook, hidden test cells included."
    return sum(len(_source(c).splitlines()) for c in _cells(nb_path) if c["cell_type"] == "code")


def test_no_module_or_notebook_is_too_large_to_walk():
    "A newcomer finds their room: no module over 1,400 lines (benchmarks and generated files aside), no notebook over 2,000 code lines."
    big_modules = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _library_files() if "bench" not in p.relative_to(LIB).parts
                   and (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    big_notebooks = [f"{nb.name} ({n} code lines)" for nb in sorted(NBS.glob("*.ipynb"))
                     if (n := _notebook_code_lines(nb)) > MAX_NOTEBOOK_CODE_LINES]
    assert not big_modules and not big_notebooks, f"modules: {big_modules}; notebooks: {big_notebooks}"


def test_import_graph_has_no_cycle():
    "No two library modules import each other, directly or through others (the reading order forbids it; this says where)."
    order = [m for _, m in _module_notebooks()]
    graph = {m: {t for imported, name, _ in _imports(_module_file(m))
                 if (t := _owner(f"{imported}.{name}" if name else imported, order)) not in (None, m)} for m in order}
    state, cycles = {}, []
    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open": cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state: visit(t, path + [t])
        state[m] = "done"
    for m in order:
        if m not in state: visit(m, [m])
    assert cycles == [], cycles


PUBLIC_API = json.loads((ROOT / "tests" / "fixtures" / "public_api.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("module", sorted(PUBLIC_API))
def test_public_names_stay_importable_from_their_paths(module):
    "Every name a module listed in `__all__` (tests/fixtures/public_api.json, taken before the losses, demo and tokenizers became packages) still imports from that module."
    import importlib
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC_API[module] if not hasattr(mod, name)]
    assert missing == [], f"{module} no longer offers {missing}"
