"""Experiment trackers: views of ``metrics.jsonl``, never its keeper.

``metrics.jsonl`` is always written (``rundir.logger.Logger``); the trackers named by ``train.report_to`` (TRL's names:
``tensorboard``, ``wandb``, ``mlflow``, ``trackio``) receive the same rows as scalars, with the same key names, on
erft's step axis. The legacy switches still work: ``train.tensorboard: false`` removes ``tensorboard``,
``train.wandb: true`` adds ``wandb`` (:func:`entropy_rft.common.options.trackers_selected`).

A resume continues the same tracker run: each backend's run id is stored in ``<out>/trackers.json`` (written
atomically) when it starts, and passed back on the next start (W&B ``id=..., resume="allow"``; MLflow the same
``run_id`` in the same store; trackio the same project and run name with ``resume="allow"``).

Where each backend writes:

- tensorboard: ``<out>/tb`` (a resume purges the events from the resumed step on);
- wandb: ``<out>/wandb`` (``WANDB_MODE=offline`` for no network; ``wandb sync`` uploads later);
- mlflow: ``MLFLOW_TRACKING_URI`` when set, else a SQLite store ``<out>/mlflow.db`` (MLflow's own default backend;
  needs sqlalchemy and alembic; the file store cannot hold both ``lens/drop_frac`` and ``lens/drop_frac/pos_spos``;
  ``mlflow ui --backend-store-uri sqlite:///<out>/mlflow.db``); MLflow refuses ``@`` in a name, so
  ``eval/pass@K`` is logged as ``eval/pass_at_K`` (:func:`mlflow_key`);
- trackio: trackio's own folder (``TRACKIO_DIR``, default the Hugging Face cache), or a Space (``TRACKIO_SPACE_ID``).

This module imports no tracker package (and not torch) at load, so that ``preflight`` can check a config cheaply.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from entropy_rft.common.errors import UserError
from entropy_rft.common.options import TRACKERS, trackers_requested, trackers_selected

# The module each backend imports, and what to pip install for it.
_MODULES: dict[str, tuple[str, ...]] = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow",),
                                         "trackio": ("trackio",)}
_PIP = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny", "trackio": "trackio"}
# MLflow's SQLite store in the run directory (no MLFLOW_TRACKING_URI) needs these too.
_MLFLOW_LOCAL = (("sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic")
STATE = "trackers.json"  # each backend's run id, so that a resume continues the same tracker run


class Tracker(Protocol):
    """One backend: scalars at a step, then ``finish``; ``ids`` is what a resume needs to continue the run."""

    name: str

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def finish(self) -> None: ...

    def ids(self) -> dict[str, Any]: ...


# ----------------------------------------------------------------------------- which trackers


def check(train: Any) -> None:
    """Refuse an unknown tracker name or a tracker whose package is missing, in one line naming the field and
    the fix (``preflight``; imports nothing)."""
    unknown = [n for n in trackers_requested(train) if n not in TRACKERS]
    if unknown:
        raise UserError(f"config field 'train.report_to' has unknown tracker(s) {', '.join(map(repr, unknown))}; "
                        f"valid: {', '.join(TRACKERS)} (or none), e.g. --set 'train.report_to=[tensorboard, wandb]'")
    for name in trackers_selected(train):
        modules, pip = _MODULES[name], _PIP[name]
        if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI"):
            modules, pip = modules + _MLFLOW_LOCAL[0], _MLFLOW_LOCAL[1]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            legacy = name == "wandb" and name not in trackers_requested(train)
            field, undo = (("train.wandb", "--set train.wandb=false") if legacy else
                           ("train.report_to", f"remove {name} from train.report_to"))
            raise UserError(f"config field '{field}' asks for {name} but {', '.join(missing)} is not installed; "
                            f"pip install {pip}, or {undo}")


def run_name(cfg: Any, out: Path) -> str:
    """The tracker run's display name: ``train.run_name``, else the run directory's name."""
    return getattr(cfg.train, "run_name", "") or Path(out).resolve().name


# ----------------------------------------------------------------------------- the backends


class TensorBoard:
    """``<out>/tb`` through torch's ``SummaryWriter``; a resume purges the events from ``purge_step`` on."""

    name = "tensorboard"

    def __init__(self, out: Path, cfg: Any, saved: dict[str, Any], purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tb"), purge_step=purge_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()

    def ids(self) -> dict[str, Any]:
        return {}


class WandB:
    """A W&B run in ``<out>/wandb`` with ``train.project`` and the run name; its id is kept for the resume."""

    name = "wandb"

    def __init__(self, out: Path, cfg: Any, saved: dict[str, Any], purge_step: int | None) -> None:
        import wandb

        from entropy_rft.config.schema import config_to_dict

        self.run = wandb.init(dir=str(out), project=saved.get("project") or cfg.train.project,
                              name=saved.get("name") or run_name(cfg, out), id=saved.get("id"), resume="allow",
                              config=config_to_dict(cfg))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        self.run.finish()

    def ids(self) -> dict[str, Any]:
        return {"id": self.run.id, "project": self.run.project, "name": self.run.name}


class MLflow:
    """An MLflow run in experiment ``train.project``: ``MLFLOW_TRACKING_URI`` when set, else a SQLite store in
    ``<out>/mlflow.db`` (artifacts: ``<out>/mlartifacts``). A resume reopens the stored run id in the stored store."""

    name = "mlflow"

    def __init__(self, out: Path, cfg: Any, saved: dict[str, Any], purge_step: int | None) -> None:
        local = f"sqlite:///{(out / 'mlflow.db').resolve()}"
        uri = saved.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or local
        from mlflow.tracking import MlflowClient

        self.client, self.uri = MlflowClient(tracking_uri=uri), uri
        if saved.get("run_id"):
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            project = cfg.train.project
            exp = self.client.get_experiment_by_name(project)
            where = (out / "mlartifacts").resolve().as_uri() if uri == local else None  # not the cwd's
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project, where)
            self.run_id = self.client.create_run(exp_id, run_name=run_name(cfg, out)).info.run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000], synchronous=True)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)

    def ids(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}


