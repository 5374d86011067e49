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
``UserError`` naming it. Files are read through ``common.streams``: only regular files (a FIFO, a device, a socket
or a link to one is one line), line by line in bounded memory (a line over ``MAX_LINE_BYTES`` is skipped and
counted), an unfinished last line (a log still being written) left out and counted (``EngineLog.unfinished``),
JSON nested too deep is a damaged line, and a CSV field may be as long as a line.
"""

from __future__ import annotations

import csv
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from entropy_rft.common.errors import UserError
from entropy_rft.common.streams import LineCounts, lines, open_regular, parse_json, regular_problem, text_lines

SOURCES = ("verl-console", "verl-file", "trl", "tensorboard", "table")
STEP_COLUMNS = ("step", "Step", "_step", "global_step", "trainer/global_step")
MAX_JSON_BYTES = 1 << 30  # a trainer_state.json larger than this is refused rather than read into memory

_SNIFF_LINE = 1 << 20  # detection reads lines up to this length only
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
    unfinished: int = 0  # an unfinished last line (no newline: the log is still being written) left out

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


def _lines(path: Path, log: EngineLog):
    """The complete lines of ``path`` (``common.streams.text_lines``); what was left out is added to ``log``'s
    counts when the file is done."""
    counts = LineCounts()
    try:
        yield from text_lines(path, counts)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.__class__.__name__}: {e})") from None
    log.skipped += counts.too_long
    log.unfinished += counts.unfinished


def _json_file(path: Path) -> object:
    """A whole JSON file (``trainer_state.json``), at most ``MAX_JSON_BYTES``; ValueError when damaged."""
    try:
        with open_regular(path) as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.__class__.__name__}: {e})") from None
    if len(data) > MAX_JSON_BYTES:
        raise UserError(f"{path}: larger than {MAX_JSON_BYTES >> 30} GiB; give the run's metrics only (a table "
                        "export)")
    return parse_json(data.decode("utf-8", errors="replace"))


def read_verl_console(path: Path) -> EngineLog:
    """verl's console log: each ``step:N - key:value - ...`` line (after any prefix such as Ray's
    ``(TaskRunner pid=...)``), with colour codes removed; a field whose value is not a number is skipped."""
    log = EngineLog("verl-console", path)
    for raw in _lines(path, log):
        if "step:" not in raw:  # most lines of a console log: no regular expression for them
            continue
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
    for line in _lines(path, log):
        if not line.strip():
            continue
        try:
            row = parse_json(line)
            step, data = row["step"], row["data"]
        except (ValueError, KeyError, TypeError):
            log.skipped += 1
            continue
        if not isinstance(data, dict) or (step_n := number(step)) is None:
            log.skipped += 1
            continue
        for k, v in data.items():
            log.add(int(step_n), str(k), v)
    return log


def trl_state_files(folder: Path) -> list[Path]:
    """The ``trainer_state.json`` files of a TRL ``output_dir``, best first: its own, else its ``checkpoint-N``
    folders', newest first (or a checkpoint folder's own); empty when there is none."""
    own = folder / "trainer_state.json"
    if own.is_file():
        return [own]
    ckpts = sorted((int(c.name.split("-", 1)[1]), c) for c in folder.glob("checkpoint-*")
                   if c.name.split("-", 1)[1].isdigit() and (c / "trainer_state.json").is_file())
    return [c / "trainer_state.json" for _, c in reversed(ckpts)]


def trl_state_file(folder: Path) -> Path | None:
    """The first of :func:`trl_state_files` (None when there is none)."""
    files = trl_state_files(folder)
    return files[0] if files else None


def _history(path: Path) -> list | None:
    """``log_history`` of a ``trainer_state.json``, None when the file is damaged (cut short, not JSON, nested
    too deep, no list)."""
    try:
        data = _json_file(path)
        history = data["log_history"] if isinstance(data, dict) else None
    except (ValueError, KeyError, TypeError):
        return None
    return history if isinstance(history, list) else None


def read_trl(folder: Path) -> EngineLog:
    """A TRL run's ``log_history`` (``trainer_state.json``): each entry's numeric keys at its ``step``. A damaged
    newest checkpoint's file gives way to the previous checkpoint's, with a warning naming it (as erft's own
    TRL resume does)."""
    from entropy_rft.rundir.files import warn

    candidates = trl_state_files(folder) if folder.is_dir() else [folder]
    if not candidates:
        raise UserError(f"{folder}: no trainer_state.json here or in a checkpoint-N folder; give a TRL "
                        "output_dir or checkpoint folder")
    history = None
    for i, path in enumerate(candidates):
        history = _history(path)
        if history is not None:
            break
        if i + 1 < len(candidates):
            warn(f"{path}: not a trainer_state.json with a log_history list (cut short or damaged); reading the "
                 f"previous checkpoint's, {candidates[i + 1]}")
    if history is None:
        raise UserError(f"{candidates[-1]}: not a trainer_state.json with a log_history list")
    return trl_history_log(history, path)


def trl_history_log(history: list, path: Path) -> EngineLog:
    """A TRL ``log_history`` list (a ``trainer_state.json``'s, or a live trainer's ``state.log_history``) as an
    ``EngineLog``: each entry's numeric keys at its ``step``; an entry without a step is counted as skipped."""
    log = EngineLog("trl", path)
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


