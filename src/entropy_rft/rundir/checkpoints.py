"""Checkpoints and what a resume reads back: ``checkpoints/step_N/`` folders written atomically with a
``manifest.json`` (each file's size and SHA-256), verified before they load; the point a resume starts
from; and the config a run directory recorded (``config.yaml``, with its copy in the checkpoints).

The run directory's layout, its atomic files and its logs are :mod:`entropy_rft.rundir.files`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from entropy_rft.common.errors import UserError
from entropy_rft.rundir.files import (
    CHECKPOINTS,
    as_os_error,
    atomic_write_bytes,
    atomic_write_json,
    fault_point,
    fsync_dir,
    log_gaps,
    warn,
)
from entropy_rft.rundir.guard import follow_umask

MANIFEST = "manifest.json"


class CheckpointError(UserError):
    """A checkpoint that fails its manifest or does not load."""


class UnsafeCheckpointError(UserError):
    """A checkpoint file that only loads by unpickling code (``torch.load(weights_only=False)``): refused,
    never loaded and never skipped for an older checkpoint (it was altered, or written by an erft before
    checkpoints held only tensors and plain containers)."""


def unsafe_globals(path: Path) -> list[str]:
    """The Python objects (``module.name``) that loading ``path`` would have to import and call: empty for a
    file that ``torch.load(..., weights_only=True)`` loads. Reads the pickle's opcodes, runs nothing."""
    return torch.serialization.get_unsafe_globals_in_checkpoint(path)


def _refuse_unsafe(ckpt: Path, name: str, found: list[str]) -> UnsafeCheckpointError:
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    return UnsafeCheckpointError(
        f"checkpoint {ckpt}: {name} would run code to load ({shown}), and erft loads only tensors and plain "
        "data; it was altered, or written by an erft older than this format: refused, nothing loaded (delete "
        "the checkpoint to resume from an older one, or start again with --overwrite)")


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
        follow_umask(tmp, folder=True)  # mkdtemp makes it 0700
        files = {}
        for name, obj in state.items():
            path = tmp / f"{name}.pt"
            f = open(path, "wb")  # noqa: SIM115 - closed below, where a second error must not hide the first
            try:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            except RuntimeError as e:  # the C++ writer hides the OSError of a full disk
                raise as_os_error(e, final / path.name) from None  # named as the user will look for it
            except OSError as e:
                raise OSError(e.errno, e.strerror, str(final / path.name)) from None
            finally:
                with contextlib.suppress(OSError):
                    f.close()
            files[f"{name}.pt"] = path
            if found := unsafe_globals(path):  # a bug here: load_checkpoint would refuse it
                raise TypeError(f"checkpoint entry {name!r} holds objects that need unpickling: {found}")
            fault_point("in_checkpoint", step)
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
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
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
    manifest first. Every ``.pt`` file is checked to need no code to load (:func:`unsafe_globals`), the
    entries not loaded too, before any is loaded, with ``torch.load(..., weights_only=True)``.

    Raises :class:`UnsafeCheckpointError` for a file that would need unpickling, and :class:`CheckpointError`
    naming the checkpoint and what is wrong (a damaged or missing file, a file that does not load, a missing
    entry of ``required``)."""
    path = Path(path)
    bad = verify_checkpoint(path)
    if bad is not None:
        raise CheckpointError(f"checkpoint {path}: {bad}")
    files = sorted(path.glob("*.pt"))
    for p in files:
        try:
            found = unsafe_globals(p)
        except Exception as e:  # noqa: BLE001 - not a torch zip file: a damaged file
            raise CheckpointError(f"checkpoint {path}: {p.name} does not load ({type(e).__name__})") from None
        if found:
            raise _refuse_unsafe(path, p.name, found)
    state = {}
    for p in files:
        if only is not None and p.stem not in only:
            continue
        try:
            state[p.stem] = torch.load(p, map_location=map_location, weights_only=True)
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
    :class:`~entropy_rft.common.errors.UserError` when it has some but none is intact."""
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
    if older is not None and older_state is not None:
        warn(f"{out / 'metrics.jsonl'} lacks step(s) {shown}; resuming from {older.name} to write them again")
        return older, older_state
    warn(f"{out / 'metrics.jsonl'} lacks step(s) {shown} and no checkpoint precedes them; they stay missing "
         f"(damaged lines are kept in metrics.jsonl.damaged)")
    return ckpt, state


