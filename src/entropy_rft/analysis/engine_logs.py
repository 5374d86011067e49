"""Readers of the logs other engines write, as they lie on disk: each gives the scalar series it finds, by the
engine's own key names, per step (``EngineLog``). Which keys mean entropy and validation, and what the analysis
does with them, is ``analysis.byo``'s concern.

Sources (``SOURCES``):

- ``verl-console``: the text verl's console logger prints (``trainer.logger=['console']``;
  ``verl.utils.logger.aggregate_logger.concat_dict_to_str``): ``step:N - key:value - ...`` lines, with Ray's
  ``(TaskRunner pid=...)`` prefixes, colour codes and ``np.float64(x)`` values as ``pprint`` shows numpy
  scalars; any other line of the log is ignored.
- ``verl-file``: verl's file logger (``trainer.logger=['file']``; ``verl.utils.tracking.FileLogger``): JSONL rows
  ``{"step": N, "data": {...}}``.
- ``trl``: a TRL ``output_dir`` or checkpoint folder: ``trainer_state.json``'s ``log_history`` (the output
  dir's own, else its last checkpoint's).
- ``tensorboard``: event files (``events.out.tfevents.*``) in a folder or its sub-folders, scalars by tag.
- ``table``: a CSV or JSONL table with a step column (a W&B or MLflow export): ``step``, ``Step``,
  ``_step``, ``global_step`` or ``trainer/global_step``.

A damaged line or value is skipped and counted (``EngineLog.skipped``), never raised; an unreadable file is one
``UserError`` naming it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from entropy_rft.common.errors import UserError

SOURCES = ("verl-console", "verl-file", "trl", "tensorboard", "table")
STEP_COLUMNS = ("step", "Step", "_step", "global_step", "trainer/global_step")
MAX_LOG_BYTES = 2 << 30  # a log larger than this is refused rather than read into memory

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_NUMPY_SCALAR = re.compile(r"^np\.(?:float|int|uint)\d*\((.*)\)$")
_CONSOLE_STEP = re.compile(r"(?:^|[\s)\]])step:(\d+)(?= - |\s*$)")


@dataclass
class EngineLog:
    """One run's scalar series as its engine logged them: ``rows[step][key] = value`` (the last value logged
    for a key at a step wins, as in the engines' own viewers)."""

    source: str
    path: Path
    rows: dict[int, dict[str, float]] = field(default_factory=dict)
    skipped: int = 0  # damaged lines or values left out

    def add(self, step: int, key: str, value: object) -> None:
        v = number(value)
        if v is None:
            self.skipped += 1
            return
        self.rows.setdefault(step, {})[key] = v

    def keys(self) -> list[str]:
        """Every key logged, in first-seen order."""
        seen: dict[str, None] = {}
        for step in sorted(self.rows):
            seen.update(dict.fromkeys(self.rows[step]))
        return list(seen)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one key, by step."""
        steps = [s for s in sorted(self.rows) if key in self.rows[s]]
        return steps, [self.rows[s][key] for s in steps]


def number(value: object) -> float | None:
    """A finite float from a logged value (a number, a numeric string, ``np.float64(x)`` as pprint shows
    numpy scalars), else None (booleans, text, lists, NaN and infinities)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        m = _NUMPY_SCALAR.match(text)
        text = m.group(1) if m else text
        try:
            value = float(text)
        except ValueError:
            return None
    if isinstance(value, (int, float)):
        v = float(value)
        return v if math.isfinite(v) else None
    return None


