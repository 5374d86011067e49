"""Shared input checks and masked statistics for the control modules (private). A method's parameters declare
their own ranges on ``param`` (``registry.Method.check_params``); the checks here serve the pure mask functions and
the rules a range cannot say (an entropy level).

The generic tensor checks live in :mod:`entropy_rft.core.tensor_checks` and the aggregation weights in
:mod:`entropy_rft.core.loss`; they are imported here too, for the control modules and ``advantages``."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from entropy_rft.core.loss import agg_weights  # noqa: F401  (re-exported for control.lens)
from entropy_rft.core.tensor_checks import (  # noqa: F401  (re-exported for the control modules)
    as_mask,
    broadcast_advantages,
    check_bool_like,
    check_like,
    check_mask,
    is_number,
)

ADVANTAGE_SIGNS = ("any", "negative", "positive")


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


# ``check_level``'s rule in words, for a level parameter's ``param(rule=...)`` (``erft methods``)
LEVEL_RULE = "None, nats > 0 or a multiple of the first batch's entropy such as '0.9x'"
LEVEL_RULE_REQUIRED = "nats > 0 or a multiple of the first batch's entropy such as '0.5x'"


@overload
def check_level(value: float | str | None, name: str, allow_none: Literal[False]) -> tuple[float, bool]: ...


@overload
def check_level(value: float | str | None, name: str, allow_none: bool = True) -> tuple[float, bool] | None: ...


def check_level(value: float | str | None, name: str, allow_none: bool = True) -> tuple[float, bool] | None:
    """An entropy level of a method's own controller: nats (a number > 0), or ``"0.9x"`` (0.9 times the entropy
    of the first batch the controller sees), or None when ``allow_none``. Returns (value, relative)."""
    if value is None and allow_none:
        return None
    rel, raw = False, value
    if isinstance(value, str) and value.strip().lower().endswith("x"):
        rel, raw = True, value.strip()[:-1]
        try:
            raw = float(raw)
        except ValueError:
            raw = None
    if not is_number(raw) or not 0 < raw < float("inf"):
        hint = "None, " if allow_none else ""
        raise ValueError(f"{name} must be {hint}a number of nats > 0 or a multiple of the first batch's entropy "
                         f"such as '0.9x', got {value!r}")
    return float(raw), rel


@overload
def resolve_level(level: tuple[float, bool], base: float | None) -> float: ...


@overload
def resolve_level(level: tuple[float, bool] | None, base: float | None) -> float | None: ...


def resolve_level(level: tuple[float, bool] | None, base: float | None) -> float | None:
    """A checked ``check_level`` value in nats (relative levels times ``base``, the first measured entropy)."""
    if level is None:
        return None
    value, relative = level
    if not relative:
        return value
    assert base is not None, "a relative level needs its base"  # callers set it from the first batch first
    return value * base
