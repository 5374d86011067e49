"""A sweep that runs over many sittings into a results folder: ``erft compare ... --out RUNS --results DIR``
(issue 73's driver, moved into the package by issue 78; benchmarks/gpu/realm.py, behind ``make run-real-cpu`` and
``make run-gpu``, is this driver with its lease's paced wave).

One sitting (:func:`drive`):

0. One writer: the driver holds ``DIR`` and ``RUNS`` (erft's lock, ``.erft.lock``) for its whole life; a second
   driver is refused in one line naming the first's process. The committed runs are checked before anything trains
   (``launch.results.check_results``): a link under ``DIR`` is refused; a run whose ``run.json`` says finished but
   whose rows do not prove it is restored from a finished copy in ``RUNS``, or refused in one line naming the file.
   Runs an earlier driver's sweep is still stopping are waited for (up to ``stop_wait_s``).
1. Every finished run committed under ``DIR`` (proven from its rows: ``rundir.finished``) is copied into ``RUNS``,
   so that ``erft compare`` keeps it instead of training it again (a bare checkout trains only what is missing).
2. ``erft compare`` into ``RUNS`` (a scratch folder: checkpoints and token records stay there), in a session of its
   own that ends with the driver however the driver ends (``launch.sessions``). At ``deadline_s``, or on
   SIGINT/SIGTERM/SIGHUP, it gets SIGTERM: each run saves a checkpoint and stops (a later sitting resumes it);
   after ``stop_wait_s`` SIGKILL reaches every process of the session.
3. The shipped files of each finished run go to ``DIR/<run>/`` every ``export_every_s`` while the runs train, and at
   the end (``launch.results.export``: atomic, minimal, through no link; a failed export is one line, training goes
   on). Once every run is finished: the summary (md + json) and ``erft report``'s report.html (unless
   ``report`` is off). ``DIR/environment.json`` gets one entry per sitting: device, versions, wall time, runs
   finished, whether complete.

Exit status: 0 when every run is finished (and reported), 3 when runs are left (run it again), 2 when refused or
the export failed (one line says why), else compare's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entropy_rft.launch.results import Refused, _say, check_results, log_call, restore, try_export
from entropy_rft.launch.sessions import start_session, stop_session, wait_for_runs

__all__ = ["INCOMPLETE", "Driver", "drive", "environment"]

INCOMPLETE = 3
SUMMARY = ("summary.md", "summary.json")


@dataclass(frozen=True)
class Driver:
    """One resumable sweep: where its finished runs are committed (``results``) and trained (``runs``: the ``--out``
    of ``compare``, the ``erft compare`` command line), and its clock."""

    results: Path
    runs: Path
    compare: list[str]  # the erft compare command (argv), --out runs
    deadline_s: float = float("inf")
    stop_wait_s: float = 60.0
    export_every_s: float = 60.0
    report: bool = True  # erft report over the results once every run is finished
    summarise: bool = True  # copy compare's summary into the results (a paced lease wave has none)
    name: str = "erft compare"  # the first word of each line it prints
    env: dict[str, str] | None = None  # the compare's environment (None: this process's)
    argv: list[str] = field(default_factory=list)  # the sitting's own command line, for environment.json

    def say(self, text: str) -> None:
        print(f"{self.name}: {text}", flush=True)


def environment() -> dict[str, Any]:
    """What the sitting ran on: the device, torch, CUDA, transformers and Python versions."""
    import torch

    try:
        import transformers

        tf: str | None = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        tf = None
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"device": dev, "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": tf,
            "python": sys.version.split()[0]}


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP reached the driver: its runs are stopped with a checkpoint, then it ends."""


