"""The built-in base policy's pinned build, shipped with the package (issue 77).

Building ``default`` takes minutes (690 SFT steps; 5.4 min on one 2-core Xeon, 10.7 on another under MKL's
COMPATIBLE branch), and the pin promises the same bytes on every x86-64 CPU. So the package can carry those bytes
(``shipped_policies/<cache folder name>/``, about 5.3 MB: the weights, the tokenizer, the config and the build's
own ``erft_build.json`` with the SHA-256 of every file it wrote), and a cache without the folder then gets a copy of
them instead of a build: only when the folder asked for is exactly the shipped one (its name carries the recipe
version, the seed, the parameters and the instruction set, so a changed recipe or an unpinned build never takes
it) and its files match the checksums their build recorded.

It ships nothing yet: the one build made for it, on an AMD EPYC of family 26 (2026-12-06), did not reproduce the
README's table (``make run`` there printed other figures from its own build as from the shipped copy), so its
bytes are not the ones the README promises. Ship them from a CPU whose ``make run`` prints the README's table:
``python -m benchmarks.cpu.shipped_policy --write``, then ``make check-shipped`` in ``.ci/run``.

What guards it: the suite checks the shipped files against their build's record and the shipped folder's name
and settings against ``sft.default_policy_dir`` and ``sft.DEFAULT_BUILD`` (a recipe changed without a new
build fails there); ``benchmarks/cpu/shipped_policy.py`` (``make check-shipped``, run by hand until a build ships)
builds the policy from its recipe (``ERFT_BUILD_FROM_RECIPE=1``: never from the shipped copy) and fails unless it
writes the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from entropy_rft.models.loading import write_build_info

SHIPPED_ROOT = Path(__file__).parent / "shipped_policies"
FROM_RECIPE_ENV = "ERFT_BUILD_FROM_RECIPE"  # set (1, true, yes): always build from the recipe


def from_recipe_asked() -> bool:
    return os.environ.get(FROM_RECIPE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def shipped_folder(name: str) -> Path | None:
    """The shipped copy of cache folder ``name`` (e.g. ``countdown-llama-v4-seed0``), None when the package
    ships none, when its files do not match their build's record, or when ``ERFT_BUILD_FROM_RECIPE`` asks for a
    build."""
    from entropy_rft.models.cache import checksum_problem

    folder = SHIPPED_ROOT / name
    if from_recipe_asked() or not (folder / "erft_build.json").is_file():
        return None
    return folder if checksum_problem(folder) is None else None


def install(shipped: Path, out: Path) -> None:
    """Copy a shipped build into ``out`` (a ``cached_build`` temporary folder), its ``erft_build.json`` last,
    marked as installed from the package."""
    for f in sorted(shipped.iterdir()):
        if f.is_file() and f.name != "erft_build.json":
            shutil.copyfile(f, out / f.name)
    info = json.loads((shipped / "erft_build.json").read_text())
    info["installed_from"] = {"package": str(shipped), "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "note": "the pinned build's bytes, shipped with entropy-rft (training/shipped.py)"}
    write_build_info(out, info)