def _text(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_LOG_BYTES:
            raise UserError(f"{path}: larger than {MAX_LOG_BYTES >> 30} GiB; give the run's metrics only "
                            "(a file logger's JSONL, or a table export)")
        return path.read_text(encoding="utf-8", errors="replace")
    except (OSError, UnicodeError) as e:
        raise UserError(f"{path}: cannot be read ({e.__class__.__name__}: {e})") from None


def read_verl_console(path: Path) -> EngineLog:
    """verl's console log: each ``step:N - key:value - ...`` line (after any prefix such as Ray's
    ``(TaskRunner pid=...)``), with colour codes removed; a field whose value is not a number is skipped."""
    log = EngineLog("verl-console", path)
    for raw in _text(path).splitlines():
        line = _ANSI.sub("", raw)
        m = _CONSOLE_STEP.search(line)
        if m is None:
            continue
        step = int(m.group(1))
        for part in line[m.end():].split(" - ")[1:]:
            key, sep, value = part.rpartition(":")  # pformat of a number holds no colon; a key may
            if not sep or not key.strip():
                log.skipped += 1
                continue
            log.add(step, key.strip(), value)
    return log


def read_verl_file(path: Path) -> EngineLog:
    """verl's file logger: JSONL ``{"step": N, "data": {key: value}}``."""
    log = EngineLog("verl-file", path)
    for line in _text(path).splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, data = row["step"], row["data"]
        except (ValueError, KeyError, TypeError):
            log.skipped += 1
            continue
        if not isinstance(data, dict) or number(step) is None:
            log.skipped += 1
            continue
        for k, v in data.items():
            log.add(int(number(step)), str(k), v)
    return log


def trl_state_file(folder: Path) -> Path | None:
    """The ``trainer_state.json`` of a TRL ``output_dir`` (its own, else its last ``checkpoint-N``'s) or of a
    checkpoint folder; None when there is none."""
    own = folder / "trainer_state.json"
    if own.is_file():
        return own
    ckpts = sorted((int(c.name.split("-", 1)[1]), c) for c in folder.glob("checkpoint-*")
                   if c.name.split("-", 1)[1].isdigit() and (c / "trainer_state.json").is_file())
    return ckpts[-1][1] / "trainer_state.json" if ckpts else None


def read_trl(folder: Path) -> EngineLog:
    """A TRL run's ``log_history`` (``trainer_state.json``): each entry's numeric keys at its ``step``."""
    path = trl_state_file(folder) if folder.is_dir() else folder
    if path is None:
        raise UserError(f"{folder}: no trainer_state.json here or in a checkpoint-N folder; give a TRL "
                        "output_dir or checkpoint folder")
    try:
        history = json.loads(_text(path))["log_history"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path}: not a trainer_state.json with a log_history list") from None
    log = EngineLog("trl", path)
    if not isinstance(history, list):
        raise UserError(f"{path}: log_history is not a list")
    for entry in history:
        step = number(entry.get("step")) if isinstance(entry, dict) else None
        if step is None:
            log.skipped += 1
            continue
        for k, v in entry.items():
            if k not in ("step", "epoch") and not isinstance(v, (list, dict)):
                log.add(int(step), k, v)
    return log


def event_files(folder: Path) -> list[Path]:
    """TensorBoard event files under ``folder`` (or ``folder`` itself), sorted."""
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.rglob("events.out.tfevents.*") if p.is_file())


def read_tensorboard(folder: Path) -> EngineLog:
    """Scalars of every event file under ``folder``, by tag (a sub-folder's tags prefixed with its path, as
    TensorBoard names runs, when several folders hold event files); a damaged record ends that file's read."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    files = event_files(folder)
    if not files:
        raise UserError(f"{folder}: no TensorBoard event files (events.out.tfevents.*) here or below")
    log = EngineLog("tensorboard", folder)
    dirs = {f.parent for f in files}
    base = folder if folder.is_dir() else folder.parent
    for f in files:
        prefix = "" if len(dirs) == 1 else f"{f.parent.relative_to(base).as_posix()}/"
        try:
            for event in EventFileLoader(str(f)).Load():
                for v in event.summary.value:
                    if v.HasField("simple_value"):
                        log.add(int(event.step), prefix + v.tag, v.simple_value)
                    elif v.HasField("tensor") and v.metadata.plugin_data.plugin_name == "scalars":
                        log.add(int(event.step), prefix + v.tag, float(tensor_util.make_ndarray(v.tensor)))
        except Exception:  # noqa: BLE001 - a truncated or damaged event file: keep what was read
            log.skipped += 1
    return log


def read_table(path: Path) -> EngineLog:
    """A CSV (by its header) or JSONL table with a step column (``STEP_COLUMNS``); empty cells are gaps."""
    text = _text(path)
    log = EngineLog("table", path)
    if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        rows: list[dict] = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                log.skipped += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                log.skipped += 1
    else:
        rows = list(csv.DictReader(text.splitlines()))
    cols = dict.fromkeys(k for r in rows for k in r if k is not None)
    step_col = next((c for c in STEP_COLUMNS if c in cols), None)
    if step_col is None:
        raise UserError(f"{path}: no step column (looked for {', '.join(STEP_COLUMNS)}; found "
                        f"{', '.join(list(cols)[:8]) or 'no columns'}); export the table with its step")
    for row in rows:
        step = number(row.get(step_col))
        if step is None or step < 0:
            log.skipped += 1
            continue
        for k, v in row.items():
            if k is None or k == step_col or v in ("", None):
                continue
            log.add(int(step), k, v)
    return log


def looks_like_verl_file(path: Path) -> bool:
    """Whether the first non-empty line of ``path`` is a verl file-logger row."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    return isinstance(row, dict) and set(row) == {"step", "data"}
    except (OSError, ValueError):
        return False
    return False


