"""Entrocraft (Li et al. 2026, issue 39): the batch entropy held inside a band that moves linearly over training,
by rejecting rollouts of one advantage sign whenever the entropy leaves the band. The rule, its source and how far
it was checked are in ``Entrocraft``'s docstring; the maths is in the pure functions ``entrocraft_band``,
``entrocraft_mode`` and ``entrocraft_shift``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import as_mask, broadcast_advantages, check_number
from entropy_rft.control.registry import Masks, Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

ENTROCRAFT = ("Li et al. 2026, Entrocraft, arXiv 2604.26326 (code: github.com/lblaoke/entrocraft, advantage "
              "estimator grpo_range_linear)")
# The modes of a step: the advantage sign whose rollouts are rejected.
RAISE, HOLD, LOWER = -1, 0, 1  # below the band: reject A > 0 (NSR); inside: GRPO; above: reject A < 0 (RAFT++)


def entrocraft_band(step: int, total_steps: int, lower: tuple[float, float],
                    upper: tuple[float, float]) -> tuple[float, float]:
    """The band at ``step`` (1-based, as verl's ``global_steps``): each bound moves linearly from its start to its
    end over ``total_steps`` (the released ``compute_grpo_range_linear_outcome_advantage``, ``core_algos.py``
    lines 400-401: bound = start + (end − start)·step/total_steps), held at its end after it."""
    frac = min(step / total_steps, 1.0)
    return lower[0] + (lower[1] - lower[0]) * frac, upper[0] + (upper[1] - upper[0]) * frac


def entrocraft_mode(entropy: float, low: float, high: float) -> int:
    """``LOWER`` when the entropy is strictly above the band, ``RAISE`` strictly below it, else ``HOLD`` (the
    released comparisons are strict: a value on a bound trains as GRPO)."""
    if entropy > high:
        return LOWER
    if entropy < low:
        return RAISE
    return HOLD


def entrocraft_shift(advantages: Tensor, mask: Tensor, mode: int) -> Tensor | None:
    """The advantage shift that rejects the rollouts of one sign: −A on the tokens of A < 0 (``LOWER``: only
    positive rollouts train, which lowers entropy) or of A > 0 (``RAISE``: only negative ones train, which raises
    it); zero elsewhere and on padding. None with ``HOLD``. A rejected token keeps its place in the loss's
    normaliser, as the released code sets advantages to 0 rather than removing rollouts."""
    if mode == HOLD:
        return None
    adv = broadcast_advantages(advantages, mask).to(torch.float32)
    reject = (adv < 0) if mode == LOWER else (adv > 0)
    return torch.where(reject & mask, -adv, torch.zeros_like(adv))


@register_method
@dataclass
class Entrocraft(Method):
    """Entrocraft (Li et al. 2026): hold the batch entropy inside a band [lower, upper] whose bounds move
    linearly over training, by rejecting rollouts.

    Each step, H = the token mean of the old policy's entropy over the rollout batch's training tokens (the
    released ``ray_trainer.py``: ``agg_loss(entropys, response_mask, "token-mean")`` from the logits before the
    update). Above the band, negative-advantage rollouts are rejected (only A > 0 trains: RAFT++, entropy
    falls); below it, positive ones (only A < 0 trains: NSR, entropy rises); inside it, plain GRPO. Rejected
    tokens get advantage 0 (``Masks.adv_shift`` = −A) and stay in the loss's token count. The band
    (``entrocraft_band``) starts at ``lower_start``/``upper_start`` and reaches ``lower_end``/``upper_end`` at
    ``total_steps`` (0: the run's ``train.max_steps``). Released reference run (``grpo_range_linear``, Qwen3-4B-Base):
    lower 0.6 → 0.4, upper 0.7 → 0.5, the defaults here.

    Deviation, stated: the released RAFT++ and NSR estimators use the raw reward (±1 in its math task) as the
    advantage, with no group normalisation; here the rejected sign's GRPO advantages are zeroed and the other
    sign keeps its GRPO advantage (the paper's "rejecting rollouts", on this project's advantages). Native
    engine only: the rule needs the rollout batch's entropy before the advantages reach the loss.
    """

    name: ClassVar[str] = "entrocraft"
    paper: ClassVar[str] = ENTROCRAFT
    summary: ClassVar[str] = "hold H in a linearly moving band: above it reject A<0 rollouts, below it A>0"
    stage: ClassVar[str] = "rollout"
    quadrants: ClassVar[dict[str, str]] = {"neg_sneg": "zeroes A<0 when H is above the band",
                                           "neg_spos": "zeroes A<0 when H is above the band",
                                           "pos_spos": "zeroes A>0 when H is below the band",
                                           "pos_sneg": "zeroes A>0 when H is below the band"}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    lower_start: float = param(0.6, "the band's lower bound at the first step, nats (released run)")
    lower_end: float = param(0.4, "the band's lower bound at total_steps, nats (released run)")
    upper_start: float = param(0.7, "the band's upper bound at the first step, nats (released run)")
    upper_end: float = param(0.5, "the band's upper bound at total_steps, nats (released run)")
    total_steps: int = param(0, "steps over which the bounds move; 0 = the run's train.max_steps")

    def __post_init__(self) -> None:
        self._step, self._mode = 0, HOLD
        super().__post_init__()

    def validate(self) -> None:
        for name in ("lower_start", "lower_end", "upper_start", "upper_end"):
            check_number(getattr(self, name), name, low=0.0)
        if self.lower_start > self.upper_start or self.lower_end > self.upper_end:
            raise ValueError(f"the lower bound must not exceed the upper one at either end, got lower "
                             f"{self.lower_start}->{self.lower_end}, upper {self.upper_start}->{self.upper_end}")
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or self.total_steps < 0:
            raise ValueError(f"total_steps must be an integer >= 0, got {self.total_steps!r}")

    def set_horizon(self, total_steps: int) -> None:
        if self.total_steps == 0:
            self.total_steps = int(total_steps)

    def observe(self, stats: TokenStats, mask: Tensor, agg: str) -> dict[str, Any]:
        mask = as_mask(mask)
        if not bool(mask.any()):
            self._mode = HOLD
            return {}
        self._step += 1
        h = float(stats.entropy.detach().to(torch.float64)[mask].mean())
        low, high = entrocraft_band(self._step, max(self.total_steps, 1), (self.lower_start, self.lower_end),
                                    (self.upper_start, self.upper_end))
        self._mode = entrocraft_mode(h, low, high)
        return {"control/own_entropy": h, "control/own_target": 0.5 * (low + high), "control/own_low": low,
                "control/own_high": high, "control/own_output": float(self._mode)}

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        return Masks(adv_shift=entrocraft_shift(advantages, as_mask(mask), self._mode))

    def state_dict(self) -> dict[str, Any]:
        # not total_steps: a resumed run with a new train.max_steps moves the band over its new length
        return {"step": self._step, "mode": self._mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step, self._mode = int(state["step"]), int(state["mode"])
