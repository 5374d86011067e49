"""``erft doctor``, live: the same detectors (``analysis.doctor``) on a run while it trains.

Three ways in, one rule for what is said: a check runs at each new validation score and every ``every`` steps,
and only a finding that is **new** (an id not announced yet) or **worse** (a higher level than announced) is
announced (``Announcer``); a finding that stays as it was is not repeated.

- ``RowDoctor``: ``erft train``'s. Fed each metrics row as the run logs it (``launch.run``'s ``on_row``, on the
  native and the TRL engine); prints each announcement on stderr and appends it to the run directory's
  ``doctor.jsonl`` (one row per announced finding, with its step), so the run keeps what it was told.
- ``DoctorCallback``: a ``transformers.TrainerCallback`` for stock TRL ``GRPOTrainer`` and erft's
  ``EntropyControlGRPOTrainer``. It reads the trainer's own ``state.log_history`` (the keys TRL logs:
  ``entropy``, ``eval_reward`` or, before any evaluation, ``reward``; ``frac_reward_zero_std``,
  ``completions/clipped_ratio``, ``clip_ratio/region_mean``, ``kl``), and with ``halt_on=LEVEL`` stops training
  cleanly through TRL's own ``control.should_training_stop`` (with ``should_save``: the trainer saves its
  checkpoint first) once a finding at or above LEVEL is announced. Every rank runs the same check on the same
  gathered log, so every rank stops at the same step; only the main process prints.
- ``follow``: ``erft doctor --follow FILE`` on a verl or TRL log another process is writing (verl has no
  logging plug-in: its console and file logs are the way in). It rereads the log when it grows.

Text from a log is shown, never obeyed (``common.text.visible``), and prescriptions come from the method
registry, as in ``erft doctor``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entropy_rft.analysis.doctor import LEVELS, Finding, RunSeries, describe, diagnose
from entropy_rft.common.errors import UserError

DEFAULT_EVERY = 10  # a check at every N-th step, besides each step with a new validation score


@dataclass
class Announcer:
    """What has been announced: a finding's id and the highest level it was announced at."""

    levels: dict[str, int] = field(default_factory=dict)

    def news(self, found: Sequence[Finding]) -> list[Finding]:
        """The findings of ``found`` that are new or worse than announced; they count as announced now."""
        out = []
        for f in found:
            level = LEVELS.index(f.level)
            if level > self.levels.get(f.id, -1):
                self.levels[f.id] = level
                out.append(f)
        return out


def reaches(found: Sequence[Finding], level: str | None) -> Finding | None:
    """The first finding of ``found`` at or above ``level`` (None: no level, or none there)."""
    if level is None:
        return None
    floor = LEVELS.index(level)
    return next((f for f in found if LEVELS.index(f.level) >= floor), None)


def check_level(level: str | None, name: str = "halt_on") -> None:
    if level is not None and level not in LEVELS:
        raise UserError(f"{name} must be one of {', '.join(LEVELS)} (or None), got {level!r}")


def _due(step: int, every: int, scored: bool) -> bool:
    """A check is due at a step with a new score and at every ``every``-th step."""
    return scored or step % every == 0


def announcement_rows(step: int, found: Sequence[Finding]) -> list[dict[str, Any]]:
    """``doctor.jsonl``'s rows: the step a finding was announced at, then the finding."""
    return [{"step": step, **f.to_dict()} for f in found]


class RowDoctor:
    """``erft train``'s live doctor (the module docstring). ``out``: the run directory (``doctor.jsonl`` goes
    there); ``cfg``: the run's config as a dict (the method and its knob, for the prescriptions; None: read from
    the run's ``config.yaml`` at the first row); ``every``: steps between checks when no evaluation arrives;
    ``file``: where announcements print (stderr)."""

    FILE = "doctor.jsonl"

    def __init__(self, out: str | Path, cfg: Mapping[str, Any] | None = None, *, every: int = DEFAULT_EVERY,
                 file: Any = None) -> None:
        self.out, self.cfg, self.every, self.file = Path(out), cfg, every, file
        self.rows: list[dict[str, Any]] = []
        self.announcer = Announcer()
        self.writer: Any = None

    def _start(self, step: int) -> None:
        """On the first row of this process: the rows and announcements of the steps before it (a resume)."""
        from entropy_rft.rundir.files import JsonlWriter, read_jsonl

        if self.cfg is None:
            from entropy_rft.analysis.runs import read_run_config

            self.cfg = read_run_config(self.out)
        if step > 1:
            self.rows = [r for r in read_jsonl(self.out / "metrics.jsonl") if int(r.get("step", -1)) < step]
            for r in read_jsonl(self.out / self.FILE):
                if int(r.get("step", -1)) < step and r.get("level") in LEVELS:
                    lvl = LEVELS.index(r["level"])
                    self.announcer.levels[str(r["id"])] = max(lvl, self.announcer.levels.get(str(r["id"]), -1))
        self.writer = JsonlWriter(self.out / self.FILE, fsync=False)

    def row(self, row: Mapping[str, Any]) -> list[Finding]:
        """Take one logged metrics row; check when due; announce and record what is new or worse."""
        step = int(row["step"])
        if self.writer is None:
            self._start(step)
        self.rows.append(dict(row))
        scored = isinstance(row.get("eval/pass@1"), (int, float))
        if step < 1 or not _due(step, self.every, scored):
            return []
        from entropy_rft.analysis.doctor import series_from_rows

        try:
            series = series_from_rows(str(self.out), self.rows, self.cfg or {}, reward_as_score=True)
        except UserError:  # no score or no training step yet: nothing to judge
            return []
        news = self.announcer.news(diagnose(series))
        if news:
            self.writer.write_many(announcement_rows(step, news))
            say_findings(news, f"doctor, step {step}", self.file if self.file is not None else sys.stderr)
        return news

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def say_findings(found: Sequence[Finding], head: str, file: Any) -> None:
    from entropy_rft.common.text import visible

    for f in found:
        lines = describe(f)
        print(visible(f"{head}: {lines[0]}"), file=file, flush=True)
        for line in lines[1:]:
            print(visible(f"  {line}"), file=file, flush=True)


