"""The names users reach for stay importable from where the docs show them (issue 26 item 7): every
``from entropy_rft... import ...`` line in README.md, docs/*.md and examples/*.py imports, the top-level short
path serves the public names, and ``import entropy_rft`` alone does not load torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import entropy_rft

ROOT = Path(__file__).resolve().parents[1]
IMPORT = re.compile(r"^\s*from (entropy_rft[\w.]*) import ([\w, ()]+)$", re.M)


def doc_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) for every entropy_rft import written in the docs and examples."""
    out = []
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]
    for f in files:
        for mod, names in IMPORT.findall(f.read_text()):
            for name in names.replace("(", "").replace(")", "").split(","):
                if name.strip():
                    out.append((f.relative_to(ROOT).as_posix(), mod, name.strip()))
    return out


def test_every_import_the_docs_show_works():
    imports = doc_imports()
    assert len(imports) >= 8, imports  # the README's library block, the TRL pages and the examples
    for where, mod, name in imports:
        module = __import__(mod, fromlist=[name])
        assert hasattr(module, name), f"{where}: from {mod} import {name}"


def test_the_top_level_short_path():
    from entropy_rft import TokenStats, build_method, policy_loss, predicted_entropy_change, token_stats
    from entropy_rft.core.dynamics import token_stats as deep
    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    assert token_stats is deep and TokenStats.__name__ == "TokenStats"
    assert callable(policy_loss) and callable(predicted_entropy_change)
    assert build_method("clip_v").name == "clip_v"
    assert EntropyControlGRPOTrainer.__name__ == "EntropyControlGRPOTrainer"
    for name in entropy_rft.PUBLIC:
        assert getattr(entropy_rft, name) is not None, name


def test_importing_the_package_does_not_load_torch():
    code = "import sys, entropy_rft; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_the_readme_is_a_quickstart_and_nothing_points_outside_the_repository():
    """Issue 26 item 6: README at most ~200 lines; the rest lives in docs/, and no tracked text file points at
    ../shared (which is not in the repository)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = [f for f in tracked if f.endswith((".py", ".md", ".yaml", ".toml", ".sh", ".txt"))
                 and f != "tests/test_public_api.py" and "../shared" in (ROOT / f).read_text(errors="ignore")]
    assert not offenders, offenders
