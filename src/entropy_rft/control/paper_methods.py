"""The baseline and the two papers' methods: ClipB and ClipV (Wang et al. 2026, released one-sided rules and
the paper's two-sided variants) and Clip-Cov / KL-Cov (Cui et al. 2025). Each docstring gives the rule and its
paper.

Knob directions: ``knob_raises_entropy = +1`` when increasing the knob raises entropy (more control),
-1 when it lowers it. For ClipB/ClipV a larger mu drops fewer tokens, so less control (-1).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import ADVANTAGE_SIGNS
from entropy_rft.control.masks import CLIP_V_SIGNS, clip_b_mask, clip_cov_mask, clip_v_mask, kl_cov_select
from entropy_rft.control.reductions import LOCAL, Reductions
from entropy_rft.control.registry import LossOverrides, Masks, Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

PAPER_A = "Wang et al. 2026, On the Entropy Dynamics in RFT of LLMs, arXiv 2602.03392"
PAPER_B = "Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, arXiv 2505.22617"


class _TwoSidedMu:
    """Knob "mu" over (mu_low, mu_high): get returns the common value, set moves every bounded side."""

    mu_low: float | None
    mu_high: float | None

    def get_knob(self) -> float:
        sides = {v for v in (self.mu_low, self.mu_high) if v is not None}
        if len(sides) != 1:
            raise ValueError(f"knob 'mu' is ambiguous with mu_low={self.mu_low!r}, mu_high={self.mu_high!r}")
        return float(sides.pop())

    def thresholds(self) -> tuple[float | None, float | None]:
        """(mu_low, mu_high) of the rule."""
        return self.mu_low, self.mu_high

    def _apply_knob(self, value: float) -> None:
        if self.mu_low is not None:
            self.mu_low = value
        if self.mu_high is not None:
            self.mu_high = value


@register_method
@dataclass
class NoControl(Method):
    """Vanilla GRPO/PPO surrogate: no entropy control."""

    name: ClassVar[str] = "none"
    paper: ClassVar[str] = "Shao et al. 2024 (GRPO), arXiv 2402.03300; Schulman et al. 2017 (PPO)"
    summary: ClassVar[str] = "no entropy control (baseline)"


@register_method
@dataclass
class ClipB(Method):
    """ClipB, released one-sided rule (Paper A's reference code, Trinity-RFT).

    S = p_k(H + log p_k); m, s = population mean/std of S over the batch's valid tokens (old policy).
    A token with A < 0 is dropped (leaves loss and count) when S − m < −mu·s. Those are penalties of
    unlikely tokens, which by Theorem 3.3 lower entropy the most. Paper sweep mu 2.0–3.0.
    """

    name: ClassVar[str] = "clip_b"
    paper: ClassVar[str] = PAPER_A
    summary: ClassVar[str] = "drop A<0 tokens with S − mean(S) < −mu·std(S) (released one-sided ClipB)"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "s_star_mean_std"
    masks: ClassVar[tuple[str, ...]] = ("keep",)
    reads: ClassVar[tuple[str, ...] | None] = ("s_star",)
    quadrants: ClassVar[dict[str, str]] = {"neg_spos": "drops (S far below its mean)",
                                           "neg_sneg": "drops (S far below its mean)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu: float = param(2.5, "threshold in batch stds of S (paper sweeps 2.0-3.0)", ge=0)
    advantage_sign: str = param("negative", "which tokens may be dropped (negative = A<0 strictly)",
                                choices=ADVANTAGE_SIGNS)

    def thresholds(self) -> tuple[float | None, float | None]:
        """(mu_low, mu_high) of the rule: one-sided, below the mean."""
        return self.mu, None

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor, *,
                      reduce: Reductions = LOCAL) -> Masks:
        return Masks(keep=clip_b_mask(stats.s_star, advantages, mask, *self.thresholds(), self.advantage_sign,
                                      reduce=reduce))


@register_method
@dataclass
class ClipBPaper(_TwoSidedMu, Method):
    """ClipB, the paper's two-sided rule (Paper A, Sec. 4).

    Keep a token when S − mean(S) ∈ [−mu_low·std(S), mu_high·std(S)], over the batch's valid tokens;
    every token may be dropped (advantage_sign "any"). None leaves a side unbounded. Knob "mu" sets both.
    """

    name: ClassVar[str] = "clip_b_paper"
    paper: ClassVar[str] = PAPER_A
    summary: ClassVar[str] = "keep tokens with S − mean(S) in [−mu_low·std, mu_high·std] (two-sided ClipB)"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "s_star_mean_std"
    masks: ClassVar[tuple[str, ...]] = ("keep",)
    reads: ClassVar[tuple[str, ...] | None] = ("s_star",)
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (S in a tail)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu_low: float | None = param(2.5, "lower threshold in stds of S (None = unbounded)", ge=0)
    mu_high: float | None = param(2.5, "upper threshold in stds of S (None = unbounded)", ge=0)
    advantage_sign: str = param("any", "which tokens may be dropped", choices=ADVANTAGE_SIGNS)

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor, *,
                      reduce: Reductions = LOCAL) -> Masks:
        return Masks(keep=clip_b_mask(stats.s_star, advantages, mask, *self.thresholds(), self.advantage_sign,
                                      reduce=reduce))


def tiny_cap_message(name: str, max_frac: float | None, n_tokens: int) -> str | None:
    """The warning for a ClipV cap that lets at most one token go per step, or None.

    The cap drops at most K = max(int(max_frac·N), 1) of N valid tokens (``clip_v_mask``); K is 1 whenever
    max_frac·N < 2, e.g. the released max_frac 1e-4 on fewer than 20,000 tokens per batch."""
    if max_frac is None or n_tokens == 0 or int(max_frac * n_tokens) > 1:
        return None
    return (f"{name}: max_frac {max_frac:g} on {n_tokens} tokens per batch caps the drop at 1 token per step "
            f"(K = max(int(max_frac*N), 1)), so the method barely acts; the released settings assume ~10^6 tokens "
            f"per step. Set max_frac to at least {2 / n_tokens:.2g} (or null: no cap) and tune mu for this batch "
            f"(the default config's preset: mu 2, max_frac null)")


def warn_tiny_cap(method: ClipV | ClipVPaper, n_tokens: int) -> None:
    """Warn once per method instance (``tiny_cap_message``)."""
    if method.__dict__.get("_warned_tiny_cap"):
        return
    msg = tiny_cap_message(method.name, method.max_frac, n_tokens)
    if msg is not None:
        method.__dict__["_warned_tiny_cap"] = True
        warnings.warn(msg, UserWarning, stacklevel=3)


@register_method
@dataclass
class ClipV(Method):
    """ClipV, released one-sided rule with cap (Paper A's reference code, Trinity-RFT ``clipv_advantage.py``).

    S_c = S_k − E_p[S] (Theorem 3.3), s_c its population std over the batch's valid tokens. A token with
    A <= 0 is a violator when S_c < −mu·s_c. Violators with A < 0: if more than K = max(int(max_frac·N), 1),
    only the K farthest past the threshold are dropped. Violators with A == 0 (every token of a group whose
    rewards are all equal) are all dropped, outside the cap: they carry no gradient, but they leave the
    token-mean loss's denominator, so the step differs from dropping A < 0 only. That is
    ``advantage_sign="released"`` (the default); ``"negative"`` is the strict rule (A < 0 only, the rule of
    DESIGN.md and of this project's results measured before ``released`` became the default). Paper sweep
    mu 7.5–8.5.
    """

    name: ClassVar[str] = "clip_v"
    paper: ClassVar[str] = PAPER_A
    summary: ClassVar[str] = "drop A<=0 tokens with S_c < −mu·std(S_c), A<0 ones capped (released ClipV)"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "s_centered_std_top_k"
    masks: ClassVar[tuple[str, ...]] = ("keep",)
    reads: ClassVar[tuple[str, ...] | None] = ("s_centered",)
    quadrants: ClassVar[dict[str, str]] = {"neg_sneg": "drops (S_c < −mu·std)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu: float = param(8.5, "threshold in batch stds of S_c (paper sweeps 7.5-8.5; tuned for 7B models)", ge=0)
    max_frac: float | None = param(1e-4, "cap: drop at most K = max(int(max_frac*N), 1); None = no cap", ge=0, le=1)
    advantage_sign: str = param("released", "which tokens may be dropped: released = A<=0 (A==0 outside the "
                                "cap, the authors' code); negative = A<0 strictly", choices=CLIP_V_SIGNS)

    def thresholds(self) -> tuple[float | None, float | None]:
        """(mu_low, mu_high) of the rule: one-sided, below 0."""
        return self.mu, None

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor, *,
                      reduce: Reductions = LOCAL) -> Masks:
        warn_tiny_cap(self, reduce.count(mask))
        return Masks(keep=clip_v_mask(stats.s_centered, advantages, mask, *self.thresholds(), self.advantage_sign,
                                      self.max_frac, reduce=reduce))


@register_method
@dataclass
class ClipVPaper(_TwoSidedMu, Method):
    """ClipV, the paper's two-sided rule (Paper A, Sec. 4).

    Keep a token when S_c ∈ [−mu_low·s_c, mu_high·s_c] (S_c uncentred, s_c its population std); every
    token may be dropped; no cap unless max_frac is set. Knob "mu" sets both sides.
    """

    name: ClassVar[str] = "clip_v_paper"
    paper: ClassVar[str] = PAPER_A
    summary: ClassVar[str] = "keep tokens with S_c in [−mu_low·std(S_c), mu_high·std(S_c)] (two-sided ClipV)"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "s_centered_std_top_k"
    masks: ClassVar[tuple[str, ...]] = ("keep",)
    reads: ClassVar[tuple[str, ...] | None] = ("s_centered",)
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (S_c in a tail)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu_low: float | None = param(8.5, "lower threshold in stds of S_c (None = unbounded)", ge=0)
    mu_high: float | None = param(8.5, "upper threshold in stds of S_c (None = unbounded)", ge=0)
    advantage_sign: str = param("any", "which tokens may be dropped", choices=ADVANTAGE_SIGNS)
    max_frac: float | None = param(None, "cap on the dropped fraction; None = no cap", ge=0, le=1)

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor, *,
                      reduce: Reductions = LOCAL) -> Masks:
        warn_tiny_cap(self, reduce.count(mask))
        return Masks(keep=clip_v_mask(stats.s_centered, advantages, mask, *self.thresholds(), self.advantage_sign,
                                      self.max_frac, reduce=reduce))


@register_method
@dataclass
class ClipCov(Method):
    """Clip-Cov (Paper B, Sec. 4.2).

    cov_t = (logp_t − mean logp)(A_t − mean A) over the minibatch's valid tokens (current logp, detached).
    Of the candidates lb < cov_t < ub (not already PPO-clipped, as in the reference), max(int(ratio·N), 1)
    picked at random get their loss zeroed (detached); the token count is unchanged.
    """

    name: ClassVar[str] = "clip_cov"
    paper: ClassVar[str] = PAPER_B
    summary: ClassVar[str] = "zero the loss of ratio·N random tokens with lb < Cov(logp, A) < ub"
    stage: ClassVar[str] = "minibatch"
    exchange: ClassVar[str | None] = "covariance_random_pick"
    masks: ClassVar[tuple[str, ...]] = ("zeroed",)
    reads: ClassVar[tuple[str, ...] | None] = ()
    quadrants: ClassVar[dict[str, str]] = {"pos_spos": "zeroes (high Cov: likely tokens, A>0)",
                                           "neg_sneg": "zeroes (high Cov: unlikely tokens, A<0)"}
    knob: ClassVar[str | None] = "ratio"
    knob_raises_entropy: ClassVar[int] = 1

    ratio: float = param(2e-4, "fraction of tokens to zero, max(int(ratio*N), 1); 0 = none", ge=0, le=1)
    lb: float = param(1.0, "lower covariance bound (exclusive)", rule="any finite number < ub")
    ub: float = param(5.0, "upper covariance bound (exclusive)", rule="any finite number > lb")
    exclude_clipped: bool = param(True, "never pick tokens PPO clipping already removed (reference code)")

    def validate(self) -> None:
        if not self.lb < self.ub:
            raise ValueError(f"lb must be < ub, got lb={self.lb!r}, ub={self.ub!r}")

    def minibatch_masks(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                        clipped: Tensor | None = None, generator: torch.Generator | None = None,
                        reduce: Reductions = LOCAL) -> Masks:
        exclude = clipped if self.exclude_clipped else None
        keep = clip_cov_mask(logp.detach(), advantages, mask, self.ratio, self.lb, self.ub,
                             generator=generator, exclude=exclude, reduce=reduce)
        return Masks(zeroed=mask & ~keep)


@register_method
@dataclass
class KLCov(Method):
    """KL-Cov (Paper B, Sec. 4.2).

    Loss −A·r with no ratio clip; the top max(int(ratio·N), 1) tokens by cov_t additionally get
    coef·|logp − old_logp|. On a strictly on-policy step logp == old_logp, so the term has no effect.
    Paper: ratio 2e-4 (2e-3 for 7B), coef 1.
    """

    name: ClassVar[str] = "kl_cov"
    paper: ClassVar[str] = PAPER_B
    summary: ClassVar[str] = "no ratio clip; coef·|logp − old_logp| on the top ratio·N tokens by Cov(logp, A)"
    stage: ClassVar[str] = "minibatch"
    exchange: ClassVar[str | None] = "covariance_top_k"
    masks: ClassVar[tuple[str, ...]] = ("kl_cov_select",)
    reads: ClassVar[tuple[str, ...] | None] = ()
    quadrants: ClassVar[dict[str, str]] = {"pos_spos": "adds a KL pull (top Cov)",
                                           "neg_sneg": "adds a KL pull (top Cov)", "all": "changes the clip (none)"}
    knob: ClassVar[str | None] = "ratio"
    knob_raises_entropy: ClassVar[int] = 1

    ratio: float = param(2e-4, "fraction of tokens penalised, max(int(ratio*N), 1); 0 = none (2e-3 for 7B)", ge=0,
                         le=1)
    coef: float = param(1.0, "coefficient of |logp - old_logp| on the selected tokens", ge=0)

    def loss_overrides(self) -> LossOverrides:
        return LossOverrides(eps_low=None, eps_high=None, kl_cov_coef=float(self.coef))

    def minibatch_masks(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                        clipped: Tensor | None = None, generator: torch.Generator | None = None,
                        reduce: Reductions = LOCAL) -> Masks:
        return Masks(kl_cov_select=kl_cov_select(logp.detach(), advantages, mask, self.ratio, reduce=reduce))
