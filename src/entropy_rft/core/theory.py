"""Entropy dynamics of softmax policies, as code (Paper A, Wang et al. 2026; Paper B, Cui et al. 2025).

This docstring is the one place where the formulas stand, by the paper's result numbers (Paper A numbers its
results, not its equations; docs/theory.md explains them in words). Every other module cites them from here.

For one position: logits z over the vocabulary, p = softmax(z / T), entropy H = -sum_i p_i log p_i, and the
sampled token k. Everything here is a pure tensor function that knows nothing about models or training; this
module holds the theorems' predictions, the covariances and the exact float64 checker, ``dynamics`` the
statistics.

- Entropy discriminator (Lemma 3.1, Thm 3.2):       S_i = p_i (H + log p_i)
- Its on-policy expectation (Thm 3.3):              E_{i~p}[S_i] = H sum_i p_i^2 + sum_i p_i^2 log p_i
- Centered discriminator (Thm 3.3):                 S_c = S_k - E_p[S]
- Single-logit update z -> z + eps e_k (Thm 3.2):   dH = -eps S_k + O(eps^2)
- GRPO logit step z -> z + alpha (e_k - p) (3.3):   dH = -alpha S_c + O(alpha^2), alpha = lr r A
- Off-policy (importance ratio r):                  factor r S_c
- Thm 3.3 per token of a batch step:                dH_t = -w_t A_t r_t S_c,t (lr dropped), w_t the loss's
                                                    aggregation weight (0 for a token without gradient)
- Thm 3.3 batch form:                               sum_t dH_t (weighted); unweighted, the mean over
                                                    valid tokens of -A_t S_c,t
- Corollary 3.4:                                    E_{k~p}[S_c] = 0 exactly
- Corollary 3.5:                                    batch mean of S_c ~ 0 on-policy

Where they are computed: S, E_p[S], S_c in ``dynamics.token_stats`` (``TokenStats``); Thm 3.2 in
``single_logit_entropy_change``; Thm 3.3, per token and per batch, in ``first_order_entropy_change``, the
single implementation of its prediction: ``predicted_entropy_change``, ``batch_predicted_entropy_change``,
``probe.tabular_prediction``, ``control.lens_attribution`` and ``metrics.stats_metrics`` all call it;
the exact float64 check of both theorems in ``exact_entropy_change``.

All statistics are float32 whatever the input dtype, with the temperature applied as sampling applies it
(``z / T``). Statistics that need the whole vocabulary are computed in one pass over chunks of rows; the
full ``[tokens, V]`` float32 softmax is never materialised. ``entropy_rft.core.fused.fused_logp`` goes one step
further and never materialises the logits at all: it works from the hidden states and the LM-head weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from entropy_rft.core.dynamics import TokenStats, check_logits_ids, check_temperature

__all__ = [
    "FirstOrderChange",
    "batch_predicted_entropy_change",
    "cov_advantage_s_centered",
    "cov_logp_advantage",
    "exact_entropy_change",
    "first_order_entropy_change",
    "masked_cov",
    "off_policy_factor",
    "predicted_entropy_change",
    "single_logit_entropy_change",
]


# ------------------------------------------------------------------------------------- first-order theory


@dataclass(frozen=True)
class FirstOrderChange:
    """What ``first_order_entropy_change`` returns (Thm 3.3, up to the learning-rate factor).

    per_token: dH_t = -(w_t A_t r_t) S_c,t, the inputs' broadcast shape and promoted dtype; 0 off ``mask`` and
               on ``clipped`` tokens (no gradient, no first-order change) when those are given.
    mask:      the valid tokens (None: all), already checked against ``S_c``'s shape.
    weighted:  whether aggregation weights were given (this picks the batch form).
    """

    per_token: Tensor
    mask: Tensor | None
    weighted: bool

    @property
    def batch(self) -> float | None:
        """The batch's first-order dH in float64: sum_t dH_t when weighted (the weights carry the loss's
        normalisation), else the mean of dH_t over the valid tokens. None when no token is valid (a metric
        written as JSON null, never NaN)."""
        valid = torch.ones_like(self.per_token, dtype=torch.bool) if self.mask is None else self.mask
        n = int(valid.sum())
        if n == 0:
            return None
        dh = torch.broadcast_to(self.per_token.to(torch.float64), valid.shape)
        if self.weighted:
            return float(dh.sum())
        return float(dh[valid].sum() / n)


def first_order_entropy_change(
    s_centered: Tensor,
    advantages: Tensor | float,
    *,
    weights: Tensor | float | None = None,
    ratio: Tensor | float | None = None,
    mask: Tensor | None = None,
    clipped: Tensor | None = None,
) -> FirstOrderChange:
    """First-order entropy change of one policy-gradient step, per token and per batch (Paper A, Thm 3.3).

    The surrogate r A log p_k moves token t's logits by alpha_t (e_k - p) with alpha_t = lr w_t r_t A_t, so
    dH_t = -alpha_t S_c,t + O(alpha^2), S_c = S_k - E_p[S] (see the module docstring). The lr factor is left
    out: fold it into ``advantages`` (or pass a whole step size alpha there) to get absolute units.

    s_centered: S_c per token (``TokenStats.s_centered``).
    advantages: A_t (or alpha_t), broadcastable to ``s_centered``.
    weights:    the loss aggregation weights w_t (``loss.agg_weights``); None: unweighted, and the batch form
                is the mean over valid tokens.
    ratio:      the importance ratio r_t (the off-policy factor); None: on-policy, r = 1.
    mask:       valid tokens, shaped like ``s_centered``; None: all. Invalid tokens carry 0 in ``per_token``.
    clipped:    tokens whose gradient is clipped away (e.g. ``loss.ppo_clipped_mask``); they carry 0.

    The arithmetic is dH_t = -(((w_t A_t) r_t) S_c,t) in the inputs' promoted dtype, with no cast: a caller
    that wants float64 passes float64 (or casts ``s_centered``), so each caller keeps its precision.
    """
    alpha = advantages if weights is None else weights * advantages
    if ratio is not None:
        alpha = alpha * ratio
    per_token = -(alpha * s_centered)
    valid = None if mask is None else _valid(mask, s_centered)
    keep = valid
    if clipped is not None:
        unclipped = ~_valid(clipped, s_centered)
        keep = unclipped if keep is None else keep & unclipped
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    return FirstOrderChange(per_token=per_token, mask=valid, weighted=weights is not None)


def predicted_entropy_change(stats: TokenStats, alpha: Tensor | float) -> Tensor:
    """First-order entropy change of a GRPO logit step z -> z + alpha (e_k - p): -alpha S_c (Thm 3.3).

    alpha = lr * r * A per token (broadcast against the stats' shape). ``first_order_entropy_change``.
    """
    return first_order_entropy_change(stats.s_centered, alpha).per_token


def single_logit_entropy_change(stats: TokenStats, eps: Tensor | float) -> Tensor:
    """First-order entropy change of a single-logit update z -> z + eps e_k: -eps S_k (Thm 3.2)."""
    return -eps * stats.s_star


def off_policy_factor(stats: TokenStats, ratio: Tensor | float) -> Tensor:
    """Off-policy discriminator r S_c (Paper A, off-policy form of Thm 3.3; r the importance ratio)."""
    return ratio * stats.s_centered


def _valid(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if tuple(mask.shape) != tuple(like.shape):
        raise ValueError(f"mask must have shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    return mask.to(torch.bool)


def batch_predicted_entropy_change(
    stats: TokenStats, alpha: Tensor | float, mask: Tensor | None = None
) -> float | None:
    """Batch-level first-order change: mean over valid tokens of -alpha_t S_c,t (Thm 3.3, averaged).

    Returns a Python float, or None when there is no valid token (a metric written as JSON null, never NaN).
    ``first_order_entropy_change(...).batch``.
    """
    return first_order_entropy_change(stats.s_centered, alpha, mask=mask).batch


def masked_cov(x: Tensor, y: Tensor, mask: Tensor | None = None) -> float | None:
    """Population covariance (divide by n) of x and y over valid tokens, in float64; None if none valid."""
    if tuple(x.shape) != tuple(y.shape):
        raise ValueError(f"y must have the shape of x, {tuple(x.shape)}, got {tuple(y.shape)}")
    valid = _valid(mask, x)
    n = int(valid.sum())
    if n == 0:
        return None
    xv = x.detach()[valid].to(torch.float64)
    yv = y.detach()[valid].to(torch.float64)
    return float(((xv - xv.mean()) * (yv - yv.mean())).mean())


def cov_logp_advantage(logp: Tensor, advantages: Tensor, mask: Tensor | None = None) -> float | None:
    """Cov(log pi, A) over valid tokens (Paper B: dH ~ -eta Cov(log pi, A) under natural PG)."""
    return masked_cov(logp, advantages, mask)


def cov_advantage_s_centered(advantages: Tensor, s_centered: Tensor, mask: Tensor | None = None) -> float | None:
    """Cov(A, S_c) over valid tokens: with alpha_t = lr A_t, the batch change -lr mean(A S_c) (Thm 3.3) is
    -lr (Cov(A, S_c) + mean(A) mean(S_c)), and mean(S_c) ~ 0 on-policy (Cor. 3.5)."""
    return masked_cov(advantages, s_centered, mask)


# ------------------------------------------------------------------------------------------ exact checker


def _entropy64(z: Tensor) -> tuple[Tensor, Tensor]:
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    return -plogp.sum(-1), p


def exact_entropy_change(
    logits: Tensor,
    k: Tensor | int,
    eps: Tensor | float,
    kind: Literal["single", "grpo"] = "single",
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Apply a logit update to the explicit distribution in float64; return (actual dH, predicted dH).

    With z = logits / temperature and p = softmax(z):
      kind="single": z -> z + eps e_k,        predicted -eps S_k          (Thm 3.2)
      kind="grpo":   z -> z + eps (e_k - p),  predicted -eps (S_k - E_p[S]) (Thm 3.3; eps plays alpha)
    logits [..., V]; k int or [...]; eps float or [...]. Both outputs are float64 with shape [...].
    The actual change minus the prediction is O(eps^2).
    """
    if kind not in ("single", "grpo"):
        raise ValueError(f"kind must be 'single' or 'grpo', got {kind!r}")
    t = check_temperature(temperature)
    k_t = torch.as_tensor(k, device=logits.device)
    if k_t.dim() == 0:
        k_t = k_t.expand(logits.shape[:-1])
    check_logits_ids(logits, k_t)
    z = logits.to(torch.float64) / t
    eps_t = torch.as_tensor(eps, dtype=torch.float64, device=z.device)
    h0, p = _entropy64(z)
    onehot = torch.zeros_like(z).scatter_(-1, k_t.long().unsqueeze(-1), 1.0)
    logp = torch.log_softmax(z, dim=-1)
    s_all = torch.where(p > 0, p * (h0.unsqueeze(-1) + logp), torch.zeros_like(p))
    s_k = (s_all * onehot).sum(-1)
    step = onehot if kind == "single" else onehot - p
    z1 = torch.where(torch.isfinite(z), z + eps_t.unsqueeze(-1) * step, z)
    h1, _ = _entropy64(z1)
    pred = -eps_t * s_k if kind == "single" else -eps_t * (s_k - (p * s_all).sum(-1))
    return h1 - h0, pred
