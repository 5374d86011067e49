"""benchmarks/ keeps the house's rules (issues 66 and 78), read from the code itself (the AST of every module, lazy
imports included), as tests/test_architecture.py keeps src/'s:

- benchmarks/ is a package; its modules import each other as ``benchmarks.<folder>.<module>`` (absolute, or
  relative within the package), never by a bare name, and none changes ``sys.path`` but ``benchmarks/__init__.py``
  (the one bootstrap: the checkout's ``src/`` for a machine without the package installed);
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

Key = tuple[str, str]  # (folder, module name): folder "" for the top level, name "__init__" for a folder's package


def modules(bench: Path = BENCH) -> dict[Key, Path]:
    """(folder, module name) -> file, for every module of benchmarks/."""
    out = {}
    for p in sorted(bench.rglob("*.py")):
        folder = p.parent.relative_to(bench).as_posix()
        out[("" if folder == "." else folder, p.stem)] = p
    return out


def _show(key: Key) -> str:
    folder, name = key
    return f"{folder}/{name}" if folder else name


def _resolve(parts: list[str], mods: dict[Key, Path]) -> Key | None:
    """The module that ``benchmarks.<parts>`` names: a module, else a folder's package (``__init__``); None when
    it names neither."""
    if parts and ("/".join(parts[:-1]), parts[-1]) in mods:
        return ("/".join(parts[:-1]), parts[-1])
    return ("/".join(parts), "__init__") if ("/".join(parts), "__init__") in mods else None


def imports(key: Key, path: Path, mods: dict[Key, Path]) -> tuple[list[tuple[Key, int]], list[str]]:
    """The benchmarks' own modules ``path`` imports, with their lines, and its imports of them by a bare name."""
    package = key[0].split("/") if key[0] else []  # what a relative import starts from (a folder's __init__ too)
    stems = {name for _, name in mods if name != "__init__"}
    found: list[tuple[Key, int]] = []
    bare: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[Key | None] = []
        if isinstance(node, ast.Import):
            for a in node.names:
                top, *rest = a.name.split(".")
                if top == "benchmarks":
                    targets.append(_resolve(rest, mods))
                elif top in stems:
                    bare.append(f"{_show(key)}.py:{node.lineno} imports {a.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module.split(".") if node.module else []
            if node.level:
                if node.level - 1 > len(package):
                    continue
                base = package[:len(package) - (node.level - 1)] + module
            elif module[:1] == ["benchmarks"]:
                base = module[1:]
            else:
                if module[:1] and module[0] in stems:
                    bare.append(f"{_show(key)}.py:{node.lineno} imports {node.module}")
                continue
            # ``from benchmarks.gpu import pace``: the module pace where there is one, else what base names
            targets += [_resolve(base + [a.name], mods) or _resolve(base, mods) for a in node.names]
        found += [(t, node.lineno) for t in dict.fromkeys(targets) if t is not None and t != key]
    return found, bare


def edges(mods: dict[Key, Path]) -> dict[Key, list[tuple[Key, int]]]:
    """Each module's imports of benchmarks' own modules."""
    return {key: imports(key, path, mods)[0] for key, path in mods.items()}


def bare_imports(mods: dict[Key, Path]) -> list[str]:
    return [line for key, path in mods.items() for line in imports(key, path, mods)[1]]


def path_changes(mods: dict[Key, Path]) -> list[str]:
    """Every ``sys.path`` change (``insert``, ``append``, an assignment) outside ``benchmarks/__init__.py``."""
    out = []
    for (folder, name), path in mods.items():
        if (folder, name) == ("", "__init__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "path" and isinstance(node.value.value, ast.Name)
                    and node.value.value.id == "sys" and node.attr in ("insert", "append", "extend")):
                out.append(f"{_show((folder, name))}.py:{node.lineno} sys.path.{node.attr}")
    return out


def layer_breaks(e: dict[Key, list[tuple[Key, int]]]) -> list[str]:
    return [f"{_show(k)}.py:{line} imports {_show(t)}" for k, targets in e.items() for t, line in targets
            if t[0] not in MAY_IMPORT.get(k[0], set())]


def cycles(e: dict[Key, list[tuple[Key, int]]]) -> list[str]:
    graph = {k: [t for t, _ in v] for k, v in e.items()}
    state: dict = {}
    found = []

    def visit(node, path):
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                found.append(" -> ".join(_show(k) for k in path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    return found


def test_benchmarks_is_a_package():
    missing = [f"{f}/__init__.py" if f else "__init__.py" for f in MAY_IMPORT if (f, "__init__") not in modules()]
    assert not missing, f"benchmarks/ lacks {missing}: each folder is a package (python -m benchmarks.<folder>.<name>)"


def test_no_bare_name_import_and_no_path_change():
    mods = modules()
    assert not bare_imports(mods), bare_imports(mods)
    assert not path_changes(mods), path_changes(mods)


def test_each_folder_imports_only_its_layer_and_below():
    bad = layer_breaks(edges(modules()))
    assert not bad, bad


def test_no_circle_among_the_benchmarks_modules():
    found = cycles(edges(modules()))
    assert not found, found


def test_no_module_over_500_lines():
    long = {str(p.relative_to(BENCH)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_rules_see_what_they_judge():
    """The resolver finds the imports the rules are about (a rule over an empty graph could not fail)."""
    e = edges(modules())
    assert ("gpu", "realm_wave") in [t for t, _ in e[("gpu", "realm")]]
    assert ("gpu", "pace") in [t for t, _ in e[("gpu", "realm_wave")]]
    assert ("gpu", "pace") in [t for t, _ in e[("lease", "shrink")]]
    assert ("lease", "checks") in [t for t, _ in e[("lease", "collect")]]
    assert ("gpu", "kernels_report") in [t for t, _ in e[("lease", "collect")]]


def test_the_checks_can_fail(tmp_path):
    """On a made-up benchmarks/: every import form (absolute, ``from`` a folder, relative, lazy) is seen, and a
    lower folder importing a higher one, a cycle, a bare name and a ``sys.path`` change are each flagged."""
    bench = tmp_path / "benchmarks"
    for d in ("cpu", "gpu", "lease"):
        (bench / d).mkdir(parents=True)
        (bench / d / "__init__.py").write_text("")
    (bench / "__init__.py").write_text("import sys\nsys.path.append('src')\n")  # the one bootstrap: allowed
    (bench / "gpu" / "a.py").write_text("def f():\n    from benchmarks.lease import k\n")  # gpu -> lease: up
    (bench / "gpu" / "b.py").write_text("from . import c\n")
    (bench / "gpu" / "c.py").write_text("import benchmarks.gpu.b\n")  # b <-> c: a cycle
    (bench / "lease" / "k.py").write_text("from ..gpu.a import f\nfrom benchmarks.gpu import b, c\n")
    (bench / "cpu" / "t.py").write_text("import sys\nsys.path.insert(0, 'x')\nimport k\n")  # a bare name, a path
    mods = modules(bench)
    e = edges(mods)
    assert e[("gpu", "a")] == [(("lease", "k"), 2)]
    assert e[("lease", "k")] == [(("gpu", "a"), 1), (("gpu", "b"), 2), (("gpu", "c"), 2)]
    assert layer_breaks(e) == ["gpu/a.py:2 imports lease/k"]
    assert cycles(e) and any("gpu/b -> gpu/c -> gpu/b" in c or "gpu/c -> gpu/b -> gpu/c" in c for c in cycles(e))
    assert bare_imports(mods) == ["cpu/t.py:3 imports k"]
    assert path_changes(mods) == ["cpu/t.py:2 sys.path.insert"]