def refuse_lost_checkpoints(out: str | Path, checkpoint_every: int | None) -> None:
    """A resume that finds no checkpoint starts again from step 0 and writes the logs again, identically (a
    run stopped before its first checkpoint, even between the metrics row of that checkpoint's step and the
    checkpoint's rename: what was durably written is the logs up to that step, and step 0 reproduces them).
    Refused in one line when a checkpoint must have existed (the run finished, or logged a step after the
    first checkpoint's), so that no row is thrown away for a deleted ``checkpoints/`` folder. ``checkpoint_every``
    None: the run writes no checkpoints (``train.checkpoints`` false), so only a finished run is refused."""
    from entropy_rft.rundir.files import read_status, read_step_log

    out = Path(out)
    last = max((r["step"] for r in read_step_log(out / "metrics.jsonl")), default=0)
    finished = read_status(out).get("status") == "finished"
    if finished or (checkpoint_every is not None and last > checkpoint_every):
        what = "finished" if finished else f"logged step {last} (a checkpoint is written every {checkpoint_every})"
        raise UserError(f"{out}: no checkpoint in {out / CHECKPOINTS}, but the run {what}; put its checkpoints "
                        "back, or start it again with --overwrite")
    if last >= 1:
        why = ("the run stopped before its first one was written" if checkpoint_every is not None else
               "train.checkpoints is false")
        warn(f"{out}: no checkpoint yet ({why}); starting again from step 0, and steps 1..{last} are written again as "
             "they were")


# ----------------------------------------------------------------------------- the TRL engine's checkpoints


def trl_checkpoint_gap(folder: str | Path) -> str | None:
    """What a ``trl/checkpoint-N`` folder lacks, or None when it is complete. transformers writes the folder in
    place (model, optimizer, scheduler, RNG) and ``trainer_state.json`` last; the engine's ``erft_state.pt``
    comes first. Complete: ``trainer_state.json`` parses, with ``global_step`` N, and ``erft_state.pt`` is
    there."""
    folder = Path(folder)
    try:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no trainer_state.json"
    except (OSError, ValueError, RecursionError):
        return "trainer_state.json is cut short or damaged"
    step = folder.name.rsplit("-", 1)[-1]
    if not isinstance(state, dict) or str(state.get("global_step")) != step:
        return f"trainer_state.json is not step {step}'s"
    if not (folder / "erft_state.pt").is_file():
        return "no erft_state.pt"
    return None


def last_complete_trl_checkpoint(trl_dir: str | Path, remove: bool = False) -> Path | None:
    """The newest complete ``checkpoint-N`` of ``trl_dir`` (:func:`trl_checkpoint_gap`), or None. Each newer
    incomplete one (a run killed while transformers wrote it) is named in a warning and, with ``remove``
    (the writer of the run), deleted, so that the resumed run writes it again."""
    trl_dir = Path(trl_dir)
    if not trl_dir.is_dir():
        return None
    found = [p for p in trl_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
             and p.name[len("checkpoint-"):].isdigit()]
    skipped, chosen = [], None
    for p in sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True):
        gap = trl_checkpoint_gap(p)
        if gap is None:
            chosen = p
            break
        skipped.append((p, gap))
        if remove:
            shutil.rmtree(p, ignore_errors=True)
    then = f"resuming from {chosen.name}" if chosen is not None else "starting again from step 0"
    for q, why in skipped:
        warn(f"{q} is incomplete ({why}: the run stopped while writing it); {'removed, ' if remove else ''}{then}")
    return chosen


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


def load_run_config(out: str | Path, *, check_method: bool = True):
    """The config a run directory recorded (``config.yaml``), refused in one line when missing or damaged
    (``check_method=False``: the method is left to the caller's check, ``launch.resume``'s preflight)."""
    from entropy_rft.config.loading import config_from_dict

    data = read_config_dict(out)
    try:
        return config_from_dict(data, check_method=check_method)
    except UserError as e:
        raise UserError(f"run config {Path(out) / 'config.yaml'}: {e}; {_config_fix(Path(out))}") from None


def _config_backup(out: Path) -> Path | None:
    """The copy of ``config.yaml`` in the newest checkpoint that has one."""
    for d in reversed(checkpoint_dirs(out)):
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    return None
