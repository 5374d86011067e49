"""The papers' batch-level entropy predictions against the measured entropy change, over the steps of a run.

Each training step logs three first-order predictions of the batch entropy change (no learning-rate factor,
so only sign and correlation can be compared) and the measured change:

- Paper B (Cui et al. 2025, §3): dH ≈ −η·Cov(log π, A), the batch covariance of the sampled tokens' log-prob
  and advantage (``dynamics/cov_logp_adv``). Paper B says the prediction and the measured change "matched", and
  that the covariance is "mostly positive" over training, hence entropy's monotone fall.
- The same covariance in the centred-discriminator form, −Cov(A, S_c) (``dynamics/cov_adv_s_centered``;
  Paper A's S_c = S − E_p[S] takes the place of log π).
- Paper A (Wang et al. 2026, Thm 3.3): ΔH ≈ mean over tokens of −A·S_c (``dynamics/pred_dH``).
- Measured: ``probe/dH_actual``, the batch-mean entropy of the same tokens after the step minus before it.

For each prediction: Pearson r over steps and the share of steps whose sign matches the measured change (both over
the steps where the prediction and the measurement are finite and non-zero, ``core.correlation``), and the share
of steps on which the prediction says entropy falls (for the covariances: the covariance is positive).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from entropy_rft.core.correlation import agreement

MEASURED = "probe/dH_actual"

# name -> (metric key, sign that turns the logged value into a predicted ΔH, what it is)
PREDICTIONS: dict[str, tuple[str, float, str]] = {
    "cov": ("dynamics/cov_logp_adv", -1.0, "Paper B: −Cov(log π, A)"),
    "cov_centered": ("dynamics/cov_adv_s_centered", -1.0, "centred-discriminator form: −Cov(A, S_c)"),
    "a_sc": ("dynamics/pred_dH", 1.0, "Paper A: mean −A·S_c (Thm 3.3)"),
}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def run_agreement(rows: Sequence[dict]) -> dict[str, float | int | None]:
    """Per prediction: ``dH_agree/<name>_r``, ``dH_agree/<name>_sign`` and ``dH_agree/<name>_fall``, the share of
    steps on which it predicts a fall (for the covariances, the share of steps with a positive covariance);
    ``dH_agree/steps`` is the number of steps that logged both a prediction and the measured change."""
    out: dict[str, float | int | None] = {}
    n_max = 0
    for name, (key, sign, _) in PREDICTIONS.items():
        pairs = [(sign * r[key], r[MEASURED]) for r in rows
                 if int(r.get("step", 0)) >= 1 and _finite(r.get(key)) and _finite(r.get(MEASURED))]
        pred = [p for p, _ in pairs]
        act = [a for _, a in pairs]
        n_max = max(n_max, len(pairs))
        ag = agreement(pred, act)
        out[f"dH_agree/{name}_r"] = ag.corr
        out[f"dH_agree/{name}_sign"] = ag.sign
        falls = [sign * r[key] < 0 for r in rows if int(r.get("step", 0)) >= 1 and _finite(r.get(key))]
        out[f"dH_agree/{name}_fall"] = sum(falls) / len(falls) if falls else None
    out["dH_agree/steps"] = n_max
    return out
