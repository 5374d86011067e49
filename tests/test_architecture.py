"""docs/architecture.md is true: every module is on the map, and no import points to a higher layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "entropy_rft"


def layer_map() -> dict[str, int]:
    """Module (top-level name under entropy_rft) -> layer, read from the table in docs/architecture.md."""
    layers: dict[str, int] = {}
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[-1].split("\n## ", 1)[0]
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\.[^|]*\|([^|]*)\|", line)
        if m:
            for name in re.findall(r"`([a-z_]+)/?`", m.group(2)):
                layers[name] = int(m.group(1))
    return layers


def imports(path: Path) -> list[tuple[str, int]]:
    """(top-level entropy_rft module, line) for every import in ``path``, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "entropy_rft":
            parts = node.module.split(".")
            names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("entropy_rft.")]
        out += [(n, node.lineno) for n in names]
    return out


def modules() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if p.relative_to(SRC).parts[0] != "__init__.py"]


def test_every_module_is_on_the_map():
    layers = layer_map()
    assert len(layers) > 20, "the layer table of docs/architecture.md was not found"
    missing = sorted({p.relative_to(SRC).parts[0].removesuffix(".py") for p in modules()} - set(layers))
    assert not missing, f"modules missing from docs/architecture.md: {missing}"


def test_no_import_points_up():
    layers = layer_map()
    up = []
    for path in modules():
        me = path.relative_to(SRC).parts[0].removesuffix(".py")
        for name, line in imports(path):
            if name in layers and layers[name] > layers[me]:
                up.append(f"{path.relative_to(SRC)}:{line} (layer {layers[me]}) imports {name} (layer {layers[name]})")
    assert not up, "\n".join(up)


def test_the_check_sees_an_upward_import(tmp_path):
    """The import parser finds lazy imports and both import forms (so the check above can fail)."""
    f = tmp_path / "m.py"
    f.write_text("import entropy_rft.trainer\n"
                 "def g():\n    from entropy_rft import cli\n    from entropy_rft.rundir import x\n")
    assert imports(f) == [("trainer", 1), ("cli", 3), ("rundir", 4)]
