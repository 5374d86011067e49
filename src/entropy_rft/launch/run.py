"""Start, resume or skip a training run in a run directory (shared by ``erft train`` and ``erft compare``).

For the native engine this module is also the run directory's side of a run (``train_native``): where a
resume starts, the logs cut back to it, ``config.yaml``, run.json's status (running, then finished, stopped or
failed) and SIGTERM/SIGINT (a checkpoint, then the status "stopped"), around ``training.trainer.train``'s loop.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from entropy_rft.common.errors import UserError
from entropy_rft.config.schema import Config, config_to_dict
from entropy_rft.rundir import checkpoints
from entropy_rft.rundir import files as rundir
from entropy_rft.rundir.lock import RunLock

if TYPE_CHECKING:
    from entropy_rft.control.registry import Method


def _is_main_process() -> bool:
    """False only on the non-zero ranks of a multi-process launch (``accelerate launch``, torchrun)."""
    import os

    return int(os.environ.get("RANK", "0")) == 0


OnRow = Callable[[dict], None]  # called with each metrics row as the run logs it (erft train's live doctor)


def _train(cfg: Config, out: Path, *, resume: bool, method: Method | None = None,
           on_row: OnRow | None = None) -> dict[str, Any]:
    """Dispatch to the configured engine: our trainer, or TRL through ``integrations.trl_train.train_trl``, with the
    method the request's check built (None: the engine builds it); ``on_row``: see ``OnRow``."""
    if cfg.engine == "trl":
        from entropy_rft.integrations.trl_train import train_trl

        return train_trl(cfg, out, resume=resume, method=method, on_row=on_row)
    on_step = None if on_row is None else (lambda _run, row: on_row(row))
    return train_native(cfg, out, resume=resume, method=method, on_step=on_step)


def device_name(device) -> str:
    """The device in words for run.json: the GPU's name on CUDA (``cuda:0 NVIDIA H100 80GB HBM3``), else its type."""
    import torch

    if device.type == "cuda":
        return f"cuda:{device.index or 0} {torch.cuda.get_device_name(device)}"
    return str(device)


