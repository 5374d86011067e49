"""The option lists the library accepts, in one torch-free place.

``loss``, ``rollout`` and ``config`` all take their choices from here, so that validating a config (which must
not import torch) and the code that acts on it cannot disagree.
"""

from __future__ import annotations

# Loss aggregation modes (``loss.aggregate``, ``loss.agg_weights``), as in verl's ``agg_loss``.
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Estimators of the KL to the reference policy (``loss.kl_estimate``; Schulman 2020).
KL_ESTIMATORS = ("k1", "k2", "k3")
# Sampling backends (``rollout.sample``).
ROLLOUT_BACKENDS = ("auto", "static", "kv", "hf")
# Training engines (``launch``): our single-process trainer, or TRL's GRPOTrainer.
ENGINES = ("native", "trl")


def or_list(names: tuple[str, ...]) -> str:
    """``a, b or c``: the choices for a help text or an error message."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
