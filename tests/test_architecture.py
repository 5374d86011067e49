"""The house keeps its architecture, read from the code itself (the AST of every module, lazy imports included).

- Every package under ``entropy_rft`` is one layer of docs/architecture.md's table, in the table's order.
- No import points to a higher layer, and no modules import each other in a cycle (within a package too).
- No module is over 500 lines.
- Nothing inside the package imports the top-level facade (``from entropy_rft import token_stats``): that
  short path is for users; inside, every import names the module that defines the name.
- Nor a package's face: a name imported from a package's ``__init__`` (``from entropy_rft.control import
  Method``, or ``control.build_method`` after ``from entropy_rft import control``) must be defined there or be a
  submodule; a name the face only re-exports is imported from its defining module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "entropy_rft"
MAX_LINES = 500


def layer_order(text: str | None = None) -> list[str]:
    """The packages of docs/architecture.md's layer table, lowest layer first."""
    text = text if text is not None else (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[-1].split("\n## ", 1)[0]
    rows = [re.match(r"\|\s*(\d+)\s*\|\s*`([a-z_]+)/`\s*\|", line) for line in section.splitlines()]
    rows = [m for m in rows if m]
    assert [int(m.group(1)) for m in rows] == list(range(len(rows))), "layers must be numbered 0, 1, 2, ..."
    return [m.group(2) for m in rows]


def module_names(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name (``core.dynamics``, ``control`` for a package's __init__) -> file."""
    out = {}
    for p in sorted(src.rglob("*.py")):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_edges(path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(dotted module under entropy_rft, line) for every import of the project in ``path``, lazy ones included.

    ``from entropy_rft.a import b`` names module ``a.b`` when that is a module, else ``a``; ``""`` is the
    top-level facade."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "entropy_rft":
            mod = node.module.removeprefix("entropy_rft").lstrip(".")
            for a in node.names:
                sub = f"{mod}.{a.name}" if mod else a.name
                out.append((sub if sub in known else mod, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name.removeprefix("entropy_rft."), node.lineno) for a in node.names
                    if a.name.startswith("entropy_rft.")]
    return out


def package_of(module: str) -> str:
    return module.split(".")[0]


def graph(src: Path = SRC) -> tuple[dict[str, Path], dict[str, list[tuple[str, int]]]]:
    mods = module_names(src)
    return mods, {m: [(t, line) for t, line in import_edges(p, set(mods)) if t != m] for m, p in mods.items()}


def find_cycle(edges: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t, _ in edges.get(m, []):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t in edges and not state.get(t):
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if not state.get(m):
            found = visit(m)
            if found:
                return found
    return None


def upward_imports(order: list[str], mods: dict[str, Path], edges) -> list[str]:
    rank = {p: i for i, p in enumerate(order)}
    bad = []
    for m, targets in edges.items():
        if m == "":
            continue
        for t, line in targets:
            if t == "":
                bad.append(f"{mods[m].relative_to(SRC.parent)}:{line} imports the top-level facade entropy_rft")
            elif rank[package_of(t)] > rank[package_of(m)]:
                bad.append(f"{mods[m].relative_to(SRC.parent)}:{line} ({package_of(m)}, layer {rank[package_of(m)]})"
                           f" imports {t} (layer {rank[package_of(t)]})")
    return bad


def test_every_package_is_one_layer_of_the_map():
    order = layer_order()
    packages = sorted({package_of(m) for m in module_names() if m})
    assert sorted(order) == packages, (f"docs/architecture.md's layers {order} must list each package once: "
                                       f"{packages}")
    loose = [p.name for p in SRC.glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside the layer packages: {loose}"


def test_no_import_points_up():
    mods, edges = graph()
    bad = upward_imports(layer_order(), mods, edges)
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    _, edges = graph()
    cycle = find_cycle({m: t for m, t in edges.items() if m})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_over_500_lines():
    long = {str(p.relative_to(SRC.parent)): n for p in module_names().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def face_names(path: Path) -> tuple[set[str], dict[str, str]]:
    """A package ``__init__``'s own top-level names (defs, classes, assignments), and the names it re-exports with
    the module each comes from."""
    own: set[str] = set()
    reexported: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Assign):
            own |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.ImportFrom) and node.module:
            reexported |= {a.asname or a.name: node.module for a in node.names}
    return own, reexported


def through_faces(src: Path = SRC) -> list[str]:
    """Every import of a name through a package face that does not define it: ``path:line: NAME through FACE``
    with the module to import it from."""
    mods = module_names(src)
    faces = {m: face_names(p) for m, p in mods.items() if m and p.name == "__init__.py"}
    bad = []

    def check(m: str, face: str, name: str, line: int) -> None:
        own, reexported = faces[face]
        if m == face or f"{face}.{name}" in mods or name in own:  # the face itself, a submodule, its own name
            return
        where = reexported.get(name, "its defining module")
        bad.append(f"{mods[m].relative_to(src.parent)}:{line}: {name} through entropy_rft.{face}'s __init__; "
                   f"import it from {where}")

    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # a name this module binds to a package face -> the face
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "entropy_rft":
                mod = node.module.removeprefix("entropy_rft").lstrip(".")
                for a in node.names:
                    if mod in faces:
                        check(m, mod, a.name, node.lineno)
                    elif not mod and a.name in faces:
                        bound[a.asname or a.name] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                check(m, bound[node.value.id], node.attr, node.lineno)
    return bad


def test_every_import_names_the_module_that_defines_it():
    bad = through_faces()
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
    """The parser sees lazy imports and both import forms; the checks flag an upward import, the facade and a
    cycle, on a made-up package."""
    src = tmp_path / "entropy_rft"
    for d in ("low", "high"):
        (src / d).mkdir(parents=True)
        (src / d / "__init__.py").write_text("")
    (src / "__init__.py").write_text("")
    (src / "low" / "a.py").write_text("def f():\n    from entropy_rft.high import b\n")
    (src / "low" / "c.py").write_text("import entropy_rft.low.d\nfrom entropy_rft import token_stats\n")
    (src / "low" / "d.py").write_text("from entropy_rft.low import c\n")
    (src / "high" / "b.py").write_text("from entropy_rft.low.a import f\n")
    mods, edges = graph(src)
    assert edges["low.a"] == [("high.b", 2)]
    assert edges["low.c"] == [("low.d", 1), ("", 2)]
    global SRC
    old, SRC = SRC, src
    try:
        bad = upward_imports(["low", "high"], mods, edges)
    finally:
        SRC = old
    assert len(bad) == 2 and "imports high.b (layer 1)" in bad[0] and "facade" in bad[1], bad
    assert find_cycle({m: t for m, t in edges.items() if m}) in (["low.c", "low.d", "low.c"],
                                                                 ["high.b", "low.a", "high.b"],
                                                                 ["low.a", "high.b", "low.a"])
    # a name through a face that only re-exports it, in both forms; a submodule and a name the face defines pass
    (src / "low" / "__init__.py").write_text("from entropy_rft.low.d import g\nOWN = 1\n")
    (src / "high" / "e.py").write_text("from entropy_rft.low import OWN, a, g\nfrom entropy_rft import low\n"
                                       "x = (low.g, low.OWN, low.c)\n")
    faced = through_faces(src)
    assert faced == ["entropy_rft/high/e.py:1: g through entropy_rft.low's __init__; import it from entropy_rft.low.d",
                     "entropy_rft/high/e.py:3: g through entropy_rft.low's __init__; import it from entropy_rft.low.d"]
    table = "## Layers\n| layer | package |\n|---|---|\n| 0 | `low/` | x |\n| 1 | `high/` | y |\n## Next\n"
    assert layer_order(table) == ["low", "high"]
