"""Per update: the entropy change the theory predicted against the one that happened.

After a step's optimizer updates, the trainer recomputes the entropy of the same batch tokens. The
tabular first-order prediction is Paper A's Theorem 3.3 per token, ``theory.first_order_entropy_change``
(the formula and its derivation are in ``entropy_rft.core.dynamics``), with ``w_t`` the weight the loss gave the
token (0 when a method dropped or zeroed it; the aggregation weight otherwise). The ratio is 1 at the start
of the step (on-policy), so it does not appear. Adam's step is not ``lr * grad``, so only signs and
correlations are comparable, not magnitudes.

Levels reported (see feasibility.md for why one number misleads):

- ``probe/sign_agreement``: per token, sign(pred) == sign(actual);
- ``probe/sign_agreement_weighted``: the same, weighted by |pred|;
- ``probe/corr``: per-token Pearson correlation of pred and actual;
- ``probe/dH_actual``, ``probe/dH_pred``: batch means; ``probe/batch_sign_agree``: 1.0 when their signs agree.

Two deeper levels, every ``probe.jvp_every`` / ``probe.counterfactual_every`` steps:

- the network's exact first-order prediction (``entropy_rft.policy.jvp``): the forward-mode JVP of each token's
  entropy along the step's actual parameter update, ``probe/jvp_corr``, ``probe/jvp_sign_agreement``,
  ``probe/jvp_sign_agreement_weighted``, ``probe/jvp_rel_err`` (‖jvp − actual‖ / ‖actual‖ over tokens) and
  ``probe/dH_jvp`` (batch mean). What remains between it and the actual change is second order in the step;
- the counterfactual: the batch-mean entropy change after the method's update (``probe/dH_method``) and after
  the vanilla update from the very same state (``probe/dH_vanilla``); ``probe/dH_method_effect`` is their
  difference, the method's own effect on entropy at this step.
"""

from __future__ import annotations

from torch import Tensor

from entropy_rft.core.correlation import agreement
from entropy_rft.core.theory import first_order_entropy_change


def tabular_prediction(s_centered: Tensor, advantages: Tensor, weights: Tensor) -> Tensor:
    """First-order ΔH per token, up to the learning-rate scale: -w·A·S_c in float64 (Theorem 3.3, r = 1;
    ``theory.first_order_entropy_change``)."""
    return first_order_entropy_change(s_centered.double(), advantages, weights=weights).per_token


def probe_metrics(pred: Tensor, actual: Tensor, mask: Tensor) -> dict[str, float | None]:
    """Agreement between the tabular prediction and the actual per-token ΔH over valid tokens, plus the
    batch means and whether their signs agree. (No relative error: the prediction has no lr scale.)"""
    valid = mask.bool()
    p, a = pred[valid].double(), actual[valid].double()
    mp, ma = (float(p.mean()), float(a.mean())) if p.numel() else (None, None)
    batch_agree = None
    if mp is not None and ma is not None and mp != 0 and ma != 0:
        batch_agree = float((mp > 0) == (ma > 0))
    out = agreement_metrics(pred, actual, mask, "probe/")
    del out["probe/rel_err"]
    return {"probe/dH_actual": ma, "probe/dH_pred": mp, **out, "probe/batch_sign_agree": batch_agree}


def agreement_metrics(pred: Tensor, actual: Tensor, mask: Tensor, prefix: str) -> dict[str, float | None]:
    """``{prefix}corr``, ``{prefix}sign_agreement`` (raw and |pred|-weighted) and ``{prefix}rel_err`` of a
    per-token prediction of ΔH against the actual ΔH: corr and signs over the valid tokens where both are finite
    and non-zero (``core.correlation.agreement``), rel_err = ‖pred − actual‖ / ‖actual‖ over all valid tokens."""
    valid = mask.bool()
    p, a = pred[valid].double(), actual[valid].double()
    ag = agreement(p, a)
    norm_a = float(a.norm())
    return {
        f"{prefix}corr": ag.corr,
        f"{prefix}sign_agreement": ag.sign,
        f"{prefix}sign_agreement_weighted": ag.sign_weighted,
        f"{prefix}rel_err": float((p - a).norm()) / norm_a if norm_a > 0 else None,
    }


def counterfactual_metrics(dh_method: float | None, dh_vanilla: float | None) -> dict[str, float | None]:
    """The method's own effect on the batch entropy at this step: its update's ΔH minus vanilla's."""
    effect = None if dh_method is None or dh_vanilla is None else dh_method - dh_vanilla
    return {"probe/dH_method": dh_method, "probe/dH_vanilla": dh_vanilla, "probe/dH_method_effect": effect}


def due(every: int, step: int) -> bool:
    """Whether a probe that runs every ``every`` steps (0: never) runs at ``step``."""
    return every > 0 and step % every == 0