class StopSignals:
    """While installed (``with``), the first SIGTERM/SIGINT/SIGHUP is recorded (``signum``) for the loop to stop
    after its step; a second one stops at once (KeyboardInterrupt; run.json still says "stopped", from the last
    checkpoint). Outside the main thread nothing is installed."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict = {}

    def __call__(self) -> bool:
        return self.signum is not None

    def _handler(self, signum, _frame) -> None:
        if self.signum is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopSignals:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def train_native(cfg: Config, out: str | Path, *, resume: bool = False,
                 on_step: Callable[[Any, dict], None] | None = None, method: Method | None = None) -> dict[str, Any]:
    """Train ``cfg`` into run directory ``out`` with the native engine (fresh, or resumed from its newest intact
    checkpoint). Returns the last metrics row. SIGTERM/SIGINT save a checkpoint, record the status "stopped" and
    raise SystemExit(143/130). The caller holds the run directory's lock (``start``, ``resume``). ``method``: the
    method the request's check built (``config.validation.validate_method``), so the run does not build it again."""
    from entropy_rft.rundir.logger import Logger
    from entropy_rft.training.state import CHECKPOINT_PARTS, build_run, load_checkpoint_state
    from entropy_rft.training.trainer import train

    out = Path(out)
    _, state = checkpoints.resume_point(out, CHECKPOINT_PARTS, 0 if cfg.eval.every else 1) if resume else (None, None)
    if resume and state is None:
        checkpoints.refuse_lost_checkpoints(out, cfg.train.checkpoint_every if cfg.train.checkpoints else None)
    start = int(state["trainer"]["step"]) if state else 0
    # loads the model and checks the prompts: a refusal writes nothing
    run = build_run(cfg, out, start_step=start, method=method)
    if resume:
        rundir.truncate_logs(out, start if state else -1)
    else:
        rundir.atomic_write_text(out / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    import torch

    from entropy_rft.common.numerics import numerics_record

    # the CPU's instruction set in effect (the pin, or not): a table from runs computed otherwise shows it
    where = dict(python=sys.version.split()[0], torch=torch.__version__, device=device_name(run.device),
                 cpu_numerics=numerics_record())
    t_start = time.monotonic()
    rundir.write_status(out, "running", start_step=start, max_steps=cfg.train.max_steps, **where)
    if state is not None:
        load_checkpoint_state(run, state)
    # a resume purges the trackers' events after the checkpoint (all of them when it starts again from step 0)
    logger = Logger(out, cfg, purge_step=(start + 1 if state else 0) if resume else None)
    status = "failed"
    with StopSignals() as stop:
        try:
            last, finished = train(run, logger, stop=stop, on_step=on_step)
            if not finished:
                status = "stopped"
                saved = ("checkpoint saved; continue with" if cfg.train.checkpoints else
                         "no checkpoint (train.checkpoints is false): a resume starts again from step 0 with")
                print(f"stopped at step {run.step}, {saved} `{resume_command(cfg, out)}`", file=sys.stderr,
                      flush=True)
                assert stop.signum is not None  # train stops early only when stop() says so: on a signal
                raise SystemExit(128 + stop.signum)
            status = "finished"
        except KeyboardInterrupt:  # a second signal: stopped at once, mid-step; a resume starts from a checkpoint
            status = "stopped"
            raise
        finally:
            logger.close(quiet=status != "finished")
            with contextlib.suppress(OSError):  # a read-only or full disk must not hide the first error
                rundir.write_status(out, status, step=run.step, start_step=start, max_steps=cfg.train.max_steps,
                                    **where, wall_s=round(time.monotonic() - t_start, 1))  # this session's
    return last


def _preflight(cfg: Config, out: str | Path | None, method: Method | None = None) -> Method:
    """Check the whole request (task, model, device, output path, method) before anything is written; returns
    the method, built once (``method``: the one an earlier check of this request built)."""
    from entropy_rft.training import preflight

    return preflight.check_train(cfg, out, method=method)


def start(cfg: Config, out: str | Path, *, overwrite: bool = False, method: Method | None = None,
          on_row: OnRow | None = None) -> dict[str, Any]:
    """Train ``cfg`` into a new run directory ``out`` (refused if it exists, unless ``overwrite`` and it is
    an erft run directory). The request is checked first, so a refused start writes nothing. ``method``: the
    method ``preflight.check_train`` built for this ``cfg`` (``erft train``), so that it is built once;
    ``on_row``: called with each metrics row as it is logged (on the main process)."""
    if not _is_main_process():
        return _train(cfg, Path(out), resume=False)
    method = _preflight(cfg, out, method)
    rundir.check_new(out, overwrite)  # before the lock file is created in a folder that is not ours
    created = not Path(out).exists()
    with RunLock(out):
        out = rundir.prepare_new(out, overwrite)
        try:
            return _train(cfg, out, resume=False, method=method, on_row=on_row)
        except UserError:
            if created:  # refused before the run wrote anything: leave no folder behind
                rundir.remove_if_only_lock(out)
            raise


def held_steps(out: Path) -> int:
    """The steps a run directory already holds: its newest checkpoint's, or the finished run's."""
    ckpt = checkpoints.latest_checkpoint(out)
    held = checkpoints.checkpoint_step(ckpt) if ckpt is not None else 0
    status = rundir.read_status(out)
    if status.get("status") == "finished" and isinstance(status.get("step"), int):
        held = max(held, status["step"])
    return held


def code_flag(field: str, path: str) -> str:
    """The command-line words that name a code reference again: ``--task PATH`` or ``--set FIELD=PATH``."""
    return f"--task {path}" if field == "task.name" else f"--set {field}={path}"


def resume_command(cfg: Config, out: Path) -> str:
    """``erft train --resume OUT``, with the code references of ``cfg`` named again (``code_flag``)."""
    import shlex

    from entropy_rft.tasks import code_references

    again = "".join(f" {code_flag(f, shlex.quote(p))}" for f, p in code_references(cfg.task.name, cfg.task.params))
    return f"erft train --resume {out}{again}"


def recorded_config(out: Path, given: dict[str, str] | None = None, *, check_method: bool = True) -> Config:
    """A run directory's recorded config, refused in one line when it names code to import (a task import path, a
    reward function) that ``given`` (``{field: path}``, what the person resuming named on the command line or in
    their own config) does not name again, or when ``given`` would change it."""
    from entropy_rft.tasks import code_references, untrusted_code

    cfg = checkpoints.load_run_config(out, check_method=check_method)
    given = dict(given or {})
    recorded = dict(code_references(cfg.task.name, cfg.task.params))
    changed = [f for f, p in given.items() if recorded.get(f) != p]
    if changed:
        raise UserError(f"--resume continues the recorded config; {', '.join(changed)} cannot change it (run {out} "
                        f"records {', '.join(f'{f} {recorded[f]!r}' for f in changed if f in recorded) or 'none'})")
    bad = untrusted_code(cfg.task.name, cfg.task.params, given)
    if bad:
        field, path = bad[0]
        raise UserError(f"run {out} records code to import ({field} {path!r} in its config.yaml); erft imports only "
                        f"code you name: if you trust it, pass {code_flag(field, path)} again with --resume")
    return cfg


def resume(out: str | Path, *, max_steps: int | None = None, given: dict[str, str] | None = None,
           on_row: OnRow | None = None) -> dict[str, Any]:
    """Continue the run in ``out`` from its newest intact checkpoint with its recorded config.

    ``max_steps`` may raise the run's total (not below the steps it already holds); nothing else can change.
    ``given``: the code references (``{field: path}``, ``tasks.code_references``) the caller names again; a
    recorded one it does not name is refused (code is named by the person who runs erft, never by a run folder).
    A finished run that is not extended returns at once. ``on_row``: as ``start``'s.
    """
    out = Path(out)
    from entropy_rft.training import preflight

    preflight.check_resume_dir(out)
    if not _is_main_process():
        return _train(recorded_config(out, given), out, resume=True)
    # a folder that is not a run is refused before the lock file is created; the method: by _preflight, once
    recorded_config(out, given, check_method=False)
    with RunLock(out):
        cfg = recorded_config(out, given, check_method=False)
        if max_steps is not None and max_steps != cfg.train.max_steps:
            if max_steps < 1:
                raise UserError(f"--max-steps must be >= 1, got {max_steps}")
            held = held_steps(out)
            if max_steps < held:
                raise UserError(f"--max-steps {max_steps} is below the {held} steps run {out} already holds; "
                                f"pass --max-steps {held} or more")
            cfg.train.max_steps = max_steps
            method = _preflight(cfg, None)
            rundir.atomic_write_text(out / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        else:
            method = _preflight(cfg, None)
        if is_finished(out, cfg.train.max_steps):
            return {"step": rundir.read_status(out).get("step"), "already_finished": True}
        return _train(cfg, out, resume=True, method=method, on_row=on_row)


def is_finished(out: str | Path, max_steps: int) -> bool:
    """Whether the run in ``out`` finished with at least ``max_steps`` steps: a sweep keeps it as it is."""
    status = rundir.read_status(Path(out))
    return status.get("status") == "finished" and int(status.get("step", 0)) >= max_steps


def start_or_resume(cfg: Config, out: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """For sweeps: a finished run is kept, an interrupted one resumes, a missing one starts."""
    from entropy_rft.tasks import code_references

    out = Path(out)
    if overwrite or not (out / "config.yaml").is_file():
        return start(cfg, out, overwrite=overwrite)
    # the sweep's own config names the code (the recorded config equals it: sweep.check_recorded_configs)
    return resume(out, max_steps=cfg.train.max_steps, given=dict(code_references(cfg.task.name, cfg.task.params)))
