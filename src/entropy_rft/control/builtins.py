"""The built-in entropy-control methods. Each docstring gives the rule and its paper.

Knob directions: ``knob_raises_entropy = +1`` when increasing the knob raises entropy (more control),
-1 when it lowers it. For ClipB/ClipV a larger mu drops fewer tokens, so less control (-1).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import (
    ADVANTAGE_SIGNS,
    broadcast_advantages,
    check_fraction,
    check_level,
    check_mu,
    check_sign,
    masked_mean_std,
)
from entropy_rft.control.masks import (
    clip_b_mask,
    clip_cov_mask,
    clip_v_mask,
    grad_mask,
    high_entropy_mask,
    kl_cov_select,
)
from entropy_rft.control.registry import Masks, Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

PAPER_A = "Wang et al. 2026, On the Entropy Dynamics in RFT of LLMs, arXiv 2602.03392"
PAPER_B = "Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs, arXiv 2505.22617"
DAPO = "Yu et al. 2025, DAPO, arXiv 2503.14476"
EIGHTY_TWENTY = "Wang et al. 2025, Beyond the 80/20 Rule, arXiv 2506.01939"
ENTROPY_BONUS = "Williams & Peng 1991; Mnih et al. 2016 (A3C), arXiv 1602.01783"
CHENG = "Cheng et al. 2025, Reasoning with Exploration: An Entropy Perspective, arXiv 2506.14758"
SKYWORK = ("He et al. 2025, Skywork Open Reasoner 1 Technical Report, arXiv 2505.22312 (code: "
           "github.com/SkyworkAI/Skywork-OR1); the rule as TRL 1.16's GRPOTrainer implements it "
           "(use_adaptive_entropy)")
CE_GPPO = ("Su et al. 2025, CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping, arXiv 2509.20712 "
           "(code: github.com/Kwai-Klear/CE-GPPO)")
CLIP_LOW = "Park et al. 2025, Clip-Low Increases Entropy and Clip-High Decreases Entropy, arXiv 2509.26114"
ENTROPIC = ("Yang et al. 2025, EntroPIC: entropy stabilization with proportional-integral control, "
            "arXiv 2511.15248 (code: github.com/yk7333/EntroPIC)")


def _check_number(value: Any, name: str, *, low: float | None = None, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if not ok or value in (float("inf"), float("-inf")):
        bound = "" if low is None else f" {'>' if strict else '>='} {low}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")


def _check_required_mu(value: Any, name: str) -> None:
    if value is None:
        raise ValueError(f"{name} must be a finite number >= 0, got None")
    check_mu(value, name)


class _TwoSidedMu:
    """Knob "mu" over (mu_low, mu_high): get returns the common value, set moves every bounded side."""

    mu_low: float | None
    mu_high: float | None

    def get_knob(self) -> float:
        sides = {v for v in (self.mu_low, self.mu_high) if v is not None}
        if len(sides) != 1:
            raise ValueError(f"knob 'mu' is ambiguous with mu_low={self.mu_low!r}, mu_high={self.mu_high!r}")
        return float(sides.pop())

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
    quadrants: ClassVar[dict[str, str]] = {"neg_spos": "drops (S far below its mean)",
                                           "neg_sneg": "drops (S far below its mean)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu: float = param(2.5, "threshold in batch stds of S (paper sweeps 2.0-3.0)")
    advantage_sign: str = param("negative", "which tokens may be dropped (negative = A<0 strictly)",
                                ADVANTAGE_SIGNS)

    def validate(self) -> None:
        _check_required_mu(self.mu, "mu")
        check_sign(self.advantage_sign)

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        return Masks(keep=clip_b_mask(stats.s_star, advantages, mask, self.mu, None, self.advantage_sign))


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
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (S in a tail)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu_low: float | None = param(2.5, "lower threshold in stds of S (None = unbounded)")
    mu_high: float | None = param(2.5, "upper threshold in stds of S (None = unbounded)")
    advantage_sign: str = param("any", "which tokens may be dropped", ADVANTAGE_SIGNS)

    def validate(self) -> None:
        check_mu(self.mu_low, "mu_low")
        check_mu(self.mu_high, "mu_high")
        check_sign(self.advantage_sign)

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        return Masks(keep=clip_b_mask(stats.s_star, advantages, mask, self.mu_low, self.mu_high,
                                      self.advantage_sign))


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


def _warn_tiny_cap(method: Method, n_tokens: int) -> None:
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
    """ClipV, released one-sided rule with cap (Paper A's reference code).

    S_c = S_k − E_p[S] (Theorem 3.3), s_c its population std over the batch's valid tokens. A token with
    A < 0 is a violator when S_c < −mu·s_c; if more than K = max(int(max_frac·N), 1) violate, only the K
    farthest past the threshold are dropped. The released code also lets A == 0 tokens be dropped and take
    cap slots; we default to "negative" (A < 0 strictly, as DESIGN.md fixes) because A == 0 tokens carry
    no gradient, so dropping them only changes the token count and wastes cap slots on no-op tokens. Set
    advantage_sign="any" to reproduce the released counting exactly. Paper sweep mu 7.5–8.5.
    """

    name: ClassVar[str] = "clip_v"
    paper: ClassVar[str] = PAPER_A
    summary: ClassVar[str] = "drop A<0 tokens with S_c < −mu·std(S_c), capped (released ClipV)"
    stage: ClassVar[str] = "rollout"
    quadrants: ClassVar[dict[str, str]] = {"neg_sneg": "drops (S_c < −mu·std)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu: float = param(8.5, "threshold in batch stds of S_c (paper sweeps 7.5-8.5; tuned for 7B models)")
    max_frac: float | None = param(1e-4, "cap: drop at most K = max(int(max_frac*N), 1); None = no cap")
    advantage_sign: str = param("negative", "which tokens may be dropped (negative = A<0 strictly)",
                                ADVANTAGE_SIGNS)

    def validate(self) -> None:
        _check_required_mu(self.mu, "mu")
        if self.max_frac is not None:
            check_fraction(self.max_frac, "max_frac")
        check_sign(self.advantage_sign)

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        _warn_tiny_cap(self, int(mask.sum()))
        return Masks(keep=clip_v_mask(stats.s_centered, advantages, mask, self.mu, None, self.advantage_sign,
                                      self.max_frac))


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
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (S_c in a tail)"}
    knob: ClassVar[str | None] = "mu"
    knob_raises_entropy: ClassVar[int] = -1

    mu_low: float | None = param(8.5, "lower threshold in stds of S_c (None = unbounded)")
    mu_high: float | None = param(8.5, "upper threshold in stds of S_c (None = unbounded)")
    advantage_sign: str = param("any", "which tokens may be dropped", ADVANTAGE_SIGNS)
    max_frac: float | None = param(None, "cap on the dropped fraction; None = no cap")

    def validate(self) -> None:
        check_mu(self.mu_low, "mu_low")
        check_mu(self.mu_high, "mu_high")
        check_sign(self.advantage_sign)
        if self.max_frac is not None:
            check_fraction(self.max_frac, "max_frac")

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        _warn_tiny_cap(self, int(mask.sum()))
        return Masks(keep=clip_v_mask(stats.s_centered, advantages, mask, self.mu_low, self.mu_high,
                                      self.advantage_sign, self.max_frac))


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
    quadrants: ClassVar[dict[str, str]] = {"pos_spos": "zeroes (high Cov: likely tokens, A>0)",
                                           "neg_sneg": "zeroes (high Cov: unlikely tokens, A<0)"}
    knob: ClassVar[str | None] = "ratio"
    knob_raises_entropy: ClassVar[int] = 1

    ratio: float = param(2e-4, "fraction of tokens to zero, max(int(ratio*N), 1); 0 = none")
    lb: float = param(1.0, "lower covariance bound (exclusive)")
    ub: float = param(5.0, "upper covariance bound (exclusive)")
    exclude_clipped: bool = param(True, "never pick tokens PPO clipping already removed (reference code)")

    def validate(self) -> None:
        check_fraction(self.ratio, "ratio")
        _check_number(self.lb, "lb")
        _check_number(self.ub, "ub")
        if not self.lb < self.ub:
            raise ValueError(f"lb must be < ub, got lb={self.lb!r}, ub={self.ub!r}")
        if not isinstance(self.exclude_clipped, bool):
            raise ValueError(f"exclude_clipped must be a bool, got {self.exclude_clipped!r}")

    def minibatch_masks(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                        clipped: Tensor | None = None, generator: torch.Generator | None = None) -> Masks:
        exclude = clipped if self.exclude_clipped else None
        keep = clip_cov_mask(logp.detach(), advantages, mask, self.ratio, self.lb, self.ub,
                             generator=generator, exclude=exclude)
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
    quadrants: ClassVar[dict[str, str]] = {"pos_spos": "adds a KL pull (top Cov)",
                                           "neg_sneg": "adds a KL pull (top Cov)", "all": "changes the clip (none)"}
    knob: ClassVar[str | None] = "ratio"
    knob_raises_entropy: ClassVar[int] = 1

    ratio: float = param(2e-4, "fraction of tokens penalised, max(int(ratio*N), 1); 0 = none (2e-3 for 7B)")
    coef: float = param(1.0, "coefficient of |logp - old_logp| on the selected tokens")

    def validate(self) -> None:
        check_fraction(self.ratio, "ratio")
        _check_number(self.coef, "coef", low=0.0)

    def loss_kwargs(self) -> dict[str, Any]:
        return {"eps_low": None, "eps_high": None, "kl_cov_coef": float(self.coef)}

    def minibatch_masks(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                        clipped: Tensor | None = None, generator: torch.Generator | None = None) -> Masks:
        return Masks(kl_cov_select=kl_cov_select(logp.detach(), advantages, mask, self.ratio))


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

    eps_low: float = param(0.2, "lower ratio clip, r >= 1 - eps_low")
    eps_high: float = param(0.28, "upper ratio clip, r <= 1 + eps_high")

    def validate(self) -> None:
        _check_number(self.eps_low, "eps_low", low=0.0)
        _check_number(self.eps_high, "eps_high", low=0.0)

    def loss_kwargs(self) -> dict[str, Any]:
        return {"eps_low": float(self.eps_low), "eps_high": float(self.eps_high)}


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

    coef: float = param(1e-3, "entropy coefficient")

    def validate(self) -> None:
        _check_number(self.coef, "coef", low=0.0)

    def loss_kwargs(self) -> dict[str, Any]:
        return {"entropy_coef": float(self.coef)}

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
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (low-entropy positions)"}
    knob: ClassVar[str | None] = "top_q"
    knob_raises_entropy: ClassVar[int] = -1

    top_q: float = param(0.2, "fraction of highest-entropy tokens kept (1 = vanilla)")

    def validate(self) -> None:
        check_fraction(self.top_q, "top_q")

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
    quadrants: ClassVar[dict[str, str]] = {"all": "drops (by sign(A), sign(S))"}

    sample_sign: str = param("positive", "samples whose tokens are masked by S: A>0 or A<0",
                             ("positive", "negative"))
    s_sign: str = param("positive", "sign of S kept within those samples", ("positive", "negative"))
    s_field: str = param("s_star", "which discriminator: s_star (S) or s_centered (S_c)",
                         ("s_star", "s_centered"))
    drop_other_samples: bool = param(True, "drop tokens of the other samples (else they train normally)")

    def validate(self) -> None:
        check_sign(self.sample_sign, "sample_sign", ("positive", "negative"))
        check_sign(self.s_sign, "s_sign", ("positive", "negative"))
        check_sign(self.s_field, "s_field", ("s_star", "s_centered"))
        if not isinstance(self.drop_other_samples, bool):
            raise ValueError(f"drop_other_samples must be a bool, got {self.drop_other_samples!r}")

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        s = getattr(stats, self.s_field)
        return Masks(keep=grad_mask(s, advantages, mask, self.sample_sign, self.s_sign,
                                    self.drop_other_samples))


# ----------------------------------------------------------------------------- the field's methods (issue 28)


def _resolve_level(level: tuple[float, bool] | None, base: float | None) -> float | None:
    """A checked ``check_level`` value in nats (relative levels times ``base``, the first measured entropy)."""
    if level is None:
        return None
    value, relative = level
    return value * base if relative else value


@register_method
@dataclass
class EntropyAdvantage(Method):
    """Entropy-based advantage shaping (Cheng et al. 2025, arXiv 2506.14758, the method section's shaped advantage).

    ψ_t = min(alpha·H_t, |A_t|/kappa) with H_t the token's entropy, detached (no gradient flows through it), and
    the surrogate uses A_t + ψ_t in place of A_t (``loss.policy_loss``'s ``adv_shift``). The clip |A_t|/kappa
    (kappa > 1) keeps the sign of A: a penalty is softened, never turned into a reward; A_t == 0 gives ψ_t = 0.
    H_t is the old policy's entropy (``TokenStats.entropy``), which on a step's first update is the current
    policy's. Through the lens it reweights every A ≠ 0 token by (A + ψ)/A: up on positive samples, down on
    negative ones, most where the entropy is high. The paper presents it as exploration that does not raise
    entropy for its own sake; the knob's direction (+1: a larger alpha raises entropy) is its intent and what the
    autopilot assumes, not a theorem (Theorem 3.3 gives the term −ψ·S_c, of either sign).

    Sources, as checked for issue 28: only the paper's abstract and first page (arXiv HTML v1/v3) and third-party
    summaries could be read here, and no code of the authors was found. Those confirm the ingredients (a per-token
    term from the entropy, gradient-detached, clipped so that it cannot reverse the advantage's sign, added to
    the PPO/GRPO advantage), not the exact formula: **the paper's equation numbers are not cited because they
    could not be read, and the min(·, |A|/kappa) form and the defaults alpha 0.4, kappa 2 are unverified** (the
    developer's reading of the paper; no table of its hyperparameters was reachable).
    """

    name: ClassVar[str] = "entropy_adv"
    paper: ClassVar[str] = CHENG
    summary: ClassVar[str] = "add ψ = min(alpha·H_detached, |A|/kappa) to each token's advantage"
    stage: ClassVar[str] = "rollout"
    knob: ClassVar[str | None] = "alpha"
    knob_raises_entropy: ClassVar[int] = 1
    quadrants: ClassVar[dict[str, str]] = {
        "pos_spos": "reweights up (A + ψ)", "pos_sneg": "reweights up (A + ψ)",
        "neg_spos": "reweights down (|A| − ψ)", "neg_sneg": "reweights down (|A| − ψ)"}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    alpha: float = param(0.4, "scale of the entropy term alpha·H (0.4: unverified against the paper)")
    kappa: float = param(2.0, "clip: ψ <= |A|/kappa; must be > 1 so the shaped advantage keeps A's sign "
                              "(2: unverified against the paper)")

    def validate(self) -> None:
        _check_number(self.alpha, "alpha", low=0.0)
        _check_number(self.kappa, "kappa", low=1.0, strict=True)

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        return Masks(adv_shift=entropy_advantage_shift(stats.entropy, advantages, mask, self.alpha, self.kappa))


def entropy_advantage_shift(entropy: Tensor, advantages: Tensor, mask: Tensor, alpha: float,
                            kappa: float) -> Tensor:
    """ψ = min(alpha·H_detached, |A|/kappa) on valid tokens, 0 elsewhere, float32.

    Cheng et al. 2025 (arXiv 2506.14758), the shaped advantage A + ψ of its method section; the paper's equation
    number is not cited (its full text could not be read here; see ``EntropyAdvantage``)."""
    adv = broadcast_advantages(advantages, mask).detach().to(torch.float32)
    psi = torch.minimum(alpha * entropy.detach().to(torch.float32), adv.abs() / kappa)
    return torch.where(mask, psi, torch.zeros_like(psi))


@register_method
@dataclass
class AdaptiveEntropy(Method):
    """Adaptive entropy coefficient (Skywork-OR1), the control law as TRL 1.16's GRPOTrainer runs it.

    An entropy bonus −c·H (as ``entropy_bonus``) whose coefficient follows its own bang-bang controller, once per
    step on the mean token entropy H_t of the step's batch (old policy, tokens that train; TRL: the current
    policy's over the loss's tokens, the same numbers on a step's first update):

    - the coefficient applied at step t is c_{t−1} if H_{t−1} <= target, else 0 (H_0 = +inf, so step 1 applies 0);
    - then c_t = min(c_{t−1} + delta, coef_max) if H_t <= target, else max(c_{t−1} − delta, coef_min).

    TRL updates once per optimizer step; here once per rollout batch (the same with one update per batch).
    ``target`` None switches the controller off (a fixed bonus ``coef``). With ``method.entropy_target`` the
    autopilot drives ``coef`` instead (its PI law in log space replaces this one, and the bonus always applies).

    Sources, as checked for issue 28. The paper's full text could not be read here (only its abstract and first
    page), so its equation numbers are not cited. The authors' released code was read (github.com/SkyworkAI/
    Skywork-OR1: ``EntController`` in ``verl/trainer/ppo/core_algos.py``, applied in ``dp_actor.py``, stepped in
    ``ray_trainer.py`` after each training step on the update's mean token entropy): it is this law with two
    differences, both kept here as TRL has them: it tests H < target strictly (TRL and we: <=; they differ only
    when H equals the target exactly), and its first step applies the initial coefficient (TRL and we: 0,
    H_0 = +inf; the same when the initial coefficient is 0, as in its released scripts).
    ``tests/test_field_methods.py`` checks both peers. Defaults are TRL 1.16's (target 0.2, delta 0.005, coef_min
    0, coef_max 1.0), with coef 1e-3, not TRL's 0.0, so the autopilot (log space) can start from it. **They are
    not Skywork-OR1's published values**: its released training scripts (``or1_scripts/train/*.sh``) use target
    0.2, delta 1e-4, coef_min 0, coef_max 0.005 and an initial coefficient 0, for runs of hundreds to thousands
    of steps (set them with ``--set method.params.delta=1e-4`` etc.; on this project's short runs a 1e-4 step
    barely moves the coefficient).
    """

    name: ClassVar[str] = "adaptive_entropy"
    paper: ClassVar[str] = SKYWORK
    summary: ClassVar[str] = "entropy bonus whose coefficient steps ±delta toward an entropy target (TRL rule)"
    knob: ClassVar[str | None] = "coef"
    knob_raises_entropy: ClassVar[int] = 1
    quadrants: ClassVar[dict[str, str]] = {"all": "adds gradient through H (coefficient from its own controller)"}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    coef: float = param(1e-3, "entropy coefficient, initial value (TRL entropy_coef); the knob")
    target: float | str | None = param(0.2, "entropy target in nats (TRL entropy_target) or '0.9x' (times the "
                                            "first batch's entropy); None: no own controller, a fixed bonus")
    delta: float = param(0.005, "coefficient step per update (TRL entropy_coef_delta; Skywork-OR1's scripts: "
                                "1e-4)")
    coef_min: float = param(0.0, "lower bound of the coefficient (TRL entropy_coef_min; Skywork-OR1: 0)")
    coef_max: float = param(1.0, "upper bound of the coefficient (TRL entropy_coef_max; Skywork-OR1's "
                                 "scripts: 0.005)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._last_h = math.inf  # TRL's _last_world_entropy
        self._applied: float | None = None  # None: no controller step yet (or the autopilot drives coef)
        self._base: float | None = None

    def validate(self) -> None:
        for name in ("coef", "delta", "coef_min", "coef_max"):
            _check_number(getattr(self, name), name, low=0.0)
        if not self.coef_min <= self.coef_max:
            raise ValueError(f"coef_min must be <= coef_max, got {self.coef_min!r} > {self.coef_max!r}")
        check_level(self.target, "target")

    def observe(self, stats: TokenStats, mask: Tensor, agg: str) -> dict[str, Any]:
        target_level = check_level(self.target, "target")
        h = adaptive_entropy_measure(stats.entropy, mask)
        if target_level is None or h is None:
            return {}
        if self._base is None:
            self._base = h
        target = _resolve_level(target_level, self._base)
        self._applied, self.coef = adaptive_entropy_step(self.coef, self._last_h, h, target, self.delta,
                                                         self.coef_min, self.coef_max)
        self._last_h = h
        return {"control/own_entropy": h, "control/own_target": target, "control/own_output": self._applied}

    def loss_kwargs(self) -> dict[str, Any]:
        return {"entropy_coef": float(self.coef if self._applied is None else self._applied)}

    def needs_entropy_grad(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"last_h": self._last_h, "applied": self._applied, "base": self._base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_h, self._applied, self._base = state["last_h"], state["applied"], state["base"]


def adaptive_entropy_measure(entropy: Tensor, mask: Tensor) -> float | None:
    """Σ H·m / Σ m over the tokens, float64; None with no token. TRL's world entropy and Skywork-OR1's
    ``actor/entropy_loss`` (a masked token mean) both take this mean."""
    mean, _, n = masked_mean_std(entropy, mask)
    return float(mean) if n else None


def adaptive_entropy_step(coef: float, last_h: float, h: float, target: float, delta: float, coef_min: float,
                          coef_max: float) -> tuple[float, float]:
    """One step of the adaptive coefficient: (applied now, next coefficient). Applied: ``coef`` when the
    previous step's entropy ``last_h`` <= target, else 0; next: coef ± delta by ``h`` against the target,
    clamped to [coef_min, coef_max].

    TRL 1.16 ``GRPOTrainer._compute_loss`` exactly. Skywork-OR1's ``EntController.update`` (its released code;
    the paper's equation numbers could not be read here) is the same law with a strict ``<`` in both tests."""
    applied = coef if last_h <= target else 0.0
    nxt = min(coef + delta, coef_max) if h <= target else max(coef - delta, coef_min)
    return applied, nxt


@register_method
@dataclass
class CEGPPO(Method):
    """CE-GPPO (Su et al. 2025): gradient-preserving clipping with two factors.

    Tokens PPO's ratio clip removes keep a bounded gradient through a stop-gradient: for A < 0 and
    r < 1 − eps_low the token's gradient is −beta_low·(1 − eps_low)·A·∇log π, for A > 0 and r > 1 + eps_high it is
    −beta_high·(1 + eps_high)·A·∇log π (the paper's β·b·A·r/sg(r) term); inside the clip range the loss is PPO's.
    beta 0 is PPO, beta_low = beta_high = 1 is GPPO (Klear-Reasoner). The clip bounds are the run's
    (``algo.eps_low``/``algo.eps_high``). Through the lens it adds gradient to clipped tokens: A > 0 tokens whose
    probability rose past the bound (mostly unlikely ones, S_c < 0: entropy up, beta_high) and A < 0 tokens whose
    probability fell past it (entropy down, beta_low). Knob beta_high, raising entropy. On a single update per
    rollout batch nothing is clipped (r = 1), so it acts only with several minibatches or PPO epochs.

    Sources, as checked for issue 28. The paper's full text could not be read here (only its abstract and first
    page), so its equation numbers are not cited. The authors' released code was read (github.com/Kwai-Klear/
    CE-GPPO, ``compute_gppo_loss_general_beta`` in ``verl/trainer/ppo/core_algos.py``, also quoted in its README):
    its token loss is −beta1·(1 − eps_low)·A·r/sg(r) for A < 0, r < 1 − eps_low; −beta2·(1 + eps_high)·A·r/sg(r)
    for A > 0, r > 1 + eps_high; −A·r otherwise; then dual clip min(·, −A·c) on A < 0. Our gradient is that one
    on every token (``tests/test_field_methods.py`` checks it against a transcription of that function). One
    deviation, in the forward value only: a clipped token's loss value here is PPO's −(1 ± eps)·A, theirs is
    −beta·(1 ± eps)·A, so ``loss/pg`` and ``loss/total`` differ from theirs by (1 − beta)·(1 ± eps)·|A| per
    clipped token (times its aggregation weight) while no gradient changes; kept so that the logged loss does not
    depend on beta. Defaults beta_low 0.75, beta_high 1.0 are the authors' README example and their 7B training
    script (``recipe/dapo/7B_perf_run_gppo_v1_beta1_075_beta2_1_ours_math.sh``); their 1.5B script uses
    beta_low 0.5 and the code's default is 0.25; all use beta_high 1 and eps_low = eps_high = 0.2.
    """

    name: ClassVar[str] = "ce_gppo"
    paper: ClassVar[str] = CE_GPPO
    summary: ClassVar[str] = "clipped tokens keep a bounded gradient beta·(1±eps)·A (stop-gradient), beta_low/high"
    knob: ClassVar[str | None] = "beta_high"
    knob_raises_entropy: ClassVar[int] = 1
    quadrants: ClassVar[dict[str, str]] = {
        "pos_sneg": "adds gradient (beta_high, A>0 past 1+eps_high)",
        "pos_spos": "adds gradient (beta_high, A>0 past 1+eps_high)",
        "neg_sneg": "adds gradient (beta_low, A<0 below 1−eps_low)",
        "neg_spos": "adds gradient (beta_low, A<0 below 1−eps_low)"}

    beta_low: float = param(0.75, "beta1: gradient factor of A<0 tokens below 1 − eps_low (0 = PPO; authors' "
                                  "7B script 0.75, 1.5B script 0.5)")
    beta_high: float = param(1.0, "beta2: gradient factor of A>0 tokens above 1 + eps_high (0 = PPO; authors' "
                                  "scripts 1)")

    def validate(self) -> None:
        _check_number(self.beta_low, "beta_low", low=0.0)
        _check_number(self.beta_high, "beta_high", low=0.0)

    def loss_kwargs(self) -> dict[str, Any]:
        return {"ce_beta_low": float(self.beta_low), "ce_beta_high": float(self.beta_high)}


@register_method
@dataclass
class ClipLow(Method):
    """Clip-low as the entropy knob (Park et al. 2025): the asymmetric ratio clip r ∈ [1 − eps_low, 1 + eps_high]
    steered by eps_low.

    The paper's finding is in its title: clipping at the low bound raises entropy, clipping at the high bound
    lowers it. A smaller eps_low clips more A < 0 tokens whose probability fell (mostly unlikely ones, S_c < 0,
    whose further push would lower entropy by Theorem 3.3: −A·S_c < 0), so a larger eps_low lowers entropy
    (knob direction −1). Like clip-higher it acts only off-policy (several minibatches or epochs).

    Sources, as checked for issue 28. The paper's full text could not be read here (only its abstract and first
    page and third-party summaries; no code of the authors was found), so its equation and theorem numbers are
    not cited. The rule itself is PPO's clip (Schulman et al. 2017, Eq. 7) with separate bounds, as DAPO's
    clip-higher; what the paper adds is the direction, stated in its title and abstract (clip-low raises
    entropy, clip-high lowers it; tightening clip-low, i.e. a smaller eps_low, raises entropy), which the knob's
    sign follows. **The defaults eps_low 0.1, eps_high 0.2 are ours, not the paper's**: its experimental clip
    values could not be read.
    """

    name: ClassVar[str] = "clip_low"
    paper: ClassVar[str] = CLIP_LOW
    summary: ClassVar[str] = "asymmetric PPO ratio clip steered by its lower bound (tighter clip-low: more entropy)"
    knob: ClassVar[str | None] = "eps_low"
    knob_raises_entropy: ClassVar[int] = -1
    quadrants: ClassVar[dict[str, str]] = {"neg_sneg": "changes the clip (lower bound, A<0 tokens falling)",
                                           "neg_spos": "changes the clip (lower bound)"}

    eps_low: float = param(0.1, "lower ratio clip, r >= 1 - eps_low, in [0, 1) (0.1: ours, not the paper's)")
    eps_high: float = param(0.2, "upper ratio clip, r <= 1 + eps_high (0.2: PPO's usual value)")

    def validate(self) -> None:
        _check_number(self.eps_low, "eps_low", low=0.0)
        if not self.eps_low < 1:
            raise ValueError(f"eps_low must be < 1 (r >= 1 - eps_low > 0), got {self.eps_low!r}")
        _check_number(self.eps_high, "eps_high", low=0.0)

    def loss_kwargs(self) -> dict[str, Any]:
        return {"eps_low": float(self.eps_low), "eps_high": float(self.eps_high)}


@register_method
@dataclass
class EntropicControl(Method):
    """EntroPIC (Yang et al. 2025): a PI controller on the loss weights of positive and negative samples.

    The loss gains alpha·agg(−r·|A|) over the high-probability tokens (p > high_prob, the authors'
    simplification: only those move the entropy much; ``loss.policy_loss``'s ``weight_select``/``weight_alpha``),
    so alpha > 0 weighs them up in positive samples and down in negative samples (entropy falls), alpha < 0 the
    reverse. Its own control law, once per step on the batch entropy H_t (the loss's aggregation of the old
    policy's token entropy over the tokens that train; the authors: the current policy's, per micro-batch):

        e_t = H_t − target,   alpha_t = clip(kp·e_t + ki·I_{t−1}, −1, 1),   I_t = I_{t−1} + e_t,

    as the authors' ``dp_actor.py`` computes it (integral before the update; defaults kp 1, ki 0.01, high_prob
    0.95 from their ``config/entropic.yaml`` and ``core_algos.py``). ``target`` None switches the controller off
    (alpha stays as set). With ``method.entropy_target`` our autopilot drives the knob instead: ``pos_weight`` =
    1 + alpha in (0, 2], the weight of positive high-probability tokens relative to vanilla (raising it lowers
    entropy), moved in log space by the autopilot's PI law. The high-probability test uses the old policy's
    probability of the sampled token (the authors: the current one; equal on a step's first update).

    Sources, as checked for issue 28. The paper's full text could not be read here (only its abstract and first
    page and the project page), so its equation numbers are not cited. The authors' released code was read
    (github.com/yk7333/EntroPIC: the PI step in ``dp_actor.py``, the adjustment in ``core_algos.py``, both also
    quoted in its README), and ``tests/test_field_methods.py`` checks the loss and the alpha sequence against
    transcriptions of it. Defaults kp 1, ki 0.01 are its ``config/entropic.yaml`` and ``run_entropic.sh``;
    high_prob 0.95 its ``core_algos.py``. Deviations: the authors' integral grows by e·(micro-batch size /
    mini-batch size) per micro-batch (ours: by e once per step, the same with one micro-batch per mini-batch);
    their target is absolute (``run_entropic.sh``: 0.1 nats; the config default −1 switches it off), ours
    defaults to "1.0x", the first batch's entropy, since an absolute target depends on the model and task.
    """

    name: ClassVar[str] = "entropic"
    paper: ClassVar[str] = ENTROPIC
    summary: ClassVar[str] = ("PI control of entropy by the loss weight of high-probability tokens of positive "
                              "vs negative samples")
    stage: ClassVar[str] = "rollout"
    knob: ClassVar[str | None] = "pos_weight"
    knob_raises_entropy: ClassVar[int] = -1
    quadrants: ClassVar[dict[str, str]] = {"pos_spos": "reweights (+alpha on p > high_prob)",
                                           "neg_spos": "reweights (−alpha on p > high_prob)"}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    alpha: float = param(0.0, "adjustment weight in [-1, 1] (>0 lowers entropy); the controller's output")
    target: float | str | None = param("1.0x", "entropy target in nats or '0.9x' (times the first batch's "
                                               "entropy; authors' script: 0.1 nats); None: no own "
                                               "controller, alpha fixed")
    kp: float = param(1.0, "proportional gain (authors: entropy_control_p 1)")
    ki: float = param(0.01, "integral gain (authors: entropy_control_i 0.01)")
    high_prob: float = param(0.95, "probability above which a token is adjusted (authors: 0.95)")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._integral = 0.0
        self._base: float | None = None

    def validate(self) -> None:
        _check_number(self.alpha, "alpha")
        if not -1.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [-1, 1] (pos_weight = 1 + alpha in [0, 2]), got {self.alpha!r}")
        check_level(self.target, "target")
        _check_number(self.kp, "kp", low=0.0)
        _check_number(self.ki, "ki", low=0.0)
        _check_number(self.high_prob, "high_prob", low=0.0, strict=True)
        if not self.high_prob < 1:
            raise ValueError(f"high_prob must be in (0, 1), got {self.high_prob!r}")

    def get_knob(self) -> float:
        return 1.0 + float(self.alpha)

    def _apply_knob(self, value: float) -> None:
        self.alpha = value - 1.0

    def observe(self, stats: TokenStats, mask: Tensor, agg: str) -> dict[str, Any]:
        from entropy_rft.core.loss import aggregate

        target_level = check_level(self.target, "target")
        if target_level is None or not bool(mask.any()):
            return {}
        h = float(aggregate(stats.entropy.detach().to(torch.float64), mask, agg))
        if self._base is None:
            self._base = h
        target = _resolve_level(target_level, self._base)
        self.alpha, self._integral = entropic_step(h, target, self._integral, self.kp, self.ki)
        return {"control/own_entropy": h, "control/own_target": target, "control/own_output": self.alpha,
                "control/own_integral": self._integral}

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        return Masks(weight_select=mask & (stats.logp.detach() > math.log(self.high_prob)))

    def loss_kwargs(self) -> dict[str, Any]:
        return {"weight_alpha": float(self.alpha)}

    def state_dict(self) -> dict[str, Any]:
        # alpha itself too: the knob 1 + alpha does not give alpha back bit for bit
        return {"integral": self._integral, "base": self._base, "alpha": self.alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._integral, self._base = float(state["integral"]), state["base"]
        self.alpha = float(state.get("alpha", self.alpha))


def entropic_step(h: float, target: float, integral: float, kp: float, ki: float) -> tuple[float, float]:
    """EntroPIC's PI law: (alpha_t, I_t) with e = h − target, alpha_t = clip(kp·e + ki·I_{t−1}, −1, 1),
    I_t = I_{t−1} + e.

    Yang et al. 2025 (arXiv 2511.15248) as the authors' ``dp_actor.py`` computes it (integral before the update,
    one micro-batch per mini-batch); the paper's equation number is not cited (its full text could not be read
    here; see ``EntropicControl``)."""
    e = h - target
    alpha = min(1.0, max(-1.0, kp * e + ki * integral))
    return alpha, integral + e