def mlflow_key(key: str) -> str:
    """An erft metric name as MLflow accepts it: MLflow allows only letters, digits and ``_-. :/``, so ``@`` (in
    ``eval/pass@K``) becomes ``_at_`` (``eval/pass_at_K``) and any other character ``_``; every other key is kept."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")


class Trackio:
    """A trackio run in project ``train.project``; a resume continues the run of the same name (trackio resumes
    by name)."""

    name = "trackio"

    def __init__(self, out: Path, cfg: Any, saved: dict[str, Any], purge_step: int | None) -> None:
        import trackio

        from entropy_rft.config.schema import config_to_dict

        self.project = saved.get("project") or cfg.train.project
        self.run = trackio.init(project=self.project, name=saved.get("name") or run_name(cfg, out),
                                resume="allow", config=config_to_dict(cfg))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        self.run.finish()

    def ids(self) -> dict[str, Any]:
        return {"project": self.project, "name": self.run.name, "id": getattr(self.run, "id", None)}


BACKENDS: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow,
                                               "trackio": Trackio}


# ----------------------------------------------------------------------------- all of a run's trackers


def read_ids(out: Path) -> dict[str, dict[str, Any]]:
    """``<out>/trackers.json``: each backend's stored run ids (empty when missing or unreadable)."""
    try:
        data = json.loads((Path(out) / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


class Trackers:
    """The trackers of a run (``options.trackers_selected``), started with the ids a previous start stored. A
    tracker that fails warns once and is dropped: metrics.jsonl goes on."""

    def __init__(self, out: Path, cfg: Any, purge_step: int | None) -> None:
        from entropy_rft.rundir import files as rundir

        self.out, self.active = Path(out), []
        saved = read_ids(self.out)
        for name in trackers_selected(cfg.train):
            try:
                self.active.append(BACKENDS[name](self.out, cfg, dict(saved.get(name) or {}), purge_step))
            except Exception as e:  # noqa: BLE001 - a tracker is a view of metrics.jsonl, never its keeper
                rundir.warn(f"tracker {name} did not start ({type(e).__name__}: {e}); metrics.jsonl goes on")
        ids = {t.name: t.ids() for t in self.active if t.ids()}
        if ids:
            rundir.atomic_write_json(self.out / STATE, {**saved, **ids})

    def log(self, scalars: dict[str, float], step: int) -> None:
        for t in list(self.active):
            try:
                t.log(scalars, step)
            except Exception as e:  # noqa: BLE001 - see the class docstring
                self._drop(t, e, "logging stopped")

    def finish(self, quiet: bool = False) -> None:
        """Finish every tracker; ``quiet``: the run is already failing, so a tracker error is not raised."""
        errors = []
        for t in self.active:
            try:
                t.finish()
            except Exception as e:  # noqa: BLE001 - finish every tracker before raising
                errors.append(e)
        self.active = []
        if errors and not quiet:
            raise errors[0]

    def _drop(self, t: Tracker, e: Exception, what: str) -> None:
        from entropy_rft.rundir.files import warn

        warn(f"{t.name} {what} ({type(e).__name__}: {e}); metrics.jsonl goes on")
        self.active.remove(t)
