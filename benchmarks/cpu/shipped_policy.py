"""The shipped default base policy against its recipe (issue 77): build ``default`` from the recipe in a scratch
cache, in a fresh pinned erft process (``ERFT_BUILD_FROM_RECIPE=1``: never from the shipped copy), and compare
every file it writes, byte for byte (SHA-256), with ``src/entropy_rft/training/shipped_policies/<folder>/``. Exit 0
when all agree, 1 naming each file that differs. ``.ci/run`` runs it (about 5-11 minutes on 2 cores).

``--write`` (after a recipe change, with its new ``RECIPE_VERSION``) replaces the shipped folder with the fresh
build instead; commit it with the recipe.

Usage: ``.venv/bin/python -m benchmarks.cpu.shipped_policy [--write]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "src" / "entropy_rft" / "training" / "shipped_policies"
BUILD = """
from entropy_rft.common.numerics import pin_cpu_numerics
pin_cpu_numerics()
from entropy_rft.training.policies import resolve_policy, choose_mkl_branch, exact_gemm
choose_mkl_branch(exact_gemm("default"))
print(resolve_policy("default"))
"""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="Replace the shipped folder with the fresh build.")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="erft-shipped-") as scratch:
        env = {**os.environ, "ERFT_CACHE": scratch, "ERFT_BUILD_FROM_RECIPE": "1"}
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"shipped_policy: the build failed:\n{res.stderr[-2000:]}", file=sys.stderr)
            return 2
        built = Path(res.stdout.strip().splitlines()[-1])
        print(f"built {built.name} from the recipe in {time.monotonic() - t0:.0f} s")
        target = SHIPPED / built.name
        if args.write:
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(built, target)
            print(f"written to {target.relative_to(ROOT)}")
            return 0
        if not target.is_dir():
            print(f"shipped_policy: the package ships no {built.name} (the recipe changed?): run with --write",
                  file=sys.stderr)
            return 1
        files = json.loads((built / "erft_build.json").read_text())["files"]
        differ = [name for name in sorted(files) if not (target / name).is_file() or sha(target / name) !=
                  sha(built / name)]
        extra = sorted({f.name for f in target.iterdir()} - set(files) - {"erft_build.json"})
        for name in differ:
            print(f"DIFFERS: {name}: the recipe builds {sha(built / name)[:12]}..., the package ships "
                  f"{sha(target / name)[:12] if (target / name).is_file() else 'nothing'}...", file=sys.stderr)
        for name in extra:
            print(f"DIFFERS: {name}: shipped, not built by the recipe", file=sys.stderr)
        if differ or extra:
            return 1
        print(f"the shipped {built.name} is the recipe's build: {len(files)} files, byte for byte "
              f"(model.safetensors {sha(built / 'model.safetensors')[:12]}...)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
