"""The model cache: where built policies live and how a folder is built once, atomically, under a file lock.

Layout (``cache_root()``: ``$ERFT_CACHE``, else ``$XDG_CACHE_HOME/entropy-rft``, else
``~/.cache/entropy-rft``)::

    <cache>/models/countdown-llama-v4-seed0/          default base policy (v4 = recipe version), CPU pin
    <cache>/models/countdown-llama-v4-seed0-<hash>/   same recipe with non-default build parameters
    <cache>/models/countdown-llama-v4-seed0-native-avx512-mkloff/   built outside the CPU pin (common.numerics)
    <cache>/models/smollm2-135m-instruct-q4_1-v1/     converted SmolLM2
    <cache>/models/.<folder>.lock                     the build lock
    <cache>/models/.<folder>.progress.json            a build under way: its process, step, steps, rate

Each folder holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer files
and ``erft_build.json`` (build info and metrics). A folder is built in a temporary sibling and renamed
into place under a file lock, so it either does not exist or is complete.

A cache that cannot lie: the build records the size and SHA-256 of every file it wrote (``files`` in
``erft_build.json``), and ``cached_build`` checks them before it hands the folder out. A folder whose files
changed after their build (a partial overwrite, bit rot: same size, finite values, loadable) or that records no
checksums (built by an older erft) is built again, with one warning line; ``models.load_policy`` of a folder
given by its path whose files do not match its record is refused in one line naming the folder and the fix.
The check hashes every file in full (SmolLM2's 540 MB included) once per process and file version: the digest
is kept for the file's device, inode, size and modification time, so the loads after the first in one process
(the reference model, a second run) cost a ``stat``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from entropy_rft.common.paths import expand_user

INFO_FILE = "erft_build.json"
LOCK_TIMEOUT_S = 3600.0
CHECKSUMS_KEY = "files"  # erft_build.json's record of what the build wrote: {name: {"size", "sha256"}}
_CHUNK = 1 << 22
# Digests computed in this process, by (device, inode, size, mtime_ns): each file version is hashed once.
_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def cache_root() -> Path:
    """``$ERFT_CACHE``, else ``$XDG_CACHE_HOME/entropy-rft``, else ``~/.cache/entropy-rft``."""
    if os.environ.get("ERFT_CACHE"):
        return expand_user(os.environ["ERFT_CACHE"], "ERFT_CACHE")
    if os.environ.get("XDG_CACHE_HOME"):
        return expand_user(os.environ["XDG_CACHE_HOME"], "XDG_CACHE_HOME") / "entropy-rft"
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
    from entropy_rft.common.streams import parse_json

    try:
        data = parse_json(path.read_text()) if path.is_file() else {}
    except ValueError:  # damaged: a build with no record, checked as one
        return {}
    return data if isinstance(data, dict) else {}


def write_build_info(folder: Path, info: dict[str, Any]) -> None:
    """Write ``erft_build.json``; call it last, it marks the folder as complete."""
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def file_sha256(path: Path) -> str:
    """The SHA-256 of ``path`` (hex), computed once per process and file version (device, inode, size, mtime: a
    rename keeps it, a write in place changes it)."""
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def folder_checksums(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file in ``folder`` (not in sub-folders) but the info file."""
    return {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != INFO_FILE}


def record_checksums(folder: Path) -> None:
    """Add the checksums of what a build wrote to its info file (``files``); the info file stays the last write."""
    info = read_build_info(folder)
    info[CHECKSUMS_KEY] = folder_checksums(folder)
    write_build_info(folder, info)


def checksum_problem(folder: str | os.PathLike, *, recorded_only: bool = False) -> str | None:
    """What is wrong with a finished folder's files against the checksums its build recorded, in words (None:
    they match). A folder with no record is a problem unless ``recorded_only``."""
    folder = Path(folder)
    files = read_build_info(folder).get(CHECKSUMS_KEY)
    if not isinstance(files, dict):
        return None if recorded_only else f"{INFO_FILE} records no checksums (built by an older erft)"
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want.get("size"):
            return f"{name} has {size} bytes where its build wrote {want.get('size')}"
        if file_sha256(path) != want.get("sha256"):
            return f"{name} changed after its build (its SHA-256 is not the one {INFO_FILE} records)"
    return None


