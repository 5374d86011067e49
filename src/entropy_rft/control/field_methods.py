"""The field's entropy-control methods: entropy-based advantage shaping (Cheng et al.), the adaptive
entropy coefficient (Skywork-OR1, as TRL runs it), CE-GPPO, clip-low as the knob (Park et al.) and EntroPIC, with
the pure control laws of the ones that carry their own controller. Each docstring gives the rule, its paper and
how far it was checked.

Knob directions as in :mod:`entropy_rft.control.paper_methods`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import (
    LEVEL_RULE,
    broadcast_advantages,
    check_level,
    masked_mean_std,
    resolve_level,
)
from entropy_rft.control.registry import LossOverrides, Masks, Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

CHENG = "Cheng et al. 2025, Reasoning with Exploration: An Entropy Perspective, arXiv 2506.14758"
SKYWORK = ("He et al. 2025, Skywork Open Reasoner 1 Technical Report, arXiv 2505.22312 (code: "
           "github.com/SkyworkAI/Skywork-OR1); the rule as TRL 1.16's GRPOTrainer implements it "
           "(use_adaptive_entropy)")
CE_GPPO = ("Su et al. 2025, CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping, arXiv 2509.20712 "
           "(code: github.com/Kwai-Klear/CE-GPPO)")
CLIP_LOW = "Park et al. 2025, Clip-Low Increases Entropy and Clip-High Decreases Entropy, arXiv 2509.26114"
ENTROPIC = ("Yang et al. 2025, EntroPIC: entropy stabilization with proportional-integral control, "
            "arXiv 2511.15248 (code: github.com/yk7333/EntroPIC)")


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

    Sources, as checked: only the paper's abstract and first page (arXiv HTML v1/v3) and third-party
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
    exchange: ClassVar[str | None] = "local"
    masks: ClassVar[tuple[str, ...]] = ("adv_shift",)
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)
    knob: ClassVar[str | None] = "alpha"
    knob_raises_entropy: ClassVar[int] = 1
    quadrants: ClassVar[dict[str, str]] = {
        "pos_spos": "reweights up (A + ψ)", "pos_sneg": "reweights up (A + ψ)",
        "neg_spos": "reweights down (|A| − ψ)", "neg_sneg": "reweights down (|A| − ψ)"}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    alpha: float = param(0.4, "scale of the entropy term alpha·H (0.4: unverified against the paper)", ge=0)
    kappa: float = param(2.0, "clip: ψ <= |A|/kappa; must be > 1 so the shaped advantage keeps A's sign "
                              "(2: unverified against the paper)", gt=1)

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

    Sources, as checked. The paper's full text could not be read here (only its abstract and first
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
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)  # observe: the batch entropy

    coef: float = param(1e-3, "entropy coefficient, initial value (TRL entropy_coef); the knob", ge=0)
    target: float | str | None = param(0.2, "entropy target in nats (TRL entropy_target) or '0.9x' (times the "
                                            "first batch's entropy); None: no own controller, a fixed bonus",
                                       rule=LEVEL_RULE)
    delta: float = param(0.005, "coefficient step per update (TRL entropy_coef_delta; Skywork-OR1's scripts: "
                                "1e-4)", ge=0)
    coef_min: float = param(0.0, "lower bound of the coefficient (TRL entropy_coef_min; Skywork-OR1: 0)", ge=0,
                            rule="<= coef_max")
    coef_max: float = param(1.0, "upper bound of the coefficient (TRL entropy_coef_max; Skywork-OR1's "
                                 "scripts: 0.005)", ge=0, rule=">= coef_min")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._last_h = math.inf  # TRL's _last_world_entropy
        self._applied: float | None = None  # None: no controller step yet (or the autopilot drives coef)
        self._base: float | None = None

    def validate(self) -> None:
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
        target = resolve_level(target_level, self._base)
        self._applied, self.coef = adaptive_entropy_step(self.coef, self._last_h, h, target, self.delta,
                                                         self.coef_min, self.coef_max)
        self._last_h = h
        return {"control/own_entropy": h, "control/own_target": target, "control/own_output": self._applied}

    def loss_overrides(self) -> LossOverrides:
        return LossOverrides(entropy_coef=float(self.coef if self._applied is None else self._applied))

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

    Sources, as checked. The paper's full text could not be read here (only its abstract and first
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
                                  "7B script 0.75, 1.5B script 0.5)", ge=0)
    beta_high: float = param(1.0, "beta2: gradient factor of A>0 tokens above 1 + eps_high (0 = PPO; authors' "
                                  "scripts 1)", ge=0)

    def loss_overrides(self) -> LossOverrides:
        return LossOverrides(ce_beta_low=float(self.beta_low), ce_beta_high=float(self.beta_high))


@register_method
@dataclass
class ClipLow(Method):
    """Clip-low as the entropy knob (Park et al. 2025): the asymmetric ratio clip r ∈ [1 − eps_low, 1 + eps_high]
    steered by eps_low.

    The paper's finding is in its title: clipping at the low bound raises entropy, clipping at the high bound
    lowers it. A smaller eps_low clips more A < 0 tokens whose probability fell (mostly unlikely ones, S_c < 0,
    whose further push would lower entropy by Theorem 3.3: −A·S_c < 0), so a larger eps_low lowers entropy
    (knob direction −1). Like clip-higher it acts only off-policy (several minibatches or epochs).

    Sources, as checked. The paper's full text could not be read here (only its abstract and first
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

    eps_low: float = param(0.1, "lower ratio clip, r >= 1 - eps_low (0.1: ours, not the paper's)", ge=0, lt=1,
                           note="(r >= 1 - eps_low > 0)")
    eps_high: float = param(0.2, "upper ratio clip, r <= 1 + eps_high (0.2: PPO's usual value)", ge=0)

    def loss_overrides(self) -> LossOverrides:
        return LossOverrides(eps_low=float(self.eps_low), eps_high=float(self.eps_high))


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

    Sources, as checked. The paper's full text could not be read here (only its abstract and first
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
    exchange: ClassVar[str | None] = "local"
    masks: ClassVar[tuple[str, ...]] = ("weight_select",)
    reads: ClassVar[tuple[str, ...] | None] = ("entropy", "logp")
    knob: ClassVar[str | None] = "pos_weight"
    knob_raises_entropy: ClassVar[int] = -1
    quadrants: ClassVar[dict[str, str]] = {"pos_spos": "reweights (+alpha on p > high_prob)",
                                           "neg_spos": "reweights (−alpha on p > high_prob)"}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    alpha: float = param(0.0, "adjustment weight (>0 lowers entropy); the controller's output", ge=-1, le=1,
                         note="(pos_weight = 1 + alpha in [0, 2])")
    target: float | str | None = param("1.0x", "entropy target in nats or '0.9x' (times the first batch's "
                                               "entropy; authors' script: 0.1 nats); None: no own "
                                               "controller, alpha fixed", rule=LEVEL_RULE)
    kp: float = param(1.0, "proportional gain (authors: entropy_control_p 1)", ge=0)
    ki: float = param(0.01, "integral gain (authors: entropy_control_i 0.01)", ge=0)
    high_prob: float = param(0.95, "probability above which a token is adjusted (authors: 0.95)", gt=0, lt=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._integral = 0.0
        self._base: float | None = None

    def validate(self) -> None:
        check_level(self.target, "target")

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
        target = resolve_level(target_level, self._base)
        self.alpha, self._integral = entropic_step(h, target, self._integral, self.kp, self.ki)
        return {"control/own_entropy": h, "control/own_target": target, "control/own_output": self.alpha,
                "control/own_integral": self._integral}

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        return Masks(weight_select=mask & (stats.logp.detach() > math.log(self.high_prob)))

    def loss_overrides(self) -> LossOverrides:
        return LossOverrides(weight_alpha=float(self.alpha))

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
