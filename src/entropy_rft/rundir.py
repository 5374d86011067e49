"""The run directory: atomic files, append-only JSONL logs, checkpoints. Nothing is ever half-written.

Layout of ``--out DIR``::

    config.yaml          resolved config, written atomically before any heavy work
    run.json             status: started / finished, steps, versions
    metrics.jsonl        one JSON object per step (and step 0 for the base evaluation)
    samples.jsonl        (prompt, response, reward) every N steps
    token_records.jsonl  per-token probe records every N steps
    tb/                  TensorBoard events
    checkpoints/step_000050/   model, optimizer, scheduler, RNG states (atomic, last k kept)
    final/               the final policy, HF format (save_pretrained)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from entropy_rft.errors import UserError

CHECKPOINTS = "checkpoints"
LOGS = ("metrics.jsonl", "samples.jsonl", "token_records.jsonl")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(json_safe(obj), indent=2, sort_keys=True) + "\n")


def json_safe(obj: Any) -> Any:
    """Replace NaN/inf by None and tensors/numpy scalars by Python numbers (JSON has no NaN)."""
    kind = type(obj)
    if kind is float:  # the common cases first: a metrics row is mostly plain floats
        return obj if math.isfinite(obj) else None
    if obj is None or kind in (int, str, bool):
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return json_safe(obj.tolist())
    if hasattr(obj, "item") and callable(obj.item) and not isinstance(obj, (str, bytes)):
        try:
            obj = obj.item()
        except (TypeError, ValueError):
            return obj
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


class JsonlWriter:
    """Append-only JSON-lines file; each record is one line, flushed when written (so a killed process loses
    nothing) and fsynced then too when ``fsync`` (else at :meth:`sync` and :meth:`close`)."""

    def __init__(self, path: str | Path, fsync: bool = True):
        self.path = Path(path)
        self.fsync = fsync
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - long-lived handle

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def write_many(self, records: Iterable[dict]) -> None:
        for r in records:
            self._f.write(json.dumps(json_safe(r), allow_nan=False) + "\n")
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def sync(self) -> None:
        """Force what was written to disk (a kill loses nothing flushed; this covers power loss too)."""
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
        self._f.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """Read complete JSON lines; a torn last line (from a kill) is ignored."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def truncate_jsonl(path: str | Path, max_step: int) -> int:
    """Keep only complete lines whose ``step`` is <= max_step; drop a torn tail. Returns lines kept."""
    p = Path(path)
    if not p.exists():
        return 0
    kept = []
    for line in p.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # torn last line
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if int(rec.get("step", 0)) <= max_step:
            kept.append(line)
    atomic_write_text(p, "".join(kept))
    return len(kept)


# ----------------------------------------------------------------------------- the directory


def prepare_new(out: str | Path, overwrite: bool) -> Path:
    """Create a fresh run directory. Refuse an existing non-empty one unless ``overwrite``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(
                f"run directory '{out}' already exists; pass --resume {out} to continue it, "
                "--overwrite to replace it, or choose another --out"
            )
        if not (out / "config.yaml").exists() and not (out / "run.json").exists():
            raise UserError(f"--overwrite refused: '{out}' exists and is not a run directory (no config.yaml)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def checkpoint_dirs(out: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp folders of an interrupted write are ignored)."""
    d = Path(out) / CHECKPOINTS
    if not d.is_dir():
        return []
    dirs = [p for p in d.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / "DONE").exists()]
    return sorted(dirs, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(out: str | Path) -> Path | None:
    dirs = checkpoint_dirs(out)
    return dirs[-1] if dirs else None


def save_checkpoint(out: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` (name -> torch-serialisable object) as ``checkpoints/step_N`` atomically.

    Each entry is ``torch.save``d to its own file in a temp folder, a ``DONE`` marker is written last,
    then the folder is renamed into place. Older checkpoints beyond ``keep`` are removed.
    """
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_step_{step:06d}_", dir=root))
    try:
        for name, obj in state.items():
            with open(tmp / f"{name}.pt", "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        (tmp / "DONE").write_text(str(step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoint_dirs(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return {p.stem: torch.load(p, map_location="cpu", weights_only=False) for p in sorted(path.glob("*.pt"))}


def truncate_logs(out: str | Path, step: int) -> None:
    """Drop log lines after ``step`` (and any torn last line) before resuming from that step."""
    for name in LOGS:
        truncate_jsonl(Path(out) / name, step)
