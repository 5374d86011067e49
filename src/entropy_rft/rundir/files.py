"""The run directory: atomic files, append-only JSONL logs, status, lock. Nothing is ever half-written.

The run's writer of its logs is :class:`entropy_rft.rundir.logger.Logger`; checkpoints and the recorded config
live in :mod:`entropy_rft.rundir.checkpoints`.

Layout of ``--out DIR``::

    config.yaml          resolved config, written atomically before any heavy work
    run.json             status: started / finished, steps, versions
    metrics.jsonl        one JSON object per step (and step 0 for the base evaluation)
    samples.jsonl        (prompt, response, reward) every N steps
    token_records.jsonl  per-token probe records every N steps
    tb/                  TensorBoard events (train.report_to: tensorboard)
    trackers.json        each tracker's run id, so that a resume continues the same run (entropy_rft.rundir.trackers)
    wandb/, mlflow.db    W&B's and MLflow's local files (train.report_to: wandb, mlflow; mlartifacts/: MLflow's)
    checkpoints/step_000050/   model, optimizer, scheduler, RNG states (atomic, last k kept)
    final/               the final policy, HF format (save_pretrained)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from entropy_rft.common.errors import UserError
from entropy_rft.common.streams import LineCounts
from entropy_rft.rundir.guard import follow_umask, refuse_link_out
from entropy_rft.rundir.lock import LOCK, RunLock

CHECKPOINTS = "checkpoints"
LOGS = ("metrics.jsonl", "samples.jsonl", "token_records.jsonl", "token_view.jsonl", "doctor.jsonl")


def fsync_dir(path: Path) -> None:
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


def as_os_error(e: BaseException, path: str | Path) -> BaseException:
    """The ``OSError`` behind a writer's own exception, named with ``path``, so that the CLI says it in one line
    ("No space left on device; the disk is full..."): ``torch.save``'s C++ writer raises ``RuntimeError``
    ("[enforce fail at inline_container.cc] unexpected pos") with the file object's ``OSError`` as its context,
    safetensors a ``SafetensorError`` ("I/O error: No space left on device (os error 28)"). ``e`` itself when
    no OS error is behind it."""
    import re

    ctx: BaseException | None = e
    while ctx is not None:
        if isinstance(ctx, OSError) and ctx.errno is not None:
            return OSError(ctx.errno, ctx.strerror, str(path))
        ctx = ctx.__context__
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        return OSError(int(m.group(1)), os.strerror(int(m.group(1))), str(path))
    return e


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        follow_umask(fd)  # mkstemp makes it 0600; the run's files are the user's as any file they write
        f = os.fdopen(fd, "wb")
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        finally:  # a full disk fails the write or the flush; closing must not raise it again, unnamed
            with contextlib.suppress(OSError):
                f.close()
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None  # named: the CLI's one line says which file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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
        refuse_link_out(self.path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - long-lived handle

    def write(self, record: dict) -> None:
        self.write_many([record])

    def write_many(self, records: Iterable[dict]) -> None:
        try:
            for r in records:
                self._f.write(json.dumps(json_safe(r), allow_nan=False) + "\n")
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
        except OSError as e:  # a full or read-only disk: say which file
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def sync(self) -> None:
        """Force what was written to disk (a kill loses nothing flushed; this covers power loss too)."""
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        if not self._f.closed:
            self.sync()
        self._f.close()


FAULT_ENV = "ERFT_FAULT"


def fault_point(point: str, step: int) -> None:
    """The fault-injection hook of the crash tests: with ``ERFT_FAULT=<point>:<step>`` in the environment, the
    process kills itself (SIGKILL, no cleanup) when it reaches ``point`` at ``step``. Points: ``after_row``
    (step N's metrics row written, its checkpoint not yet), ``in_checkpoint`` (checkpoint N's first file
    written, its manifest not yet). Unset, it does nothing."""
    if os.environ.get(FAULT_ENV) == f"{point}:{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def warn(msg: str) -> None:
    """One line on stderr: something was wrong but nothing is lost, and the run goes on."""
    from entropy_rft.common.text import visible

    print(f"erft: warning: {visible(msg)}", file=sys.stderr, flush=True)


def _parse_lines(path: Path) -> tuple[list[tuple[int, str, dict | None]], bool]:
    """(line number, raw line, record or None when damaged) for every non-blank line, and whether the last
    line is torn (no newline at the end of the file: a write that a kill interrupted). Any line is survived:
    one nested too deep, or not UTF-8, is damaged, not an error."""
    data = path.read_bytes()
    torn = bool(data) and not data.endswith(b"\n")
    out = []
    lines = data.split(b"\n")
    if not torn:
        lines = lines[:-1]  # the empty string after the final newline
    for i, raw in enumerate(lines, 1):
        text = raw.decode("utf-8", errors="replace")
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: a line nested too deep for the decoder
            rec = None
        if not isinstance(rec, dict):
            rec = None
        out.append((i, text, rec))
    return out, torn


_WARNED: set[tuple[str, int, str]] = set()  # (file, line, text): each damaged line is warned about once


def _warn_line(p: Path, n: int, text: str, msg: str) -> None:
    """``warn(msg)`` about line ``n`` of ``p``, once however often the file is read (erft compare and erft report
    read a run's log more than once) until :func:`forget_warnings`."""
    key = (str(p.resolve()), n, text)
    if key not in _WARNED:
        _WARNED.add(key)
        warn(msg)


def forget_warnings() -> None:
    """Warn again about damaged lines already warned about (a command calls it as it starts: once per command)."""
    _WARNED.clear()


def read_jsonl(path: str | Path, counts: LineCounts | None = None) -> list[dict]:
    """Every intact JSON line of ``path``. A damaged line is skipped with a warning naming the file and the
    line; a torn last line (a write in progress, or one a kill interrupted) is skipped without one, and counted
    in ``counts.unfinished`` (so that a reader such as ``erft report`` can say so)."""
    p, counts = Path(path), counts if counts is not None else LineCounts()
    if not p.exists():
        return []
    lines, torn = _parse_lines(p)
    out = []
    for k, (n, text, rec) in enumerate(lines):
        if rec is not None:
            out.append(rec)
        elif torn and k == len(lines) - 1:
            counts.unfinished += 1
        else:
            _warn_line(p, n, text, f"{p}:{n} is not a JSON object; skipped")
    return out


def _step(rec: dict) -> int | None:
    v = rec.get("step")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _step_damage(rec: dict | None) -> str | None:
    """Why a per-step log row is damaged (not a JSON object; its step missing, not an integer, or negative),
    or None when it is intact."""
    if rec is None:
        return "is not a JSON object"
    if "step" not in rec:
        return "has no step"
    step = _step(rec)
    if step is None or step < 0:
        return f"has step {json.dumps(rec['step'])}, not a whole number >= 0"
    return None


def read_step_log(path: str | Path, counts: LineCounts | None = None) -> list[dict]:
    """The intact rows of a per-step log (``metrics.jsonl``): JSON objects whose ``step`` is an integer >= 0.

    As :func:`read_jsonl`, a damaged line (not a JSON object, or a step that is missing, not an integer,
    boolean or negative) is skipped with one warning naming the file and the line, and a torn last line
    without one (counted in ``counts.unfinished``); a value that is text or a mapping (a metric is a number,
    null or a list) is read as null, with one warning for its line. Each line is warned about once per process
    (:func:`_warn_line`). Refused in one line (:class:`UserError`) when ``path`` is not a file or when no line
    is intact; a missing or empty file gives ``[]``."""
    p, counts = Path(path), counts if counts is not None else LineCounts()
    if not p.exists():
        return []
    if not p.is_file():
        kind = "a directory" if p.is_dir() else "not a regular file"
        raise UserError(f"{p}: is {kind}, not a file; move it away and put the run's {p.name} back")
    lines, torn = _parse_lines(p)
    out: list[dict] = []
    damaged: list[tuple[int, str, str]] = []
    bad_values: list[tuple[int, str, str, Any, int]] = []
    for k, (n, text, rec) in enumerate(lines):
        why = _step_damage(rec)
        if why is None:
            assert rec is not None  # _step_damage(None) is a reason
            # A metric is a number, null (NaN) or a list (eval/pass_rate_hist); text or a mapping is damage:
            # that value is read as null, the rest of the row is used.
            bad = [key for key, v in rec.items() if isinstance(v, (str, dict))]
            if bad:
                bad_values.append((n, text, bad[0], rec[bad[0]], len(bad) - 1))
                rec = {**rec, **dict.fromkeys(bad)}
            out.append(rec)
        elif torn and k == len(lines) - 1 and "\0" not in text:  # NULs are damage, not a write in progress
            counts.unfinished += 1
        else:
            damaged.append((n, text, why))
    if not out and damaged:  # one line, not a warning per line before it
        n, _text, why = damaged[0]
        more = f", and {len(damaged) - 1} more line(s) are damaged" if len(damaged) > 1 else ""
        raise UserError(f"{p}: no intact row (line {n} {why}{more}); restore the file from a copy, or train "
                        "the run again with --overwrite")
    for n, text, why in damaged:
        _warn_line(p, n, text, f"{p}:{n} {why}; skipped")
    _warn_order(p, out, [n for n, _t, rec in lines if _step_damage(rec) is None])
    for n, text, key, v, n_others in bad_values:
        others = f" (and {n_others} other value(s))" if n_others else ""
        _warn_line(p, n, text, f"{p}:{n} has {key} = {json.dumps(v)[:40]}, not a number{others}; read as null, "
                               "the rest of the row used")
    return out


def _warn_order(p: Path, rows: list[dict], line_numbers: list[int]) -> None:
    """Warn (once per line) about a step logged twice or after a later one: a run writes one row per step, in
    order, so either means two writers or an edited file; the rows are read as they are."""
    seen: dict[int, int] = {}
    last = -1
    for rec, n in zip(rows, line_numbers):
        step = rec["step"]
        if step in seen:
            _warn_line(p, n, str(step), f"{p}:{n} logs step {step} twice (line {seen[step]} too); one run writes "
                                        "one row per step: check that no two processes wrote this run")
        elif step < last:
            _warn_line(p, n, str(step), f"{p}:{n} logs step {step} after step {last}, out of order; one run writes "
                                        "its steps in order: check that no two processes wrote this run")
        seen.setdefault(step, n)
        last = max(last, step)


def set_aside(path: Path, damaged: list[tuple[int, str]]) -> Path:
    """Append damaged lines (with their line numbers) to ``<file>.damaged``: nothing is ever thrown away."""
    aside = path.with_name(path.name + ".damaged")
    refuse_link_out(aside)
    with open(aside, "a", encoding="utf-8") as f:
        for n, text in damaged:
            f.write(json.dumps({"line": n, "text": text}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return aside


def truncate_jsonl(path: str | Path, max_step: int) -> int:
    """Prepare a log for a resume from ``max_step``: keep every intact line whose ``step`` is <= max_step
    (the resumed run writes the later ones again, identically); damaged lines are set aside in
    ``<file>.damaged`` with a warning naming file and line, never silently dropped with what follows them.
    Returns the number of lines kept."""
    p = Path(path)
    if not p.exists():
        return 0
    lines, torn = _parse_lines(p)
    kept, damaged = [], []
    for k, (n, text, rec) in enumerate(lines):
        if rec is None:
            damaged.append((n, text))
            last = k == len(lines) - 1
            if not last:
                warn(f"{p}:{n} is damaged (not a JSON object); set aside in {p.name}.damaged, the rows around it kept")
            elif not torn:
                warn(f"{p}:{n} (the last line) is damaged; set aside in {p.name}.damaged")
        elif (_step(rec) or 0) <= max_step:
            kept.append(text + "\n")
    if damaged:
        set_aside(p, damaged)
    atomic_write_text(p, "".join(kept))
    return len(kept)


def log_gaps(path: str | Path, first: int, last: int) -> list[int]:
    """The steps in ``[first, last]`` that have no intact row in the log ``path`` (one row per step)."""
    p = Path(path)
    if last < first:
        return []
    have = set()
    if p.exists():
        have = {_step(rec) for _n, _t, rec in _parse_lines(p)[0] if rec is not None}
    return [s for s in range(first, last + 1) if s not in have]


def truncate_logs(out: str | Path, step: int) -> None:
    """Prepare every log for a resume from ``step`` (see :func:`truncate_jsonl`)."""
    for name in LOGS:
        truncate_jsonl(Path(out) / name, step)


# ----------------------------------------------------------------------------- the directory

SCHEMA = "erft.run/1"  # run.json's marker: a folder holding it was created by erft
# What a run writes (files, folders, and the prefixes of its temp files): all --overwrite may remove.
RUN_ENTRIES = ("config.yaml", "run.json", *LOGS, *(f"{n}.damaged" for n in LOGS), "tb", CHECKPOINTS, "final",
               "trl", "wandb", "mlflow.db", "mlartifacts", "trackers.json", LOCK)
RUN_TEMP_PREFIXES = (".final_", ".config.yaml.", ".run.json.", ".metrics.jsonl.", ".samples.jsonl.",
                     ".token_records.jsonl.", ".token_view.jsonl.", ".doctor.jsonl.", ".trackers.json.", "mlflow.db-")


def is_run_dir(out: str | Path) -> bool:
    """True when ``out`` holds a ``run.json`` written by erft (our schema, or the fields of older versions): a
    folder erft made and may overwrite or resume (:func:`has_metrics` asks only for readable rows)."""
    info = read_status(out)
    return bool(info) and (info.get("schema") == SCHEMA or {"status", "max_steps"} <= info.keys()
                                       or {"status", "step"} <= info.keys())


def has_metrics(path: str | Path) -> bool:
    """True when ``path`` is a folder holding a ``metrics.jsonl``: a run whose rows can be read (``erft report``,
    ``fit-law``), whoever wrote it. Weaker than :func:`is_run_dir`, which asks for erft's ``run.json`` marker
    before anything in the folder may be replaced; a ``metrics.jsonl`` that is not a file is refused when the
    run is read."""
    path = Path(path)
    return path.is_dir() and os.path.lexists(path / "metrics.jsonl")


def last_step(out: str | Path, tail_bytes: int = 65536) -> int | None:
    """The step of the last complete row of ``out/metrics.jsonl``, read from its tail only (a progress line
    for a run another process is writing); None when there is no such row yet or it is unreadable."""
    path = Path(out) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().split(b"\n")[:-1]  # the part after the last newline is a row being written
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def write_status(out: str | Path, status: str, **fields: Any) -> None:
    """``run.json``: the run's status (running / stopped / failed / finished) with our schema marker."""
    atomic_write_json(Path(out) / "run.json", {"schema": SCHEMA, "status": status, **fields})


def read_status(out: str | Path) -> dict[str, Any]:
    """``run.json`` as a dict (empty when missing or unreadable)."""
    try:
        info = json.loads((Path(out) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def _foreign(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()
                  if p.name not in RUN_ENTRIES and not p.name.startswith(RUN_TEMP_PREFIXES))


def check_new(out: str | Path, overwrite: bool, *, locked: bool = False) -> None:
    """Refuse ``out`` for a fresh run (without touching it): an existing non-empty folder is refused unless
    ``overwrite``, and even then unless erft created it and it holds nothing but what a run writes."""
    out = Path(out)
    present = [p for p in out.iterdir() if p.name != LOCK] if out.is_dir() else []
    if not present:
        return
    if not locked:
        RunLock.refuse_if_held(out)
    if not is_run_dir(out):
        raise UserError(f"'{out}' already exists and is not a run directory made by erft (no erft run.json); "
                        "choose another --out")
    if not overwrite:
        raise UserError(f"run directory '{out}' already exists; pass --resume {out} to continue it, "
                        "--overwrite to replace it, or choose another --out")
    foreign = _foreign(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise UserError(f"--overwrite refused: '{out}' holds files erft did not write ({shown}); move them "
                        "away or choose another --out")


def prepare_new(out: str | Path, overwrite: bool) -> Path:
    """Make ``out`` ready for a fresh run (see :func:`check_new`): with ``overwrite``, remove the files a
    previous run wrote there, and nothing else. Call with the run's lock held."""
    out = Path(out)
    check_new(out, overwrite, locked=True)
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    return out


def remove_if_only_lock(out: str | Path) -> None:
    """Remove ``out`` when it holds nothing but the lock file (a start refused before it wrote anything)."""
    out = Path(out)
    if out.is_dir() and [p.name for p in out.iterdir()] == [LOCK]:
        (out / LOCK).unlink()
        out.rmdir()