def _interrupted(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal handler signature
    raise Interrupted(signal.Signals(signum).name)


def run_compare(d: Driver) -> tuple[int, str | None]:
    """``d.compare`` in a session of its own that ends with the driver; SIGTERM at the deadline or when the driver
    is interrupted (the runs stop with a checkpoint), SIGKILL to every process of the session after
    ``stop_wait_s``. Every ``export_every_s`` the finished runs are exported; a failed export is said in one line
    and tried again while training goes on. Returns compare's exit status (3: runs are left) and the last export's
    failure."""
    handlers = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc = start_session(d.compare, env=d.env)
    deadline = time.monotonic() + d.deadline_s
    failure: str | None = None
    try:
        while True:  # each run lands in the results as soon as it finishes: a sweep stopped later loses none of them
            try:
                return proc.wait(timeout=max(0.0, min(d.export_every_s, deadline - time.monotonic()))), failure
            except subprocess.TimeoutExpired:
                _, error = try_export(d.runs, d.results)
                if error and error != failure:
                    d.say(f"{error}; training goes on, the export is tried again every {d.export_every_s:g} s")
                failure = error
                if time.monotonic() >= deadline:
                    d.say(f"deadline {d.deadline_s:g} s: stopping the runs (each saves a checkpoint)")
                    stop_session(proc, d.stop_wait_s)
                    return INCOMPLETE, failure
    except Interrupted as e:
        d.say(f"{e}: stopping the runs (each saves a checkpoint; call again to resume)")
        stop_session(proc, d.stop_wait_s)
        return INCOMPLETE, failure
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _driver_lock(folder: Path, what: str) -> Any:
    """The driver's hold on ``folder`` (``.erft.lock``, erft's one-writer lock) for its whole life: a second driver
    on the same results or runs is refused in one line naming the process, before anything is written."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.rundir.lock import RunLock

    lock = RunLock(folder, what=what, advice="another sweep driver is writing it: wait for it to finish or stop "
                   "it (kill PID: its runs save a checkpoint); nothing was started")
    try:
        return lock.acquire()
    except UserError as e:
        raise Refused(_say(str(e))) from None
    except OSError as e:
        raise Refused(f"{what} {_say(str(folder))} cannot be written ({e.strerror}); choose another") from None


def drive(d: Driver, train: Callable[[Driver], tuple[int, str | None]] = run_compare) -> int:
    """One sitting, its folders held (the module docstring); ``train``: how the runs are trained (default
    :func:`run_compare`; the lease's paced wave passes its own). Its exit status."""
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as held:
            for folder, what in ((d.results, "results folder"), (d.runs, "runs folder")):
                held.callback(_driver_lock(folder, what).release)
            return _sitting(d, train, t0)
    except Refused as e:
        d.say(str(e))
        return 2


def _sitting(d: Driver, train: Callable[[Driver], tuple[int, str | None]], t0: float) -> int:
    for line in check_results(d.results, d.runs):
        d.say(line)
    still = wait_for_runs(d.runs, d.stop_wait_s, d.say)
    if still:
        raise Refused(f"{len(still)} run(s) in {_say(str(d.runs))} are still held by an earlier sweep "
                      f"({', '.join(f'{n}: {w}' for n, w in still[:3])}): wait for it to end or stop it")
    try:
        restored = restore(d.results, d.runs)
    except OSError as e:
        raise Refused(f"keeping the committed runs in {_say(str(d.runs))} failed ({e.strerror}: "
                      f"{_say(str(e.filename))}); free the space and run it again") from None
    if restored:
        d.say(f"kept {len(restored)} run(s) already in {_say(str(d.results))}: {', '.join(restored)}")
    rc, _ = train(d)  # a failed export while training is tried again here: this one decides
    exported, failure = try_export(d.runs, d.results)
    complete = rc == 0 and failure is None
    if complete and not d.summarise:
        d.say("every run finished; the summary: `erft compare` over the results, on a CPU")
    elif complete:
        from entropy_rft.rundir.files import atomic_write_bytes

        try:
            for name in SUMMARY:
                atomic_write_bytes(d.results / name, (d.runs / name).read_bytes())
        except OSError as e:
            failure = f"the summary's export failed ({e.strerror}: {_say(str(e.filename))})"
        cmd = [sys.executable, "-m", "entropy_rft.cli", "report", str(d.results), "--out", str(d.results / "report")]
        rc = 0 if not d.report or failure else subprocess.call(cmd, env=d.env)
        complete = rc == 0 and failure is None
    try:
        aside = log_call(d.results, {**environment(), "wall_s": round(time.monotonic() - t0, 1),
                                     "runs_finished": len(exported), "complete": complete, "argv": d.argv})
        if aside:
            d.say(aside)
    except OSError as e:
        failure = failure or f"writing {_say(str(d.results / 'environment.json'))} failed ({e.strerror})"
    if failure:
        d.say(f"{failure}: the finished runs are kept in {_say(str(d.runs))}; free the space (or mend the folder) "
              "and run it again to export them")
        return 2
    d.say(f"{len(exported)} run(s) finished in {_say(str(d.results))}; "
          + ("complete" if complete else "incomplete: run it again"))
    return 0 if complete else (rc if rc not in (0, None) else INCOMPLETE)


def compare_env(src: Path) -> dict[str, str]:
    """This environment with ``src`` first on PYTHONPATH (a checkout without the package installed: the lent GPU
    machine)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