def looks_like_verl_console(path: Path, lines: int = 20000) -> bool:
    """Whether one of the first ``lines`` lines of ``path`` is a verl console ``step:N - key:value`` line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for i, raw in enumerate(f):
                if i >= lines:
                    break
                line = _ANSI.sub("", raw)
                if (m := _CONSOLE_STEP.search(line)) and " - " in line[m.end():]:
                    return True
    except OSError:
        return False
    return False


def is_erft_path(path: Path) -> bool:
    """An erft run directory (its ``metrics.jsonl``) or a folder of them (an ``erft compare --out`` folder), by
    file names only (torch-free: the commands route a path before loading anything; a damaged ``metrics.jsonl``,
    even a folder of that name, is erft's to report)."""
    if os.path.lexists(path / "metrics.jsonl"):
        return True
    return path.is_dir() and any(os.path.lexists(c / "metrics.jsonl") for c in path.iterdir() if c.is_dir())


def detect(path: Path) -> str:
    """The source of ``path`` (one of ``SOURCES``, or ``erft`` for an erft run directory), from what it holds."""
    if path.is_dir():
        if (path / "metrics.jsonl").is_file() and (path / "run.json").is_file():
            return "erft"
        if trl_state_file(path) is not None:
            return "trl"
        if event_files(path):
            return "tensorboard"
        if (path / "metrics.jsonl").is_file():
            return "erft"
        raise UserError(f"{path}: not a run this command reads (no metrics.jsonl, trainer_state.json or "
                        "TensorBoard event files); give a log file, or name its kind with --source "
                        f"{{{','.join(SOURCES)}}}")
    name = path.name
    if name.startswith("events.out.tfevents."):
        return "tensorboard"
    if name == "trainer_state.json":
        return "trl"
    if looks_like_verl_file(path):
        return "verl-file"
    if path.suffix.lower() in (".csv", ".tsv", ".jsonl", ".ndjson"):
        return "table"
    if looks_like_verl_console(path):
        return "verl-console"
    raise UserError(f"{path}: not a log this command recognises (no step:N - key:value lines, no JSONL rows, "
                    f"not a CSV); name its kind with --source {{{','.join(SOURCES)}}}")


READERS = {"verl-console": read_verl_console, "verl-file": read_verl_file, "trl": read_trl,
           "tensorboard": read_tensorboard, "table": read_table}


def read_engine_log(path: str | Path, source: str | None = None) -> EngineLog:
    """Read a foreign run's log; ``source`` forces a reader (one of ``SOURCES``), else it is detected."""
    path = Path(path)
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file or folder")
    kind = source or detect(path)
    if kind not in READERS:
        raise UserError(f"{path}: is an erft run directory; read it without --source" if kind == "erft" else
                        f"--source must be one of {', '.join(SOURCES)}, got {kind!r}")
    if kind in ("verl-console", "verl-file", "table") and path.is_dir():
        raise UserError(f"{path}: is a folder; --source {kind} reads a file")
    return READERS[kind](path)


__all__ = ["EngineLog", "SOURCES", "detect", "is_erft_path", "number", "read_engine_log"]
