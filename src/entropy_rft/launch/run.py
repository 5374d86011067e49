"""Start, resume or skip a training run in a run directory (shared by ``erft train`` and ``erft compare``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from entropy_rft.common.errors import UserError
from entropy_rft.config.schema import Config, config_to_dict
from entropy_rft.rundir import checkpoints
from entropy_rft.rundir import files as rundir

if TYPE_CHECKING:
    from entropy_rft.control.registry import Method


def _is_main_process() -> bool:
    """False only on the non-zero ranks of a multi-process launch (``accelerate launch``, torchrun)."""
    import os

    return int(os.environ.get("RANK", "0")) == 0


def _train(cfg: Config, out: Path, *, resume: bool, method: Method | None = None) -> dict[str, Any]:
    """Dispatch to the configured engine: our trainer, or TRL through ``integrations.trl.train_trl``, with the
    method the request's check built (None: the engine builds it)."""
    if cfg.engine == "trl":
        from entropy_rft.integrations.trl import train_trl

        return train_trl(cfg, out, resume=resume, method=method)
    from entropy_rft.training.trainer import train

    return train(cfg, out, resume=resume, method=method)


def _preflight(cfg: Config, out: str | Path | None, method: Method | None = None) -> Method:
    """Check the whole request (task, model, device, output path, method) before anything is written; returns
    the method, built once (``method``: the one an earlier check of this request built)."""
    from entropy_rft.training import preflight

    return preflight.check_train(cfg, out, method=method)


def start(cfg: Config, out: str | Path, *, overwrite: bool = False, method: Method | None = None) -> dict[str, Any]:
    """Train ``cfg`` into a new run directory ``out`` (refused if it exists, unless ``overwrite`` and it is
    an erft run directory). The request is checked first, so a refused start writes nothing. ``method``: the
    method ``preflight.check_train`` built for this ``cfg`` (``erft train``), so that it is built once."""
    if not _is_main_process():
        return _train(cfg, Path(out), resume=False)
    method = _preflight(cfg, out, method)
    rundir.check_new(out, overwrite)  # before the lock file is created in a folder that is not ours
    created = not Path(out).exists()
    with rundir.RunLock(out):
        out = rundir.prepare_new(out, overwrite)
        try:
            return _train(cfg, out, resume=False, method=method)
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


def resume(out: str | Path, *, max_steps: int | None = None) -> dict[str, Any]:
    """Continue the run in ``out`` from its newest intact checkpoint with its recorded config.

    ``max_steps`` may raise the run's total (not below the steps it already holds); nothing else can change.
    A finished run that is not extended returns at once.
    """
    out = Path(out)
    from entropy_rft.training import preflight

    preflight.check_resume_dir(out)
    if not _is_main_process():
        return _train(checkpoints.load_run_config(out), out, resume=True)
    # a folder that is not a run is refused before the lock file is created; the method: by _preflight, once
    checkpoints.load_run_config(out, check_method=False)
    with rundir.RunLock(out):
        cfg = checkpoints.load_run_config(out, check_method=False)
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
        return _train(cfg, out, resume=True, method=method)


def is_finished(out: str | Path, max_steps: int) -> bool:
    """Whether the run in ``out`` finished with at least ``max_steps`` steps: a sweep keeps it as it is."""
    status = rundir.read_status(Path(out))
    return status.get("status") == "finished" and int(status.get("step", 0)) >= max_steps


def start_or_resume(cfg: Config, out: str | Path, *, overwrite: bool = False) -> dict[str, Any]:
    """For sweeps: a finished run is kept, an interrupted one resumes, a missing one starts."""
    out = Path(out)
    if overwrite or not (out / "config.yaml").is_file():
        return start(cfg, out, overwrite=overwrite)
    return resume(out, max_steps=cfg.train.max_steps)