def _jsonl_rows(path: Path, log: EngineLog):
    for line in _lines(path, log):
        if not line.strip():
            continue
        try:
            row = parse_json(line)
        except ValueError:
            log.skipped += 1
            continue
        if isinstance(row, dict):
            yield row
        else:
            log.skipped += 1


def _csv_rows(path: Path, log: EngineLog):
    """The rows of a CSV by its header, one at a time; a field may be as long as a line (``MAX_LINE_BYTES``,
    not the csv module's 128 KiB)."""
    from entropy_rft.common.streams import MAX_LINE_BYTES

    old = csv.field_size_limit()
    csv.field_size_limit(max(old, MAX_LINE_BYTES))
    try:
        reader = csv.DictReader(_lines(path, log))
        while True:
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error:
                log.skipped += 1
                continue
            yield row
    finally:
        csv.field_size_limit(old)


def read_table(path: Path) -> EngineLog:
    """A CSV (by its header) or JSONL table with a step column (``STEP_COLUMNS``: in each row, the first of them
    it holds); empty cells are gaps. Read one row at a time."""
    log = EngineLog("table", path)
    jsonl = path.suffix.lower() in (".jsonl", ".json", ".ndjson")
    cols: dict[str, None] = {}
    used = False
    for row in (_jsonl_rows(path, log) if jsonl else _csv_rows(path, log)):
        if len(cols) < 8:
            cols.update(dict.fromkeys(str(k) for k in list(row)[:8] if k is not None))
        step_col = next((c for c in STEP_COLUMNS if c in row), None)
        if step_col is None:
            continue
        used = True
        step = number(row.get(step_col))
        if step is None or step < 0:
            log.skipped += 1
            continue
        for k, v in row.items():
            if k is None or k == step_col or v in ("", None):
                continue
            log.add(int(step), str(k), v)
    if not used:
        raise UserError(f"{path}: no step column (looked for {', '.join(STEP_COLUMNS)}; found "
                        f"{', '.join(list(cols)[:8]) or 'no columns'}); export the table with its step")
    return log


def looks_like_verl_file(path: Path) -> bool:
    """Whether the first non-empty line of ``path`` is a verl file-logger row."""
    try:
        with open_regular(path) as f:
            for line in lines(f, max_line=_SNIFF_LINE):
                if line.strip():
                    row = parse_json(line)
                    return isinstance(row, dict) and set(row) == {"step", "data"}
    except (OSError, ValueError, UserError):
        return False
    return False


def looks_like_verl_console(path: Path, n_lines: int = 20000) -> bool:
    """Whether one of the first ``n_lines`` lines of ``path`` is a verl console ``step:N - key:value`` line."""
    try:
        with open_regular(path) as f:
            for i, raw in enumerate(lines(f, max_line=_SNIFF_LINE)):
                if i >= n_lines:
                    break
                line = _ANSI.sub("", raw.decode("utf-8", errors="replace"))
                if (m := _CONSOLE_STEP.search(line)) and " - " in line[m.end():]:
                    return True
    except (OSError, UserError):
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
    problem = regular_problem(path)
    if problem is not None:  # a FIFO would block and a device never end: refused before anything reads it
        raise UserError(f"{path}: {problem}; give the log file itself")
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
    if kind in ("verl-console", "verl-file", "table", "trl") and not path.is_dir():
        problem = regular_problem(path)
        if problem is not None:
            raise UserError(f"{path}: {problem}; give the log file itself")
    return READERS[kind](path)


__all__ = ["EngineLog", "SOURCES", "detect", "is_erft_path", "number", "read_engine_log"]
