"""The model cache: where built policies live and how a folder is built once, atomically, under a file lock.

Layout (``cache_root()``: ``$ERFT_CACHE``, else ``$XDG_CACHE_HOME/entropy-rft``, else
``~/.cache/entropy-rft``)::

    <cache>/models/countdown-llama-v3-seed0/          default base policy (v3 = recipe version), CPU pin
    <cache>/models/countdown-llama-v3-seed0-<hash>/   same recipe with non-default build parameters
    <cache>/models/countdown-llama-v3-seed0-native-avx512/   built outside the CPU pin (common.numerics)
    <cache>/models/smollm2-135m-instruct-q4_1-v1/     converted SmolLM2
    <cache>/models/.<folder>.lock                     the build lock

Each folder holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer files
and ``erft_build.json`` (build info and metrics). A folder is built in a temporary sibling and renamed
into place under a file lock, so it either does not exist or is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

INFO_FILE = "erft_build.json"
LOCK_TIMEOUT_S = 3600.0


def cache_root() -> Path:
    """``$ERFT_CACHE``, else ``$XDG_CACHE_HOME/entropy-rft``, else ``~/.cache/entropy-rft``."""
    if os.environ.get("ERFT_CACHE"):
        return Path(os.environ["ERFT_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "entropy-rft"
    return Path.home() / ".cache" / "entropy-rft"


def models_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder that holds cached models: ``<cache>/models``."""
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "models"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished build (its info file is written last)."""
    return (folder / INFO_FILE).is_file()


def read_build_info(folder: str | os.PathLike) -> dict[str, Any]:
    """The ``erft_build.json`` of a cached folder (``{}`` if it has none)."""
    path = Path(folder) / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_build_info(folder: Path, info: dict[str, Any]) -> None:
    """Write ``erft_build.json``; call it last, it marks the folder as complete."""
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def cached_build(final: Path, build: Callable[[Path], None], *, timeout: float = LOCK_TIMEOUT_S) -> Path:
    """Return ``final``, building it first with ``build(tmp_dir)`` if it is missing.

    The build runs under a file lock, into a temporary sibling folder that is renamed onto ``final``
    with ``os.replace``, so another process either finds nothing (and waits on the lock) or a complete
    folder. ``build`` must write the info file (:func:`write_build_info`) last. Temporary folders left
    by a killed build are removed by the next one.
    """
    final = Path(final)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock"), timeout=timeout):
        if is_complete(final):
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # an incomplete folder not made by us (e.g. a file deleted by hand)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the cache is a normal folder
        try:
            build(tmp)
            if not is_complete(tmp):
                raise RuntimeError(f"build of {final.name} did not write {INFO_FILE}")
            try:
                os.replace(tmp, final)
            except OSError:
                if not is_complete(final):  # someone placed a finished folder without the lock: keep it
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
