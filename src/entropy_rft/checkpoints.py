"""Checkpoints and what a resume reads back: ``checkpoints/step_N/`` folders written atomically with a
``manifest.json`` (each file's size and SHA-256), verified before they load; the point a resume starts
from; and the config a run directory recorded (``config.yaml``, with its copy in the checkpoints).

The run directory's layout, its atomic files and its logs are :mod:`entropy_rft.rundir`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from entropy_rft.errors import UserError
from entropy_rft.rundir import CHECKPOINTS, atomic_write_bytes, atomic_write_json, fsync_dir, log_gaps, warn

MANIFEST = "manifest.json"


class CheckpointError(UserError):
    """A checkpoint that fails its manifest or does not load."""


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_dirs(out: str | Path) -> list[Path]:
    """Complete checkpoints (a manifest, or the ``DONE`` marker of older versions), oldest first; temp folders
    of an interrupted write are ignored. Completeness is not integrity: :func:`verify_checkpoint` checks it."""
    d = Path(out) / CHECKPOINTS
    if not d.is_dir():
        return []
    dirs = [p for p in d.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()
            and ((p / MANIFEST).exists() or (p / "DONE").exists())]
    return sorted(dirs, key=lambda p: int(p.name.split("_")[1]))


def checkpoint_step(path: str | Path) -> int:
    return int(Path(path).name.split("_")[1])


def latest_checkpoint(out: str | Path) -> Path | None:
    dirs = checkpoint_dirs(out)
    return dirs[-1] if dirs else None


def save_checkpoint(out: str | Path, step: int, state: dict[str, Any], keep: int,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Write ``state`` (name -> torch-serialisable object) as ``checkpoints/step_N`` atomically.

    Each entry is ``torch.save``d to its own file in a temp folder (``extra_files`` are written as they are),
    then ``manifest.json`` (each file's size and SHA-256) is written last; the folder is then renamed into
    place. Older checkpoints beyond ``keep`` are removed.
    """
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_step_{step:06d}_", dir=root))
    try:
        files = {}
        for name, obj in state.items():
            with open(tmp / f"{name}.pt", "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            files[f"{name}.pt"] = tmp / f"{name}.pt"
        for name, data in (extra_files or {}).items():
            atomic_write_bytes(tmp / name, data)
            files[name] = tmp / name
        manifest = {"step": step, "files": {n: {"size": p.stat().st_size, "sha256": _sha256(p)}
                                            for n, p in files.items()}}
        atomic_write_json(tmp / MANIFEST, manifest)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoint_dirs(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def verify_checkpoint(path: str | Path) -> str | None:
    """None when every file of the checkpoint matches its manifest; else what is wrong, in a few words."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
    except FileNotFoundError:
        return None if (path / "DONE").exists() else "no manifest.json"
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest.json is damaged"
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want.get("size"):
            return f"{name} has {f.stat().st_size} bytes, the manifest says {want.get('size')}"
        if _sha256(f) != want.get("sha256"):
            return f"{name} does not match its checksum"
    return None


def load_checkpoint(path: str | Path, required: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                    map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The state saved in checkpoint ``path`` (every entry, or the entries ``only``), verified against its
    manifest first.

    Raises :class:`CheckpointError` naming the checkpoint and what is wrong (a damaged or missing file, a
    file that does not load, a missing entry of ``required``)."""
    path = Path(path)
    bad = verify_checkpoint(path)
    if bad is not None:
        raise CheckpointError(f"checkpoint {path}: {bad}")
    state = {}
    for p in sorted(path.glob("*.pt")):
        if only is not None and p.stem not in only:
            continue
        try:
            state[p.stem] = torch.load(p, map_location=map_location, weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unpickling/zip error means the same thing: a damaged file
            raise CheckpointError(f"checkpoint {path}: {p.name} does not load ({type(e).__name__})") from None
    missing = [n for n in required if n not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path}: {', '.join(n + '.pt' for n in missing)} missing")
    return state


def load_latest_intact(out: str | Path, before: int | None = None,
                       required: tuple[str, ...] = ()) -> tuple[Path | None, dict[str, Any] | None]:
    """The newest checkpoint (with step < ``before``, when given) that verifies and loads, and its state.

    A damaged newer one is named in a warning and skipped. (None, None) when the run has no checkpoint;
    :class:`~entropy_rft.errors.UserError` when it has some but none is intact."""
    dirs = [d for d in checkpoint_dirs(out) if before is None or checkpoint_step(d) < before]
    bad = []
    for d in reversed(dirs):
        try:
            state = load_checkpoint(d, required)
        except CheckpointError as e:
            bad.append(str(e))
            continue
        for msg in bad:
            warn(f"{msg}; falling back to the older intact {d.name}")
        return d, state
    if bad:
        raise UserError(f"no intact checkpoint in {Path(out) / CHECKPOINTS} ({'; '.join(bad)}); start a new run "
                        "with --overwrite")
    return None, None


def resume_point(out: str | Path, required: tuple[str, ...],
                 first_step: int) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint a resume starts from: the newest intact one, or an older intact one when the log lacks
    a step at or before it (a damaged line, a file cut short) and going back lets the run write it again.
    ``first_step`` is the first step the metrics log holds (0 with a base evaluation, else 1)."""
    out = Path(out)
    ckpt, state = load_latest_intact(out, required=required)
    if state is None:
        return None, None
    gaps = log_gaps(out / "metrics.jsonl", first_step, int(state["trainer"]["step"]))
    if not gaps:
        return ckpt, state
    shown = ", ".join(map(str, gaps[:8])) + (", ..." if len(gaps) > 8 else "")
    try:
        older, older_state = load_latest_intact(out, before=gaps[0], required=required)
    except UserError:
        older, older_state = None, None
    if older_state is not None:
        warn(f"{out / 'metrics.jsonl'} lacks step(s) {shown}; resuming from {older.name} to write them again")
        return older, older_state
    warn(f"{out / 'metrics.jsonl'} lacks step(s) {shown} and no checkpoint precedes them; they stay missing "
         f"(damaged lines are kept in metrics.jsonl.damaged)")
    return ckpt, state


def refuse_lost_checkpoints(out: str | Path, checkpoint_every: int) -> None:
    """A resume that finds no checkpoint starts again from step 0 and writes the logs again. Refused in one line
    when a checkpoint must have existed (the run finished, or logged a step at which one is written), so that no
    row is thrown away for a deleted ``checkpoints/`` folder."""
    from entropy_rft.rundir import read_status, read_step_log

    out = Path(out)
    last = max((r["step"] for r in read_step_log(out / "metrics.jsonl")), default=0)
    finished = read_status(out).get("status") == "finished"
    if finished or last >= checkpoint_every:
        what = "finished" if finished else f"logged step {last} (a checkpoint is written every {checkpoint_every})"
        raise UserError(f"{out}: no checkpoint in {out / CHECKPOINTS}, but the run {what}; put its checkpoints "
                        "back, or start it again with --overwrite")


# ----------------------------------------------------------------------------- the recorded config


def _config_fix(out: Path) -> str:
    backup = _config_backup(out)
    p = out / "config.yaml"
    return f"restore it with `cp {backup} {p}`" if backup else "restore it, or start a new run with --overwrite"


def read_config_dict(out: str | Path) -> dict[str, Any]:
    """A run directory's ``config.yaml`` as a mapping, refused in one line when missing or damaged (not UTF-8,
    not YAML, empty, not a mapping, or a section that is not one), with the ``cp`` that restores it from the
    newest checkpoint's copy."""
    out = Path(out)
    p = out / "config.yaml"
    if not p.is_file():
        raise UserError(f"{out}: no config.yaml there; is it a run directory made by `erft train`?")
    fix = _config_fix(out)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"run config {p} is not UTF-8 text; {fix}") from None
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"run config {p} is not valid YAML ({first}); {fix}") from None
    if not data:
        raise UserError(f"run config {p} is empty; {fix}")
    if not isinstance(data, dict):
        raise UserError(f"run config {p} must hold a mapping, got {type(data).__name__}; {fix}")
    for key in ("method", "train", "model"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise UserError(f"run config {p}: '{key}' must be a mapping, got {type(data[key]).__name__}; {fix}")
    return data


def load_run_config(out: str | Path):
    """The config a run directory recorded (``config.yaml``), refused in one line when missing or damaged."""
    from entropy_rft.config import config_from_dict

    data = read_config_dict(out)
    try:
        return config_from_dict(data)
    except UserError as e:
        raise UserError(f"run config {Path(out) / 'config.yaml'}: {e}; {_config_fix(Path(out))}") from None


def _config_backup(out: Path) -> Path | None:
    """The copy of ``config.yaml`` in the newest checkpoint that has one."""
    for d in reversed(checkpoint_dirs(out)):
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    return None
