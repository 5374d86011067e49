"""Batch metrics shared by every engine (native trainer, TRL): one name per figure, null when undefined."""

from __future__ import annotations

import torch
from torch import Tensor

from entropy_rft.core import theory
from entropy_rft.core.dynamics import TokenStats


def masked_mean(x: Tensor, mask: Tensor) -> float | None:
    """Mean of ``x`` over ``mask``; None when the mask is empty (JSON null, never NaN)."""
    n = int(mask.sum())
    if n == 0:
        return None
    return float((x.double() * mask).sum() / n)


def masked_std(x: Tensor, mask: Tensor) -> float | None:
    """Population std of ``x`` over ``mask``; None when the mask is empty."""
    m = masked_mean(x, mask)
    if m is None:
        return None
    return float((((x.double() - m) ** 2) * mask).sum() / mask.sum()) ** 0.5


def approx_kl(logp: Tensor, old_logp: Tensor, mask: Tensor) -> float | None:
    """k3 estimate of KL(π_old‖π) from samples of π_old, over ``mask`` (Schulman 2020): with
    log r = log π − log π_old in float64, the mean of r − 1 − log r (≥ 0 per token)."""
    log_r = (logp - old_logp).double()
    return masked_mean(torch.expm1(log_r) - log_r, mask)


def stats_metrics(st: TokenStats, adv: Tensor, mask: Tensor) -> dict[str, float | None]:
    """Entropy, the discriminators S and S_c (Corollary 3.5: mean S_c ~ 0), the covariances of a batch and
    Thm 3.3's first-order batch ΔH, the mean of -A·S_c (formulas: ``entropy_rft.core.dynamics``).

    ``adv`` is per token [B, R]; ``mask`` the valid response tokens.
    """
    return {
        "entropy/mean": masked_mean(st.entropy, mask),
        "dynamics/s_star_mean": masked_mean(st.s_star, mask),
        "dynamics/s_star_std": masked_std(st.s_star, mask),
        "dynamics/s_centered_mean": masked_mean(st.s_centered, mask),
        "dynamics/s_centered_std": masked_std(st.s_centered, mask),
        "dynamics/s_expected_mean": masked_mean(st.s_expected, mask),
        "dynamics/cov_logp_adv": theory.cov_logp_advantage(st.logp, adv, mask),
        "dynamics/cov_adv_s_centered": theory.cov_advantage_s_centered(adv, st.s_centered, mask),
        "dynamics/pred_dH": theory.first_order_entropy_change(st.s_centered, adv, mask=mask).batch,
    }
