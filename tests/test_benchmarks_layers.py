"""benchmarks/ keeps the house's rules (issue 66), read from the code itself (the AST of every script, lazy imports
included), as tests/test_architecture.py keeps src/'s:

- a module imports the benchmarks' own modules by bare name (each folder puts itself on ``sys.path``); a name
  resolves in the importer's folder first, then ``gpu/``, then ``lease/``;
- layers (benchmarks/README.md, "Layers"): ``cpu/`` and the top-level scripts import none of the others; ``gpu/``
  imports only ``gpu/``; ``lease/`` imports ``lease/`` and ``gpu/``;
- no modules import each other in a cycle; no module is over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
MAX_LINES = 500
MAY_IMPORT = {"": set(), "cpu": set(), "gpu": {"gpu"}, "lease": {"lease", "gpu"}}


def modules() -> dict[tuple[str, str], Path]:
    """(folder, module name) -> file, for every script of benchmarks/ (folder "" for the top level)."""
    out = {}
    for p in sorted(BENCH.rglob("*.py")):
        folder = p.parent.relative_to(BENCH).as_posix()
        out[("" if folder == "." else folder, p.stem)] = p
    return out


def imported_names(path: Path) -> list[tuple[str, int]]:
    """(top-level module name, line) of every import in ``path``, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module.split(".")[0], node.lineno))
    return out


def edges(mods: dict[tuple[str, str], Path]) -> dict[tuple[str, str], list[tuple[tuple[str, str], int]]]:
    """Each module's imports of benchmarks' own modules, resolved as the scripts' ``sys.path`` resolves them."""
    out: dict = {}
    for (folder, name), path in mods.items():
        out[(folder, name)] = []
        for mod, line in imported_names(path):
            for where in (folder, "gpu", "lease"):
                if (where, mod) in mods and (where, mod) != (folder, name):
                    out[(folder, name)].append(((where, mod), line))
                    break
    return out


def test_each_folder_imports_only_its_layer_and_below():
    bad = [f"{f}/{n}.py:{line} imports {g}/{m}" for (f, n), targets in edges(modules()).items()
           for (g, m), line in targets if g not in MAY_IMPORT[f]]
    assert not bad, bad


def test_no_circle_among_the_benchmarks_modules():
    graph = {k: [t for t, _ in v] for k, v in edges(modules()).items()}
    state: dict = {}
    cycles = []

    def visit(node, path):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(f"{f}/{n}" for f, n in path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_no_module_over_500_lines():
    long = {str(p.relative_to(BENCH)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_rules_see_what_they_judge():
    """The resolver finds the imports the rules are about (a rule over an empty graph could not fail)."""
    e = edges(modules())
    assert {("gpu", "realm_wave")} <= {t for t, _ in e[("gpu", "realm")]} and ("gpu", "pace") in [
        t for t, _ in e[("gpu", "realm_wave")]]
    assert ("gpu", "pace") in [t for t, _ in e[("lease", "shrink")]]
    assert ("lease", "checks") in [t for t, _ in e[("lease", "collect")]]
