"""How well a prediction of a change matches the measured change: Pearson r and sign agreement, one definition.

Every caller compares a predicted ΔH with a measured one: the trainer's probes per token (``probe/corr``,
``probe/sign_agreement``, the JVP probe's ``probe/jvp_*``), ``erft probe`` per position, the report's
scatter of token records and the steps of a run (``dH_agree/*``). They all count the same pairs and compute
in float64:

- **the pairs that count**: both values finite and non-zero. A zero has no sign, and a prediction of exactly
  zero is a token or step the formula says nothing about (a token a method dropped, a step whose advantages
  are all zero); a non-finite value is no measurement. Pearson r and the sign agreement are taken over the
  same pairs, so the two numbers describe the same tokens or steps;
- **Pearson r** = Σ(x−x̄)(y−ȳ) / (‖x−x̄‖·‖y−ȳ‖), None with fewer than 3 pairs (two points always lie on a
  line, r = ±1 says nothing) or when either side is constant;
- **sign agreement**: the share of pairs with sign(pred) = sign(actual); weighted: the same, each pair
  weighted by |pred| (the confident predictions count more).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch
from torch import Tensor

MIN_PAIRS = 3  # Pearson r of fewer pairs is None

Values: TypeAlias = Tensor | np.ndarray | Sequence[float]


def _as_float64(x: Values) -> Tensor:
    if isinstance(x, Tensor):
        return x.detach().double().reshape(-1)
    return torch.as_tensor(np.asarray(x, dtype=np.float64)).reshape(-1)


def paired(pred: Values, actual: Values) -> tuple[Tensor, Tensor]:
    """The pairs that count, as two float64 tensors of equal length: both values finite and non-zero."""
    p, a = _as_float64(pred), _as_float64(actual)
    if p.shape != a.shape:
        raise ValueError(f"pred and actual must have the same number of values, got {p.numel()} and {a.numel()}")
    keep = torch.isfinite(p) & torch.isfinite(a) & (p != 0) & (a != 0)
    return p[keep], a[keep]


def pearson(x: Tensor, y: Tensor) -> float | None:
    """Pearson r of two float64 tensors of paired values (from :func:`paired`); None with fewer than
    ``MIN_PAIRS`` pairs or when either side is constant."""
    if x.numel() < MIN_PAIRS:
        return None
    x, y = x - x.mean(), y - y.mean()
    den = float(x.norm() * y.norm())
    if den == 0.0:
        return None
    return float((x * y).sum()) / den


@dataclass(frozen=True)
class Agreement:
    """A prediction against the measurement, over the pairs that count (``n`` of them)."""

    n: int
    corr: float | None  # Pearson r (None: fewer than 3 pairs, or a constant side)
    sign: float | None  # share of pairs whose signs agree (None: no pair)
    sign_weighted: float | None  # the same, weighted by |pred| (None: no pair)


def agreement(pred: Values, actual: Values) -> Agreement:
    """Pearson r and sign agreement (plain and |pred|-weighted) of ``pred`` against ``actual``, over the pairs
    where both are finite and non-zero, in float64."""
    p, a = paired(pred, actual)
    n = p.numel()
    agree = torch.sign(p) == torch.sign(a)
    wsum = float(p.abs().sum())
    return Agreement(
        n=n,
        corr=pearson(p, a),
        sign=float(agree.sum()) / n if n else None,
        sign_weighted=float(p[agree].abs().sum()) / wsum if wsum > 0 else None,
    )