WAIT_NOTE_S = 60.0  # while another process builds, a line of its progress at this interval


def progress_path(final: Path) -> Path:
    """Where a build of ``final`` under way says how far it is (``write_progress``)."""
    return Path(final).parent / f".{Path(final).name}.progress.json"


def write_progress(final: Path, what: str, step: int, steps: int, started: float) -> None:
    """Record a build's progress (atomically: a reader never sees half of it): this process, what it builds,
    ``step`` of ``steps``, and the wall clock it started at (``time.time()``)."""
    import time

    path = progress_path(final)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "what": what, "step": step, "steps": steps, "started": started,
                               "updated": time.time()}))
    os.replace(tmp, path)


def read_progress(final: Path) -> dict[str, Any] | None:
    """A build's progress record (``write_progress``), None when there is none or it cannot be read."""
    from entropy_rft.common.streams import parse_json

    try:
        data = parse_json(progress_path(final).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and all(isinstance(data.get(k), (int, float)) for k in ("pid", "step", "steps",
                                                                                          "started"))
    return data if ok else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending; a process of another user exists too)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def progress_words(final: Path) -> str | None:
    """``process 1234 builds default: SFT step 230/690, 1.4 steps/s, about 5 min left`` from a build's record
    (None: no build under way). Its text is the cache's own (``what`` is erft's), made visible all the same."""
    import time

    from entropy_rft.common.text import visible

    rec = read_progress(final)
    if rec is None or not _alive(int(rec["pid"])):  # none, or a killed build's leftover
        return None
    step, steps = int(rec["step"]), int(rec["steps"])
    took = max(1e-9, float(rec.get("updated", time.time())) - float(rec["started"]))
    words = f"process {int(rec['pid'])} builds {visible(rec.get('what', Path(final).name))}: step {step}/{steps}"
    if step > 0:
        rate = step / took
        words += f", {rate:.1f} steps/s, about {max(0.0, (steps - step) / rate) / 60:.1f} min left"
    return words


def _wait_for_lock(lock: FileLock, final: Path, timeout: float) -> None:
    """Take the build lock, saying once a minute (on stderr) whose build is under way while another process holds
    it; ``timeout`` as ``FileLock``'s."""
    import time

    from filelock import Timeout

    deadline = time.monotonic() + timeout
    while True:
        try:
            lock.acquire(timeout=max(0.0, min(WAIT_NOTE_S, deadline - time.monotonic())))
            return
        except Timeout:
            if time.monotonic() >= deadline:
                raise
            words = progress_words(final) or "another process builds it (no progress recorded yet)"
            print(f"erft: waiting for the build of {final.name}: {words}", file=sys.stderr, flush=True)


def cached_build(final: Path, build: Callable[[Path], object], *, timeout: float = LOCK_TIMEOUT_S) -> Path:
    """Return ``final``, building it first with ``build(tmp_dir)`` if it is missing.

    The build runs under a file lock, into a temporary sibling folder that is renamed onto ``final``
    with ``os.replace``, so another process either finds nothing (and waits on the lock) or a complete
    folder. ``build`` must write the info file (:func:`write_build_info`) last; the checksums of what it
    wrote are added to it (:func:`record_checksums`). A finished folder whose files do not match them is built
    again (one warning line). Temporary folders left by a killed build are removed by the next one.
    """
    final = Path(final)
    if is_complete(final) and checksum_problem(final) is None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(final.parent / f".{final.name}.lock"), timeout=timeout)
    _wait_for_lock(lock, final, timeout)
    try:
        return _build_locked(final, build)
    finally:
        progress_path(final).unlink(missing_ok=True)  # the build is over, or never ran here
        lock.release()


def _build_locked(final: Path, build: Callable[[Path], object]) -> Path:
    """``cached_build``'s body under the lock."""
    if is_complete(final):
        problem = checksum_problem(final)
        if problem is None:
            return final
        from entropy_rft.common.text import visible

        print(f"erft: warning: the cached model {visible(final)}: {visible(problem)}; building it again",
              file=sys.stderr, flush=True)
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
        record_checksums(tmp)
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
