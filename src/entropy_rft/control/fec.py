"""Flexible Entropy Control (Chen et al. 2026, arXiv 2602.09782): PPO's clip bounds made functions of
the token's probability, moved over training by a schedule. The rule, its source and how far it was checked are
in ``FlexibleEntropyControl``'s docstring; the maths is in the pure functions ``fec_width``, ``fec_bounds``,
``fec_od_state`` and ``fec_od_thresholds``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import (
    LEVEL_RULE,
    as_mask,
    check_level,
    masked_mean_std,
    resolve_level,
)
from entropy_rft.control.registry import Masks, Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

FEC = ("Chen et al. 2026, Flexible Entropy Control in RLVR with Gradient-Preserving Perspective, arXiv 2602.09782 "
       "(no code released; rule from the authors' blog post of 2026-03-17)")
SCHEDULES = ("id", "did", "od")
# a width's line ε(p) = slope·p + intercept is clamped to [eps_min, eps_max], so either sign is a valid rule
_LINE_RULE = "any finite number (the width is clamped to [eps_min, eps_max])"
LOWER_MODE, RAISE_MODE = 0, 1  # OD's state: lower entropy (ε_std, M(p)) or raise it (H(p), ε_std)


def fec_width(p: Tensor, slope: float, intercept: float, lo: float, hi: float) -> Tensor:
    """A probability-dependent clip width, ε(p) = clamp(slope·p + intercept, lo, hi) (the blog's
    ε(π_θ) = α·π_θ + β, negatively correlated with p: looser for unlikely tokens)."""
    return (slope * p + intercept).clamp(lo, hi)


def fec_bounds(schedule: str, step: int, total: int, eps_std: float, upper: Tensor, lower: Tensor,
               state: int = LOWER_MODE) -> tuple[Tensor, Tensor]:
    """(ε_high, ε_low) per token at ``step`` of ``total``, from the probability-dependent widths ``upper`` = H(p)
    and ``lower`` = M(p) and the standard width ε_std; λ = 1 − 2·step/total (the blog's schedules):

    - ``id`` (increase then decrease): step ≤ T/2: (λ·H + (1−λ)·ε_std, ε_std); after: (ε_std, (1+λ)·M − λ·ε_std).
    - ``did`` (decrease, increase, decrease): step ≤ T/2: (λ·ε_std + (1−λ)·H, ε_std); after: (H, (1+λ)·M − λ·ε_std).
    - ``od`` (oscillatory decay): ``state`` RAISE_MODE: (H, ε_std); LOWER_MODE: (ε_std, M).

    A wider upper bound lets positive-advantage tokens of low probability grow (entropy rises, the blog's E2); a
    wider lower bound lets negative-advantage tokens of low probability shrink (entropy falls, E4)."""
    std = torch.full_like(upper, eps_std)
    if schedule == "od":
        return (upper, std) if state == RAISE_MODE else (std, lower)
    lam = 1.0 - 2.0 * min(step, total) / total
    if 2 * step <= total:
        high = lam * upper + (1 - lam) * std if schedule == "id" else lam * std + (1 - lam) * upper
        return high, std
    return (std if schedule == "id" else upper), (1 + lam) * lower - lam * std


def fec_od_thresholds(step: int, total: int, h_init: float, min_frac: float) -> tuple[float, float]:
    """OD's thresholds: τ_low = H_min = ``min_frac``·H_init and τ_high(t) = H_min + (H_init − H_min)(1 − t/T)."""
    h_min = min_frac * h_init
    return h_min, h_min + (h_init - h_min) * (1.0 - min(step, total) / total)


def fec_od_state(h: float, state: int, tau_low: float, tau_high: float) -> int:
    """OD's switch with hysteresis: raise entropy once H ≤ τ_low, lower it once H > τ_high, else keep ``state``."""
    if h <= tau_low:
        return RAISE_MODE
    if h > tau_high:
        return LOWER_MODE
    return state


@register_method
@dataclass
class FlexibleEntropyControl(Method):
    """Flexible Entropy Control (Chen et al. 2026): the PPO clip with bounds that depend on the token's
    probability p and move over training.

    Token loss: PPO's min-clip with clip(r, 1 − ε_low, 1 + ε_high) per token. The widths come from
    H(p) = clamp(−0.25·p + 0.5, 0.05, 0.6) (upper) and M(p) = clamp(−0.13·p + 0.3, 0.05, 0.6) (lower), p the
    token's probability under the current policy (detached; computed per optimizer minibatch), and a schedule
    (``fec_bounds``): ``id`` increase-then-decrease (the paper's headline), ``did`` decrease-increase-decrease, or
    ``od`` oscillatory decay (raise entropy when it falls to 0.2·H_init, lower it when it rises above a threshold
    that decays from H_init to that floor over training; H_init = the first batch's entropy).

    Sources and what was verified: the schedules' formulas (λ = 1 − 2k/T, the split at T/2, OD's thresholds and
    switch) are from the authors' blog post (2026-03-17); the paper's method section could not be read here. The
    slopes, intercepts and clamps (−0.25/0.5, −0.13/0.3, [0.05, 0.6]) and ε_std = 0.2 are from third-party
    reproductions, **not verified** against the paper; no code is released (github.com/Kwen-Chen/
    Flexible-Entropy-Control holds only a README). OD's first state (lower) is ours.

    ``target`` (not in the paper): OD's switch with both thresholds at one setpoint (nats or '0.5x'), so the rule
    can be compared with the other controllers at equal entropy. Native engine only (per-token clip bounds are
    not in TRL's or verl's loss path here).
    """

    name: ClassVar[str] = "fec"
    paper: ClassVar[str] = FEC
    summary: ClassVar[str] = "clip bounds linear in the token's probability, scheduled over training (ID/DID/OD)"
    stage: ClassVar[str] = "minibatch"
    exchange: ClassVar[str | None] = "tokens"
    masks: ClassVar[tuple[str, ...]] = ("eps_low", "eps_high")
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)  # observe: the batch entropy
    quadrants: ClassVar[dict[str, str]] = {
        "pos_spos": "changes the clip: upper bound H(p) while raising entropy",
        "pos_sneg": "changes the clip: upper bound H(p) while raising entropy",
        "neg_spos": "changes the clip: lower bound M(p) while lowering entropy",
        "neg_sneg": "changes the clip: lower bound M(p) while lowering entropy"}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    schedule: str = param("id", "the schedule: id (increase then decrease, the paper's headline), did (decrease, "
                                "increase, decrease) or od (oscillatory decay)", choices=SCHEDULES)
    eps_std: float = param(0.2, "the standard clip width the schedules move from and to (third-party, unverified)",
                           ge=0)
    upper_slope: float = param(-0.25, "slope of the upper width H(p) in p (third-party, unverified)",
                               rule=_LINE_RULE)
    upper_intercept: float = param(0.5, "intercept of the upper width H(p) (third-party, unverified)",
                                   rule=_LINE_RULE)
    lower_slope: float = param(-0.13, "slope of the lower width M(p) in p (third-party, unverified)",
                               rule=_LINE_RULE)
    lower_intercept: float = param(0.3, "intercept of the lower width M(p) (third-party, unverified)",
                                   rule=_LINE_RULE)
    eps_min: float = param(0.05, "lower clamp of both widths (third-party, unverified)", ge=0, rule="<= eps_max")
    eps_max: float = param(0.6, "upper clamp of both widths (third-party, unverified)", ge=0)
    total_steps: int = param(0, "the schedule's length T in steps; 0 = the run's train.max_steps", ge=0)
    od_min_frac: float = param(0.2, "OD: the floor τ_low = H_min as a fraction of the first batch's entropy (blog)",
                               ge=0)
    target: float | str | None = param(None, "a setpoint in nats or '0.5x' (times the first batch's entropy): OD's "
                                             "switch with both thresholds there, in place of the schedule",
                                       rule=LEVEL_RULE)

    def __post_init__(self) -> None:
        self._step, self._state = 0, LOWER_MODE
        self._h_init: float | None = None  # the first batch's entropy, set by observe
        super().__post_init__()

    def validate(self) -> None:
        if self.eps_min > self.eps_max:
            raise ValueError(f"eps_min must be <= eps_max, got {self.eps_min!r} > {self.eps_max!r}")
        check_level(self.target, "target")

    def observe(self, stats: TokenStats, mask: Tensor, agg: str) -> dict[str, Any]:
        mean, _, n = masked_mean_std(stats.entropy.detach(), as_mask(mask))
        self._step += 1
        if not n:
            return {}
        h = float(mean)
        if self._h_init is None:
            self._h_init = h
        target = resolve_level(check_level(self.target, "target"), self._h_init)
        if target is not None:
            self._state = fec_od_state(h, self._state, target, target)
            return {"control/own_entropy": h, "control/own_target": target, "control/own_output": self._state}
        if self.schedule != "od":
            return {"control/own_entropy": h}
        low, high = fec_od_thresholds(self._step, max(self.total_steps, 1), self._h_init, self.od_min_frac)
        self._state = fec_od_state(h, self._state, low, high)
        return {"control/own_entropy": h, "control/own_low": low, "control/own_high": high,
                "control/own_output": self._state}

    def minibatch_masks(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                        clipped: Tensor | None = None, generator: torch.Generator | None = None) -> Masks:
        p = logp.detach().float().exp()
        upper = fec_width(p, self.upper_slope, self.upper_intercept, self.eps_min, self.eps_max)
        lower = fec_width(p, self.lower_slope, self.lower_intercept, self.eps_min, self.eps_max)
        schedule = "od" if self.target is not None else self.schedule
        high, low = fec_bounds(schedule, self._step, max(self.total_steps, 1), self.eps_std, upper, lower,
                               self._state)
        return Masks(eps_low=low, eps_high=high)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "state": self._state, "h_init": self._h_init}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step, self._state, self._h_init = int(state["step"]), int(state["state"]), state["h_init"]
