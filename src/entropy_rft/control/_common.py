"""Shared input checks and masked statistics for the control and loss modules (private)."""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_SIGNS = ("any", "negative", "positive")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_mask(mask: Tensor, name: str = "mask") -> None:
    """Require a bool tensor (the response mask, or a keep/zeroed/exclude mask)."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")


def check_like(x: Tensor, mask: Tensor, name: str) -> None:
    """Require ``x`` to have exactly the shape of ``mask``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.shape != mask.shape:
        raise ValueError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(x.shape)}")


def check_bool_like(x: Tensor | None, mask: Tensor, name: str) -> None:
    """Optional bool tensor shaped like ``mask``."""
    if x is None:
        return
    check_mask(x, name)
    check_like(x, mask, name)


def broadcast_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Expand advantages to ``mask.shape``: per-token (``mask.shape``), per-sequence (``mask.shape[:-1]``,
    e.g. ``[B]``, or ``mask.shape[:-1] + (1,)``, e.g. ``[B, 1]``), or a 0-d scalar. Other shapes, which
    would broadcast by accident (a ``[T]`` vector across rows), are rejected.
    """
    if not isinstance(advantages, Tensor):
        raise ValueError(f"advantages must be a tensor, got {type(advantages).__name__}")
    shape = tuple(advantages.shape)
    seq = tuple(mask.shape[:-1])
    if shape == tuple(mask.shape) or shape == ():
        return advantages.expand(mask.shape)
    if mask.dim() >= 1 and shape in (seq, seq + (1,)):
        return advantages.reshape(seq + (1,)).expand(mask.shape)
    raise ValueError(
        f"advantages must be shaped like mask {tuple(mask.shape)}, per sequence {seq} or {seq + (1,)}, "
        f"or a scalar; got {shape}"
    )


def is_number(value: object) -> bool:
    """A real int or float (bools excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_mu(value: float | None, name: str) -> None:
    """A clipping multiplier: None (side unbounded) or a finite number >= 0."""
    if value is None:
        return
    if not is_number(value) or not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be None or a finite number >= 0, got {value!r}")


def check_fraction(value: float, name: str) -> None:
    """A number in [0, 1]."""
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def check_sign(value: str, name: str = "advantage_sign", allowed: tuple[str, ...] = ADVANTAGE_SIGNS) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def droppable(adv: Tensor, advantage_sign: str) -> Tensor:
    """Tokens a sign-restricted rule may drop: every token, A < 0 only, or A > 0 only (strict)."""
    if advantage_sign == "any":
        return torch.ones_like(adv, dtype=torch.bool)
    if advantage_sign == "negative":
        return adv < 0
    return adv > 0


def masked_mean_std(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """Population mean and std (divide by n) of ``x`` over ``mask``, in float64, and n.

    With n == 0 the mean and std are 0 (no token is valid, so no rule can fire).
    """
    n = int(mask.sum())
    xd = x.detach().to(torch.float64)
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return zero, zero, 0
    vals = xd[mask]
    mean = vals.sum() / n
    std = torch.sqrt(((vals - mean) ** 2).sum() / n)
    return mean, std, n


def token_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """cov_t = (logp_t − mean logp)·(A_t − mean A) over valid tokens (Cui et al. 2025, Sec. 4), float64.

    ``logp`` is detached; padding gets 0 (callers also exclude it explicitly).
    """
    adv = broadcast_advantages(advantages, mask)
    lp_mean, _, n = masked_mean_std(logp, mask)
    a_mean, _, _ = masked_mean_std(adv, mask)
    if n == 0:
        return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    cov = (logp.detach().to(torch.float64) - lp_mean) * (adv.detach().to(torch.float64) - a_mean)
    return torch.where(mask, cov, torch.zeros_like(cov))


def count_for_ratio(ratio: float, n: int) -> int:
    """max(int(ratio·N), 1), the number of tokens Clip-Cov and KL-Cov touch; 0 when ratio == 0 or N == 0."""
    if ratio == 0 or n == 0:
        return 0
    return min(max(int(ratio * n), 1), n)


def check_agg(agg: str, mask: Tensor) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {list(AGG_MODES)}, got {agg!r}")
    if agg != "token-mean" and mask.dim() < 2:
        raise ValueError(f"agg={agg!r} needs a mask shaped [B, T], got {tuple(mask.shape)}")


def agg_weights(m: Tensor, agg: str = "token-mean", dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-token weights w with ``aggregate(ℓ, m, agg) == Σ w·ℓ`` (zeros when nothing counts).

    - ``token-mean``: w = 1/Σm;
    - ``seq-mean-token-mean``: w = 1/(n_seq · Σ_t m_b), n_seq = sequences with Σ_t m > 0;
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): w = 1/(n_seq · T), T = ``m.shape[-1]``.
    """
    check_mask(m, "m")
    check_agg(agg, m)
    mf = m.to(dtype)
    if agg == "token-mean":
        return mf / mf.sum().clamp(min=1.0)
    per_seq = mf.sum(-1, keepdim=True)
    n_seq = (per_seq > 0).sum().clamp(min=1).to(dtype)
    if agg == "seq-mean-token-mean":
        return mf / per_seq.clamp(min=1.0) / n_seq
    return mf / (n_seq * m.shape[-1])
