"""AEPO (arXiv 2510.08141): entropy held at a target by REINFORCE on rollouts sampled from a
temperature-adjusted policy. The rule, its source and how far it was checked are in ``AEPO``'s docstring; the
maths is in the pure functions ``aepo_temperature``, ``aepo_sample_num`` and ``aepo_splice``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import (
    LEVEL_RULE_REQUIRED,
    as_mask,
    check_level,
    masked_mean_std,
    resolve_level,
)
from entropy_rft.control.registry import Method, Resample, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

AEPO = ("Wang et al. 2025, AEPO: Arbitrary Entropy Policy Optimization, arXiv 2510.08141 (code: "
        "github.com/597358816/AEPO, trainer.algorithm=AEPO)")


def aepo_temperature(entropy: float, target: float, t_high: float, t_low: float) -> float:
    """The temperature of the step's extra rollouts: ``t_high`` when the last measured entropy is at or below the
    target, else ``t_low`` (released ``ray_trainer.py`` lines 786-790: ``entropy <= entropy_base``)."""
    return t_high if entropy <= target else t_low


def aepo_sample_num(entropy: float, target: float, selected: int, cap: int) -> int:
    """How many selected rollouts enter the batch: min(cap, selected) at or below the target, half of it (floor)
    above (released lines 804-807: ``min(reinforce_sample_num, len(entropy_controller))``, ``// 2``)."""
    n = min(cap, selected)
    return n if entropy <= target else n // 2


def sampled_entropy(logp: Tensor, mask: Tensor) -> float:
    """−mean log p of the sampled tokens under ``mask``: a sampled estimate of the entropy, what the released
    actor logs as ``actor/entropy_loss`` for one micro-batch (``dp_actor.py`` line 322,
    ``-masked_mean(log_probs, response_mask)``); 0 for an empty mask."""
    m = mask.to(torch.float64)
    n = float(m.sum())
    return -float((logp.detach().to(torch.float64) * m).sum()) / n if n else 0.0


def aepo_splice(advantages: Tensor, threshold: float, n_max: int | None = None) -> Tensor:
    """Indices of the extra rollouts kept, in order: those whose group advantage is > ``threshold`` (released
    ``_select_by_advantage(batch, threshold=0.05, absolute=False)``, lines 166-177, on ``advantages[:, 0]``),
    the first ``n_max`` of them (all when None)."""
    idx = torch.nonzero(advantages.reshape(-1) > threshold, as_tuple=False).reshape(-1)
    return idx if n_max is None else idx[:n_max]


@register_method
@dataclass
class AEPOMethod(Method):
    """AEPO (arXiv 2510.08141): REINFORCE on temperature-adjusted rollouts as the entropy regulariser.

    The released trainer (``verl/trainer/ray_trainer.py``, ``trainer.algorithm=AEPO``), per step: roll out the
    batch and compute its GRPO advantages; then roll out the first quarter of the prompts again (``n`` samples
    each) at temperature ``temperature_high`` (1.2) when the last step's entropy (``actor/entropy_loss``; 0 before
    the first update) is at or below ``entropy_base`` (0.5), else at ``temperature_low`` (0.8); compute those
    rollouts' GRPO advantages and keep the ones > 0.05 with advantage 1 on every token; the first
    min(``reinforce_sample_num``, kept) of them (half of that above the target) replace the batch's first
    rollouts, whose other rows keep the advantages of the batch before the swap; the update is the usual one
    (log-probs at the training temperature). Defaults: ``verl/trainer/config.py`` lines 85-88 and
    ``examples/config.yaml`` (reinforce_sample_num 60 of 512 prompts × 5 samples).

    Here ``target`` is ``entropy_base`` (also as '0.5x', times the first batch's entropy, for the setpoints).
    The entropy the rule reads (``entropy``) is by default the released one: ``actor/entropy_loss``, which the released
    trainer takes from the last update's metrics (``ray_trainer.py`` lines 844-845) and its actor computes per
    micro-batch as ``-masked_mean(log_probs, response_mask)`` (``dp_actor.py`` line 322), averaged over every
    micro-batch of the update: minus the mean log-prob of the sampled tokens under the policy being updated
    (``sampled_entropy``, read through ``observe_update``). It is a sampled estimate of the entropy, not the
    entropy: after a swap, rows drawn at T ≠ 1 move it (for p = (0.9, 0.1), H = 0.325 while tokens drawn at
    T 1.2 give 0.409 in expectation). ``entropy='true'`` reads instead the old policy's −Σ p log p, token mean
    over the step's training tokens. When no extra rollout passes
    ``adv_threshold`` the released branch fails; here the batch trains unswapped. Native engine with group
    advantages only (grpo or dr_grpo): the rule needs a second rollout inside the step.
    """

    name: ClassVar[str] = "aepo"
    paper: ClassVar[str] = AEPO
    summary: ClassVar[str] = ("REINFORCE (A = 1) on correct rollouts sampled at T 1.2 below the target entropy, "
                              "0.8 above it, swapped into the batch")
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "local"
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)  # observe: the batch entropy
    quadrants: ClassVar[dict[str, str]] = {"pos_spos": "adds rollouts sampled at T_high/T_low with A = 1",
                                           "pos_sneg": "adds rollouts sampled at T_high/T_low with A = 1"}
    engines: ClassVar[tuple[str, ...]] = ("native",)
    algorithms: ClassVar[tuple[str, ...]] = ("grpo", "dr_grpo")

    target: float | str = param(0.5, "entropy target in nats (released trainer.entropy_base) or '0.5x' (times "
                                     "the first batch's entropy)", rule=LEVEL_RULE_REQUIRED)
    temperature_high: float = param(1.2, "sampling temperature of the extra rollouts at or below the target "
                                         "(released trainer.temperature_high)", gt=0)
    temperature_low: float = param(0.8, "sampling temperature of the extra rollouts above the target (released "
                                        "trainer.temperature_low)", gt=0)
    reinforce_sample_num: int = param(60, "most extra rollouts swapped into a batch; half of it above the target "
                                          "(released trainer.reinforce_sample_num)", ge=0)
    prompt_frac: float = param(0.25, "share of the step's prompts rolled out again (released: the first quarter)",
                               gt=0, le=1)
    adv_threshold: float = param(0.05, "an extra rollout is kept when its group advantage is above this "
                                       "(released _select_by_advantage threshold)",
                                 rule="any finite number (an advantage level)")
    entropy: str = param("sampled", "the entropy the switch reads: 'sampled' (released actor/entropy_loss: "
                                    "−mean log p of the sampled tokens over the last update's micro-batches) or "
                                    "'true' (the old policy's −Σ p log p over the step's training tokens)",
                         choices=("sampled", "true"))

    def __post_init__(self) -> None:
        self._last_h = 0.0
        self._base: float | None = None  # the first batch's entropy, set by observe
        self._temperature: float | None = None  # the last resample_plan's temperature
        self._spliced = 0
        self._update_h: list[float] = []  # this step's update, one reading a micro-batch
        super().__post_init__()

    def validate(self) -> None:
        check_level(self.target, "target", allow_none=False)

    def _target(self) -> float:
        level = check_level(self.target, "target", allow_none=False)
        # before the first measurement a relative target has no base: the released first step (entropy 0)
        # samples hot whatever the target, as here
        return float("inf") if level[1] and self._base is None else resolve_level(level, self._base)

    def observe_update(self, logp: Tensor, mask: Tensor) -> None:
        if self.entropy == "sampled":
            self._update_h.append(sampled_entropy(logp, mask))

    def resample_plan(self) -> Resample | None:
        if self._update_h:  # the last update's actor/entropy_loss: the mean over its micro-batches
            self._last_h = sum(self._update_h) / len(self._update_h)
            self._update_h = []
        self._temperature = aepo_temperature(self._last_h, self._target(), self.temperature_high,
                                             self.temperature_low)
        return Resample(self._temperature, self.prompt_frac)

    def splice_rows(self, advantages: Tensor) -> tuple[Tensor, float]:
        kept = aepo_splice(advantages, self.adv_threshold)
        n = aepo_sample_num(self._last_h, self._target(), int(kept.numel()), self.reinforce_sample_num)
        self._spliced = n
        return kept[:n], 1.0

    def observe(self, stats: TokenStats, mask: Tensor, agg: str) -> dict[str, Any]:
        mean, _, n = masked_mean_std(stats.entropy.detach(), as_mask(mask))
        out: dict[str, Any] = {"control/spliced_frac": self._spliced / max(int(mask.shape[0]), 1)}
        if self._temperature is not None:
            out["control/own_output"] = self._temperature
        if n and self._base is None:  # a setpoint's base: the first batch's entropy, as for every method
            self._base = float(mean)
        if n and self.entropy == "true":
            self._last_h = float(mean)
        if n:  # the reading the switch uses
            out.update({"control/own_entropy": self._last_h, "control/own_target": self._target()})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"last_h": self._last_h, "base": self._base, "update_h": list(self._update_h)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_h, self._base = float(state["last_h"]), state["base"]
        self._update_h = [float(x) for x in state.get("update_h", [])]
