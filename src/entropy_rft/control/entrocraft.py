"""Entrocraft (Li et al. 2026): the batch entropy held inside a band that moves linearly over training,
by training on one side of the reward only (RAFT++ or NSR) whenever the entropy leaves the band. The rule, its
source and how far it was checked are in ``Entrocraft``'s docstring; the maths is in the pure functions
``entrocraft_band``, ``entrocraft_mode`` and ``entrocraft_advantages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import LEVEL_RULE, as_mask, check_level, resolve_level
from entropy_rft.control.registry import Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

ENTROCRAFT = ("Li et al. 2026, Entrocraft, arXiv 2604.26326 (code: github.com/lblaoke/entrocraft, advantage "
              "estimator grpo_range_linear)")
# The modes of a step: below the band NSR (only wrong rollouts train), inside GRPO, above RAFT++ (only correct ones).
RAISE, HOLD, LOWER = -1, 0, 1


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


def entrocraft_advantages(rewards: Tensor, mask: Tensor, mode: int, center: float = 0.5,
                         scale: float = 2.0) -> Tensor | None:
    """The released estimator of a step outside the band, per token: the rollout's signal
    s = (r − ``center``)·``scale`` (the released math reward is ±1, ``verl/utils/reward_score/math_verify.py``
    line 40; the defaults map this project's 0/1 rewards onto it), RAFT++ above the band (``LOWER``:
    max(s, 0), ``core_algos.py`` 264-271) and NSR below it (``RAISE``: min(s, 0), 465-472), with no group
    normalisation, zero on padding. None with ``HOLD`` (the engine's GRPO advantages train)."""
    if mode == HOLD:
        return None
    signal = (rewards.to(torch.float32) - center) * scale
    signal = signal.clamp(min=0.0) if mode == LOWER else signal.clamp(max=0.0)
    return torch.where(mask, signal[:, None].expand(mask.shape), torch.zeros((), dtype=torch.float32))


@register_method
@dataclass
class Entrocraft(Method):
    """Entrocraft (Li et al. 2026): hold the batch entropy inside a band [lower, upper] whose bounds move
    linearly over training, by switching the advantage estimator.

    Each step, H = the token mean of the old policy's entropy over the rollout batch's training tokens (the
    released ``ray_trainer.py``: ``agg_loss(entropys, response_mask, "token-mean")`` from the logits before the
    update). Above the band the step trains with RAFT++ (only correct rollouts, advantage = the raw reward:
    entropy falls); below it with NSR (only wrong rollouts, advantage = the raw negative reward: entropy rises);
    inside it with the engine's GRPO advantages (``entrocraft_advantages``; released
    ``compute_grpo_range_outcome_advantage``). The band (``entrocraft_band``) starts at
    ``lower_start``/``upper_start`` and reaches ``lower_end``/``upper_end`` at ``total_steps`` (0: the run's
    ``train.max_steps``). Released reference run (``grpo_range_linear``, Qwen3-4B-Base): lower 0.6 → 0.4, upper
    0.7 → 0.5, the defaults here. The raw reward is the released ±1: this project's 0/1 rewards are mapped by
    (r − ``reward_center``)·``reward_scale``.

    ``target`` (not in the released code) holds a fixed band ``target`` ± ``half_width`` instead of the moving
    one, as the released fixed-band estimator ``grpo_range`` does, so that the rule can be compared with the
    other controllers at a setpoint ('0.5x': half the first batch's entropy). Native engine only: the rule
    needs the rollout batch's entropy and rewards before the advantages reach the loss. Refused with
    ``algo.drop_uniform_groups``: the filter would drop the all-correct groups RAFT++ trains on (+1) and the
    all-wrong ones NSR trains on (−1), and the method would no longer be the released one.
    """

    name: ClassVar[str] = "entrocraft"
    paper: ClassVar[str] = ENTROCRAFT
    summary: ClassVar[str] = "hold H in a moving band: above it train on correct rollouts only, below on wrong only"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "local"
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)  # observe: the batch entropy
    quadrants: ClassVar[dict[str, str]] = {"neg_sneg": "zeroes A<0 when H is above the band; raw −1 below it",
                                           "neg_spos": "zeroes A<0 when H is above the band; raw −1 below it",
                                           "pos_spos": "zeroes A>0 when H is below the band; raw +1 above it",
                                           "pos_sneg": "zeroes A>0 when H is below the band; raw +1 above it"}
    engines: ClassVar[tuple[str, ...]] = ("native",)
    # the released estimator gives an all-correct group +1 above the band and an all-wrong one -1 below it
    allows_group_filter: ClassVar[bool] = False

    lower_start: float = param(0.6, "the band's lower bound at the first step, nats (released run)", ge=0,
                               rule="<= upper_start")
    lower_end: float = param(0.4, "the band's lower bound at total_steps, nats (released run)", ge=0,
                             rule="<= upper_end")
    upper_start: float = param(0.7, "the band's upper bound at the first step, nats (released run)", ge=0)
    upper_end: float = param(0.5, "the band's upper bound at total_steps, nats (released run)", ge=0)
    total_steps: int = param(0, "steps over which the bounds move; 0 = the run's train.max_steps", ge=0)
    target: float | str | None = param(None, "a fixed band's centre in nats or '0.5x' (times the first batch's "
                                             "entropy), in place of the moving band; None: the moving band",
                                       rule=LEVEL_RULE)
    half_width: float = param(0.05, "the fixed band's half width in nats (the released band is 0.1 wide)", ge=0)
    reward_center: float = param(0.5, "the reward mapped to 0 in the raw RAFT++/NSR advantage (0/1 rewards -> ±1)",
                                 rule="any finite number (a reward level)")
    reward_scale: float = param(2.0, "the factor of the raw RAFT++/NSR advantage (r - reward_center)·reward_scale",
                                ge=0)

    def __post_init__(self) -> None:
        self._step, self._mode = 0, HOLD
        self._base: float | None = None  # the first batch's entropy, set by observe
        super().__post_init__()

    def validate(self) -> None:
        if self.lower_start > self.upper_start or self.lower_end > self.upper_end:
            raise ValueError(f"the lower bound must not exceed the upper one at either end, got lower "
                             f"{self.lower_start}->{self.lower_end}, upper {self.upper_start}->{self.upper_end}")
        check_level(self.target, "target")

    def observe(self, stats: TokenStats, mask: Tensor, agg: str) -> dict[str, Any]:
        mask = as_mask(mask)
        if not bool(mask.any()):
            self._mode = HOLD
            return {}
        self._step += 1
        h = float(stats.entropy.detach().to(torch.float64)[mask].mean())
        if self._base is None:
            self._base = h
        centre = resolve_level(check_level(self.target, "target"), self._base)
        if centre is None:
            low, high = entrocraft_band(self._step, max(self.total_steps, 1), (self.lower_start, self.lower_end),
                                        (self.upper_start, self.upper_end))
        else:
            low, high = centre - self.half_width, centre + self.half_width
        self._mode = entrocraft_mode(h, low, high)
        return {"control/own_entropy": h, "control/own_target": 0.5 * (low + high), "control/own_low": low,
                "control/own_high": high, "control/own_output": float(self._mode)}

    def rollout_advantages(self, rewards: Tensor, advantages: Tensor, mask: Tensor) -> Tensor | None:
        return entrocraft_advantages(rewards, as_mask(mask), self._mode, self.reward_center, self.reward_scale)

    def state_dict(self) -> dict[str, Any]:
        # not total_steps: a resumed run with a new train.max_steps moves the band over its new length
        return {"step": self._step, "mode": self._mode, "base": self._base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step, self._mode, self._base = int(state["step"]), int(state["mode"]), state.get("base")
