"""The option lists the library accepts, in one torch-free place.

``loss``, ``rollout`` and ``config`` all take their choices from here, so that validating a config (which must
not import torch) and the code that acts on it cannot disagree.
"""

from __future__ import annotations

from typing import Any

# Loss aggregation modes (``loss.aggregate``, ``loss.agg_weights``), as in verl's ``agg_loss``.
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Estimators of the KL to the reference policy (``loss.kl_estimate``; Schulman 2020).
KL_ESTIMATORS = ("k1", "k2", "k3")
# Sampling backends (``rollout.sample``).
ROLLOUT_BACKENDS = ("auto", "static", "kv", "hf")
# MKL's branch for a CPU process's matrix multiplies (``model.cpu_gemm``; ``common.numerics.choose_mkl_branch``).
CPU_GEMM_MODES = ("auto", "exact", "fast")
# Training engines (``launch``): our single-process trainer, or TRL's GRPOTrainer.
ENGINES = ("native", "trl")
# Trackers of ``train.report_to`` (TRL's names; ``rundir.trackers`` drives them).
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


def or_list(names: tuple[str, ...]) -> str:
    """``a, b or c``: the choices for a help text or an error message."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def trackers_requested(train: Any) -> list[str]:
    """``train.report_to`` as a list (a single name is a list of one; ``none`` or empty: none)."""
    want = getattr(train, "report_to", ["tensorboard"])
    want = [want] if isinstance(want, str) else list(want or [])
    return [] if want == ["none"] else [str(w) for w in want]


def trackers_selected(train: Any) -> list[str]:
    """The trackers a run logs to: ``train.report_to``, without tensorboard when ``train.tensorboard`` is false,
    with wandb when ``train.wandb`` is true (each name once, in order)."""
    names = trackers_requested(train)
    if getattr(train, "tensorboard", True) is False:
        names = [n for n in names if n != "tensorboard"]
    if getattr(train, "wandb", False) and "wandb" not in names:
        names.append("wandb")
    return list(dict.fromkeys(names))
