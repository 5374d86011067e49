"""The records a training step passes from stage to stage (DESIGN.md's data path), each frozen.

    Scored (1-3) -> OldPolicy (4-5) -> Selection (6) -> Update (7-8) -> Probed (9) -> metrics row (10)

A stage is a function of the records before it; none writes into an earlier one, so a stage can be run again
on the same inputs (the counterfactual probe takes a vanilla update from the very same records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from entropy_rft.control.registry import Method
from entropy_rft.core.dynamics import TokenStats
from entropy_rft.core.loss_types import LossSettings
from entropy_rft.policy.rollout import RolloutBatch
from entropy_rft.tasks.base import Example


@dataclass(frozen=True)
class Scored:
    """Stages 1-3: the prompts (each repeated G times), their responses and rewards."""

    group: list[Example]
    rollout: RolloutBatch
    rewards: Tensor  # [B] float32
    mask: Tensor  # [B, R] bool: response tokens that train (a uniform group's are dropped when configured)
    seq_advantages: Tensor | None = None  # [B] fixed before a splice (AEPO); None: computed from the rewards


@dataclass(frozen=True)
class OldPolicy:
    """Stages 4-5: the old policy's log-probs and TokenStats, the advantages, the reference log-probs; every
    tensor detached (a single update's graph of this forward travels beside the record: ``stages.live_forward``)."""

    logp: Tensor  # [B, R], detached
    stats: TokenStats  # [B, R] float32
    adv: Tensor  # [B, R] per-token advantages (0 on padding)
    returns: Tensor | None = None  # [B, R] PPO value targets
    ref_logp: Tensor | None = None  # [B, R] frozen reference policy (ref-KL)


@dataclass(frozen=True)
class Selection:
    """Stage 6: the method's rollout-level masks (ClipB, ClipV, high-entropy, grad-mask keep; the advantage
    shaping's ψ; EntroPIC's token selection) and the autopilot's (or the method's own controller's) metrics."""

    keep: Tensor | None  # [B, R] bool, None: every token kept
    control: dict[str, Any]
    adv_shift: Tensor | None = None  # [B, R] float added to the advantages (entropy_adv)
    weight_select: Tensor | None = None  # [B, R] bool, EntroPIC's adjusted tokens


@dataclass(frozen=True)
class Rule:
    """What an update applies: the method (its minibatch selection) and the loss's settings, validated once."""

    method: Method
    settings: LossSettings

    @property
    def minibatch_masks(self) -> bool:
        return self.method.stage == "minibatch"


@dataclass(frozen=True)
class Update:
    """Stages 7-8: the averaged loss metrics and the tokens a minibatch-level method zeroed (first epoch)."""

    metrics: dict[str, Any]
    zeroed: Tensor  # [B, R] bool


@dataclass(frozen=True)
class Probed:
    """Stage 9: entropy after the update against the tabular prediction, on the same tokens."""

    pred: Tensor  # [B, R] predicted ΔH (Theorem 3.3 through the aggregation weights)
    actual: Tensor  # [B, R] measured ΔH
    logp: Tensor  # [B, R] the updated policy's log-probs
    ratio: Tensor  # [B, R] float64 exp(logp - old logp)
    metrics: dict[str, Any]


def trained_mask(s: Scored, sel: Selection, upd: Update) -> Tensor:
    """The tokens the update trained on: the response mask, less the method's drops and zeroed tokens."""
    m = s.mask if sel.keep is None else s.mask & sel.keep
    return m & ~upd.zeroed
