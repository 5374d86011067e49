"""The classic entropy-control methods: clip-higher (DAPO), the entropy bonus, high-entropy-token training
("80/20") and the gradient-masking ablation of Paper A. Each docstring gives the rule and its paper.

Knob directions as in :mod:`entropy_rft.control.paper_methods`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from entropy_rft.control.masks import grad_mask, high_entropy_mask
from entropy_rft.control.paper_methods import PAPER_A
from entropy_rft.control.registry import LossOverrides, Masks, Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

DAPO = "Yu et al. 2025, DAPO, arXiv 2503.14476"
EIGHTY_TWENTY = "Wang et al. 2025, Beyond the 80/20 Rule, arXiv 2506.01939"
ENTROPY_BONUS = "Williams & Peng 1991; Mnih et al. 2016 (A3C), arXiv 1602.01783"


@register_method
@dataclass
class ClipHigher(Method):
    """Clip-higher (DAPO): asymmetric ratio clip, r ∈ [1 − eps_low, 1 + eps_high] with eps_high > eps_low.

    A looser upper bound lets unlikely tokens of positive samples (S_c < 0) raise entropy (Paper A, Sec. 5).
    """

    name: ClassVar[str] = "clip_higher"
    paper: ClassVar[str] = DAPO
    summary: ClassVar[str] = "asymmetric PPO ratio clip with a looser upper bound"
    quadrants: ClassVar[dict[str, str]] = {"pos_sneg": "changes the clip (upper bound, A>0 tokens rising)",
                                           "pos_spos": "changes the clip (upper bound)"}
    knob: ClassVar[str | None] = "eps_high"
    knob_raises_entropy: ClassVar[int] = 1

    eps_low: float = param(0.2, "lower ratio clip, r >= 1 - eps_low", ge=0)
    eps_high: float = param(0.28, "upper ratio clip, r <= 1 + eps_high", ge=0)

    def loss_overrides(self) -> LossOverrides:
        return LossOverrides(eps_low=float(self.eps_low), eps_high=float(self.eps_high))


@register_method
@dataclass
class EntropyBonus(Method):
    """Entropy bonus: the token loss gets −coef·H (the gradient flows through H)."""

    name: ClassVar[str] = "entropy_bonus"
    paper: ClassVar[str] = ENTROPY_BONUS
    summary: ClassVar[str] = "add −coef·H to the token loss"
    quadrants: ClassVar[dict[str, str]] = {"all": "adds gradient through H (not a token weight)"}
    knob: ClassVar[str | None] = "coef"
    knob_raises_entropy: ClassVar[int] = 1

    coef: float = param(1e-3, "entropy coefficient", ge=0)

    def loss_overrides(self) -> LossOverrides:
        return LossOverrides(entropy_coef=float(self.coef))

    def needs_entropy_grad(self) -> bool:
        return True


@register_method
@dataclass
class HighEntropy(Method):
    """High-entropy-token training ("80/20"): only the top_q fraction of the batch's valid tokens by
    (old-policy) entropy get gradient; the rest leave loss and count."""

    name: ClassVar[str] = "high_entropy"
    paper: ClassVar[str] = EIGHTY_TWENTY
    summary: ClassVar[str] = "train only the top_q fraction of tokens by entropy"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "tokens"
    masks: ClassVar[tuple[str, ...]] = ("keep",)
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (low-entropy positions)"}
    knob: ClassVar[str | None] = "top_q"
    knob_raises_entropy: ClassVar[int] = -1

    top_q: float = param(0.2, "fraction of highest-entropy tokens kept (1 = vanilla)", ge=0, le=1)

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        return Masks(keep=high_entropy_mask(stats.entropy, mask, self.top_q))


@register_method
@dataclass
class GradMask(Method):
    """Gradient-masking ablation (Paper A, Sec. 4): among samples with sign(A) = sample_sign, only tokens
    with sign(S) = s_sign train (S = s_star, or S_c with s_field="s_centered"); the other samples' tokens
    are dropped unless drop_other_samples is False. Four conditions = the four sign combinations."""

    name: ClassVar[str] = "grad_mask"
    paper: ClassVar[str] = PAPER_A
    summary: ClassVar[str] = "train only tokens with chosen sign(A) and sign(S) (4-condition ablation)"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "local"
    masks: ClassVar[tuple[str, ...]] = ("keep",)
    reads: ClassVar[tuple[str, ...] | None] = ("s_star", "s_centered")  # s_field picks one
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (by sign(A), sign(S))"}

    sample_sign: str = param("positive", "samples whose tokens are masked by S: A>0 or A<0",
                             choices=("positive", "negative"))
    s_sign: str = param("positive", "sign of S kept within those samples", choices=("positive", "negative"))
    s_field: str = param("s_star", "which discriminator: s_star (S) or s_centered (S_c)",
                         choices=("s_star", "s_centered"))
    drop_other_samples: bool = param(True, "drop tokens of the other samples (else they train normally)")

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        s = getattr(stats, self.s_field)
        return Masks(keep=grad_mask(s, advantages, mask, self.sample_sign, self.s_sign,
                                    self.drop_other_samples))
