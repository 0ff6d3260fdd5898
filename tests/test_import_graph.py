"""The shape of the package, read from its source with `ast` (nothing is imported):

* the graph of imports between mambaserve modules has no cycle;
* the Triton kernels (mambaserve/ops/triton/) import no mambaserve module outside that package;
* no module is over MAX_LINES lines unless its docstring has a line "Long module: <reason>".

Every import counts: module-level ones and those inside functions (lazy imports are still
dependencies), `import a.b`, `from a import b` (an edge to the submodule a.b when there is one,
else to the package a), relative imports, and `__import__` / `importlib.import_module` calls with
a constant name. A package's `__init__` importing its own submodules makes edges too; an
`__init__.py` with no import statement is left out of the graph (importing it runs nothing).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parents[1] / "mambaserve"
ROOT = PKG_DIR.parent
TRITON_PKG = "mambaserve.ops.triton"
MAX_LINES = 450
LONG_MARK = "Long module:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    mods = {module_name(p): p for p in sorted(PKG_DIR.rglob("*.py"))}
    assert "mambaserve.cli" in mods and TRITON_PKG in mods, sorted(mods)
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve_relative(importer: str, is_pkg: bool, level: int, module: str | None) -> str:
    parts = importer.split(".")
    if not is_pkg:
        parts.pop()  # a module's relative imports start from its package
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _longest_known(name: str, mods: dict[str, Path]) -> str | None:
    """`a.b.c` -> the longest of a.b.c, a.b, a that is a module of the package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def _dynamic_import_name(node: ast.Call) -> str | None:
    """The constant module name of `__import__("x", ...)` / `importlib.import_module("x")`."""
    f = node.func
    named = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
        isinstance(f, ast.Attribute) and f.attr == "import_module")
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(
            node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported mambaserve module, line) for every import in the module's source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, int]] = []

    def add(target: str | None, line: int) -> None:
        if target is not None and (target + ".").startswith("mambaserve."):
            known = _longest_known(target, mods)
            if known is not None:
                out.append((known, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(name, _is_package(path), node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in mods else base, node.lineno)
        elif isinstance(node, ast.Call):
            add(_dynamic_import_name(node), node.lineno)
    return sorted(out, key=lambda e: e[1])


def has_imports(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree))


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """Edges importer -> imported (self-imports dropped) and the first line of each edge."""
    mods = package_modules()
    inert = {m for m, p in mods.items() if _is_package(p) and not has_imports(p)}
    graph: dict[str, set[str]] = {m: set() for m in mods if m not in inert}
    lines: dict[tuple[str, str], int] = {}
    for m in graph:
        for target, line in imports_of(m, mods[m], mods):
            if target != m and target not in inert:
                graph[m].add(target)
                lines.setdefault((m, target), line)
    return graph, lines


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (a self-edge is never recorded)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth <= the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(comps)


def a_cycle(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, closed (first == last)."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not strongly connected")


def describe_cycle(cycle: list[str], lines: dict[tuple[str, str], int]) -> str:
    mods = package_modules()
    return "; ".join(f"{a} -> {b} ({mods[a].relative_to(ROOT)}:{lines[a, b]})"
                     for a, b in zip(cycle, cycle[1:]))


# ---- the checks -----------------------------------------------------------------------------
def test_no_import_cycles():
    graph, lines = import_graph()
    # the walk sees the package: the top-level API's own imports are edges
    assert {"mambaserve.engine.llm", "mambaserve.engine.sampling_params"} <= graph["mambaserve"]
    comps = strongly_connected(graph)
    msg = [f"{len(comps)} import cycle(s) between mambaserve modules (source lines of a cycle "
           "through each; a lazy import inside a function counts):"]
    for comp in comps:
        msg.append(f"  modules {comp}:\n    " + describe_cycle(a_cycle(graph, comp), lines))
    assert not comps, "\n".join(msg)


def test_triton_kernels_import_only_their_own_package():
    graph, lines = import_graph()
    mods = package_modules()
    bad = sorted((m, t) for m in graph if m == TRITON_PKG or m.startswith(TRITON_PKG + ".")
                 for t in graph[m] if t != TRITON_PKG and not t.startswith(TRITON_PKG + "."))
    assert not bad, f"{TRITON_PKG} modules importing mambaserve modules outside it:\n" + "\n".join(
        f"  {m} -> {t} ({mods[m].relative_to(ROOT)}:{lines[m, t]})" for m, t in bad)


def too_long_without_reason(text: str) -> bool:
    if len(text.splitlines()) <= MAX_LINES:
        return False
    doc = ast.get_docstring(ast.parse(text)) or ""
    return not any(line.strip().startswith(LONG_MARK) for line in doc.splitlines())


def test_long_modules_say_why():
    offenders = [f"  {path.relative_to(ROOT)}: {len(path.read_text().splitlines())} lines"
                 for path in package_modules().values()
                 if too_long_without_reason(path.read_text())]
    assert not offenders, (f"modules over {MAX_LINES} lines without a '{LONG_MARK} <reason>' "
                           "line in their docstring:\n" + "\n".join(offenders))


# ---- the checker itself, on small graphs and sources -----------------------------------------
def test_cycle_finder_reports_every_component_and_a_real_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    comps = strongly_connected(graph)
    assert comps == [["a", "b", "c"], ["e", "f"]]
    assert a_cycle(graph, comps[0]) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_long_module_needs_a_reason_in_its_docstring():
    body = "x = 1\n" * MAX_LINES
    assert not too_long_without_reason('"""Short."""\n' + "x = 1\n" * (MAX_LINES - 1))
    assert too_long_without_reason('"""Short."""\n' + body)
    assert not too_long_without_reason('"""Long module: on the first line."""\n' + body)
    assert too_long_without_reason('"""Kernels.\n\nA Long module: mid-line."""\n' + body)
    assert not too_long_without_reason('"""Kernels.\n\nLong module: one launch."""\n' + body)
    assert too_long_without_reason('# Long module: a comment, not the docstring\n' + body)


def test_import_resolution(tmp_path):
    mods = dict.fromkeys(["mambaserve", "mambaserve.cli", "mambaserve.ops", "mambaserve.ops.ssd",
                          "mambaserve.ops.triton", "mambaserve.ops.triton.conv",
                          "mambaserve.ops.triton.ssd"], Path("unused.py"))
    src = tmp_path / "ssd.py"
    src.write_text(
        "import os\n"
        "from . import conv as _conv\n"                                # 2: sibling submodule
        "from .. import ssd\n"                                         # 3: mambaserve.ops.ssd
        "from mambaserve.ops import triton\n"                          # 4: submodule
        "from mambaserve import SamplingParams\n"                      # 5: the package
        "def f():\n"
        "    import mambaserve.ops.ssd.nothing_here\n"                 # 7: longest module prefix
        "    return __import__('mambaserve.cli', fromlist=['main'])\n"  # 8: dynamic
    )
    got = imports_of("mambaserve.ops.triton.ssd", src, mods)
    assert got == [("mambaserve.ops.triton.conv", 2), ("mambaserve.ops.ssd", 3),
                   ("mambaserve.ops.triton", 4), ("mambaserve", 5), ("mambaserve.ops.ssd", 7),
                   ("mambaserve.cli", 8)]
    assert _resolve_relative("mambaserve.ops.triton", True, 1, "ssd") == "mambaserve.ops.triton.ssd"
    assert _resolve_relative("mambaserve.ops.triton.ssd", False, 2, None) == "mambaserve.ops"