# ----------------------------------------------------------------------------- TRL


def _trl_series(history: list, name: str, entropy_key: str | None, metric: str | None) -> RunSeries:
    from entropy_rft.analysis.doctor import series_from_log
    from entropy_rft.analysis.engine_logs import trl_history_log

    return series_from_log(trl_history_log(history, Path(name)), name, entropy_key, metric, reward_as_score=True)


def doctor_callback(every: int = DEFAULT_EVERY, halt_on: str | None = None, *, method: str = "none",
                    params: Mapping[str, Any] | None = None, entropy_key: str | None = None,
                    metric: str | None = None, printer: Callable[[str], None] | None = None) -> Any:
    """A ``DoctorCallback`` (the module docstring) for ``GRPOTrainer(callbacks=[...])``: check every ``every``
    logged steps and at each evaluation; ``halt_on`` ("info", "warn", "error" or None) stops training cleanly on
    a finding at or above it; ``method``/``params``: the entropy method the run trains with, for the
    prescriptions (erft's trainer: its ``method.name``); ``printer``: where lines go (``print`` on the main
    process). ``found`` holds every announcement (step, finding); ``halted`` the finding that stopped the run."""
    from transformers import TrainerCallback

    check_level(halt_on)
    if every < 1:
        raise UserError(f"every must be >= 1, got {every}")

    class DoctorCallback(TrainerCallback):
        def __init__(self) -> None:
            self.announcer = Announcer()
            self.found: list[tuple[int, Finding]] = []
            self.halted: Finding | None = None

        def on_log(self, args, state, control, logs=None, **kw):
            step = int(state.global_step)
            scored = any(k.startswith("eval_") for k in (logs or {}))
            if self.halted is not None or step < 1 or not _due(step, every, scored):
                return control
            try:
                series = _trl_series(state.log_history, args.output_dir, entropy_key, metric)
            except UserError:  # no entropy or score logged yet
                return control
            series.method, series.params = method, dict(params or {})
            news = self.announcer.news(diagnose(series))
            self.found += [(step, f) for f in news]
            if news and state.is_world_process_zero:
                if printer is None:
                    say_findings(news, f"doctor, step {step}", sys.stderr)
                else:
                    for f in news:
                        for line in describe(f):
                            printer(line)
            stop = reaches(news, halt_on)
            if stop is not None:
                self.halted = stop
                control.should_training_stop = True
                control.should_save = True  # TRL saves its checkpoint before the loop ends
                if state.is_world_process_zero:
                    print(f"doctor: halting at step {step} on [{stop.level}] {stop.id} (halt_on={halt_on})",
                          file=sys.stderr, flush=True)
            return control

    return DoctorCallback()


# ----------------------------------------------------------------------------- a log being written


def follow(path: str | Path, *, source: str | None = None, entropy_key: str | None = None,
           metric: str | None = None, poll_s: float = 2.0, idle_exit_s: float | None = None,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[int, list[Finding]]]:
    """Tail a verl or TRL log another process is writing: reread it each time it grows (size or mtime), judge
    it, and yield ``(last step, new or worse findings)`` after each check that found some. Until the log has
    not grown for ``idle_exit_s`` seconds (None: until interrupted). A log that cannot be judged yet (empty, not
    yet recognisable, no entropy or score logged) is waited for; if it stops growing so, its one-line refusal
    is raised at ``idle_exit_s``."""
    from entropy_rft.analysis.doctor import series_from_log
    from entropy_rft.analysis.engine_logs import read_engine_log

    p = Path(path)
    announcer = Announcer()
    seen: tuple[int, int] | None = None
    pending: UserError | None = None  # why the log as last read cannot be judged yet
    idle_since = time.monotonic()
    while True:
        try:
            st = os.stat(p if p.is_file() else _newest_state(p))
            mark = (st.st_size, st.st_mtime_ns)
        except (OSError, UserError):
            mark = None
        if mark is not None and mark != seen:
            seen, idle_since = mark, time.monotonic()
            try:
                series = series_from_log(read_engine_log(p, source), str(p), entropy_key, metric,
                                         reward_as_score=True)
                pending = None
            except UserError as e:  # not enough logged yet (an empty log, no entropy or score): wait for more
                series, pending = None, e
            if series is not None and series.entropy and series.score:
                news = announcer.news(diagnose(series))
                if news:
                    yield max(series.entropy), news
        elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
            if pending is not None:  # it stopped growing as something that cannot be judged: say why
                raise pending
            return
        sleep(poll_s)


def _newest_state(folder: Path) -> Path:
    """A TRL output_dir's newest trainer_state.json (what grows as it trains: written at each save)."""
    from entropy_rft.analysis.engine_logs import trl_state_file

    found = trl_state_file(folder)
    if found is None:
        raise UserError(f"{folder}: no trainer_state.json yet")
    return found
