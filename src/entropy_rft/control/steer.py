"""STEER (Hao et al. 2025): tokens reweighted by their estimated entropy change, so that no token's
update moves the entropy much more than the others'. The rule, its paper and how far it was checked are in
``Steer``'s docstring; the maths is in the two pure functions ``steer_entropy_change`` and ``steer_weights``.

Knob directions as in :mod:`entropy_rft.control.paper_methods`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from entropy_rft.control._common import as_mask, broadcast_advantages, check_like
from entropy_rft.control.registry import Masks, Method, param, register_method

if TYPE_CHECKING:
    from entropy_rft.core.dynamics import TokenStats

STEER = ("Hao et al. 2025, Rethinking Entropy Interventions in RLVR: An Entropy Change Perspective, "
         "arXiv 2510.10150 (code: github.com/zz-haooo/STEER)")
MAPPINGS = ("exp", "linear")
# The authors' clamps of the probabilities (``compute_token_weights``): p in [1e-8, 1 - 1e-8], p_old in [1e-8, 1]
P_MIN, P_MAX = 1e-8, 1.0 - 1e-8


@register_method
@dataclass
class Steer(Method):
    """STEER (Hao et al. 2025): each token's loss is weighted by λ_t from its estimated entropy change |Ω_t|.

    Ω_t = (A_t / p_old,t)·p_t(1 − p_t)(log p_t + H_t) (``steer_entropy_change``), and over the batch's valid
    tokens, with Ω_max (Ω_min) the largest (smallest) |Ω| (``steer_weights``):

    - ``mapping="exp"``: λ = clamp(exp(−k·|Ω|), λ_min, 1), k = −log λ_min / max(Ω_max, omega_floor), i.e.
      λ = λ_min^(|Ω| / max(Ω_max, omega_floor)): the token with the largest |Ω| gets λ_min, Ω = 0 gets 1;
    - ``mapping="linear"``: λ = clamp(λ_max − (|Ω| − Ω_min)·(λ_max − λ_min)/(Ω_max − Ω_min), λ_min, λ_max),
      (λ_min + λ_max)/2 for every token when all |Ω| are equal.

    The token loss is λ_t times PPO's (dual clip included); λ > 0 keeps A's sign, so this is the surrogate with
    λ_t·A_t in place of A_t, which is how it enters ``loss.policy_loss`` (``adv_shift`` = (λ − 1)·A; the
    loss's ``loss/adv_shift_mean`` is then the mean of (λ − 1)·A). The weights are detached (no gradient flows
    through them). Through the lens it reweights every A ≠ 0 token, down where |Ω| is large: the updates
    estimated to move the entropy most, in either direction, so the per-step entropy change stays in a moderate
    band. It is not a controller: it reads no measured entropy and has no setpoint; the band is relative (λ_min
    at the batch's largest |Ω|), and the autopilot can steer its knob λ_min toward an entropy target across
    steps. Knob ``token_weight_min`` (λ_min), direction −1: raising it toward 1 weakens the reweighting (with the
    exp mapping λ_min = 1 is vanilla PPO/GRPO), and the paper presents the reweighting as what keeps entropy from
    collapsing; the direction is that intent, as the autopilot assumes, not a theorem.

    How Ω relates to Paper A (``core.theory``): with r = p_t/p_old,t and S_k = p_k(H + log p_k) the entropy
    discriminator (``TokenStats.s_star``), Ω = A·r·(1 − p_k)·S_k/p_k. Theorem 3.3's per-token first-order change
    (``theory.first_order_entropy_change``, the lens's quantity) is −A·r·S_c with S_c = S_k − E_p[S]. Ω is not
    that quantity, so it is computed here rather than taken from ``core.theory``: (1 − p_k)·S_k = S_k − p_k·S_k
    replaces the vocabulary term E_p[S] = Σ_i p_i·S_i by the sampled token's own term (so Ω needs only H and
    p_k, no pass over the vocabulary), and Ω carries an extra 1/p_k, which weighs unlikely tokens up. Only |Ω|
    is used, so its sign convention does not matter.

    Sources, as checked. The paper's full text could not be read here (only its abstract and
    third-party summaries), so **equation numbers not verified**. The rule is pinned down from the authors'
    released code (github.com/zz-haooo/STEER, ``compute_token_weights`` and ``compute_policy_loss_with_entropy``
    in ``verl/trainer/ppo/core_algos.py``, called from ``verl/workers/actor/dp_actor.py``), and
    ``tests/test_steer.py`` checks weights, loss and gradient against a transcription of it. Their clamps and
    constants are kept: p ∈ [1e-8, 1 − 1e-8], p_old ∈ [1e-8, 1], a non-finite Ω counts as 0, omega_floor 0.02.
    Deviations: the authors compute Ω with the current policy's p_t (recomputed per micro-batch) and the old
    policy's H_t, and take Ω_min/Ω_max over each micro-batch on each GPU (8 sequences in their scripts); here
    Ω uses the old policy's p and H (r = 1; the same numbers on a step's first update) over the tokens that
    train of the whole rollout batch, once per rollout batch (the same with one micro-batch per batch).
    Defaults are their published scripts': ``run/run_exp.sh`` (exp, λ_min 0.8; its λ_max 1.0 is unused by the
    exp mapping) and ``run/run_linear.sh`` (linear, λ_min 0.8, λ_max 1.2: ``--set method.params.mapping=
    linear``); the ``*_extreme.sh`` scripts keep those and loosen PPO's clip (eps_low 0.99, eps_high 5). All use
    eps_low 0.2, eps_high 0.28 and dual clip 10 (``algo.*`` here). Their code's own default is linear; exp is
    the default here because its knob has the vanilla limit λ_min = 1 (third-party summaries give the paper's
    form as λ = exp(−k|Ω|), not verified).
    """

    name: ClassVar[str] = "steer"
    paper: ClassVar[str] = STEER
    summary: ClassVar[str] = ("weight each token's loss by λ in [λ_min, 1] (exp) or [λ_min, λ_max] (linear), "
                              "down where its estimated entropy change |Ω| is large")
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "tokens"
    masks: ClassVar[tuple[str, ...]] = ("adv_shift",)
    reads: ClassVar[tuple[str, ...] | None] = ("entropy", "logp")
    knob: ClassVar[str | None] = "token_weight_min"
    knob_raises_entropy: ClassVar[int] = -1
    quadrants: ClassVar[dict[str, str]] = {q: "reweights by λ(|Ω|), down where |Ω| is large"
                                           for q in ("pos_spos", "pos_sneg", "neg_spos", "neg_sneg")}
    engines: ClassVar[tuple[str, ...]] = ("native",)

    token_weight_min: float = param(0.8, "λ_min, the weight of the largest |Ω|; in (0, 1] with mapping exp, "
                                         "(0, token_weight_max] with linear (authors' scripts: 0.8)", gt=0,
                                    rule="<= 1 with mapping exp, <= token_weight_max with linear")
    token_weight_max: float = param(1.2, "λ_max, the weight of the smallest |Ω| with mapping linear (authors' "
                                         "run_linear.sh: 1.2); the exp mapping caps weights at 1", gt=0)
    mapping: str = param("exp", "Ω -> weight: exp (λ_min^(|Ω|/max(Ω_max, omega_floor)), run_exp.sh) or linear "
                                "(from λ_max at the smallest |Ω| to λ_min at the largest, run_linear.sh)",
                         choices=MAPPINGS)
    omega_floor: float = param(0.02, "exp mapping: k = −log λ_min / max(Ω_max, omega_floor), so a batch of "
                                     "small |Ω| is not pushed to λ_min (authors' code: 0.02)", gt=0)

    def validate(self) -> None:
        if self.mapping == "exp" and not self.token_weight_min <= 1.0:
            raise ValueError(f"token_weight_min must be in (0, 1] with mapping 'exp' (weights exp(−k·|Ω|) are "
                             f"at most 1), got {self.token_weight_min!r}")
        if self.mapping == "linear" and not self.token_weight_min <= self.token_weight_max:
            raise ValueError(f"token_weight_min must be <= token_weight_max with mapping 'linear', got "
                             f"{self.token_weight_min!r} > {self.token_weight_max!r}")

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        omega = steer_entropy_change(stats.logp, stats.logp, stats.entropy, advantages, mask)
        lam = steer_weights(omega.abs(), mask, self.token_weight_min, self.token_weight_max, self.mapping,
                            self.omega_floor)
        adv = broadcast_advantages(advantages, mask).detach().to(torch.float32)
        return Masks(adv_shift=torch.where(mask, (lam - 1.0) * adv, torch.zeros_like(adv)))


def steer_entropy_change(logp: Tensor, old_logp: Tensor, entropy: Tensor, advantages: Tensor,
                         mask: Tensor) -> Tensor:
    """STEER's estimated entropy change per token, Ω = (A / p_old)·p(1 − p)(log p + H), float32, 0 off ``mask``.

    p = exp(logp) clamped to [1e-8, 1 − 1e-8], p_old = exp(old_logp) clamped to [1e-8, 1], H the token's
    entropy, A broadcast per token; a non-finite Ω counts as 0. Hao et al. 2025 (arXiv 2510.10150) as the
    authors' ``compute_token_weights`` computes it (their ``metric`` before the absolute value); equation
    numbers not verified. Equal to A·r·(1 − p)·S_k/p with S_k = p(H + log p) (see ``Steer``)."""
    mask = as_mask(mask)
    for name, x in (("logp", logp), ("old_logp", old_logp), ("entropy", entropy)):
        check_like(x, mask, name)
    f32 = torch.float32
    p = torch.exp(logp.detach().to(f32)).clamp(P_MIN, P_MAX)
    p_old = torch.exp(old_logp.detach().to(f32)).clamp(P_MIN, 1.0)
    adv = broadcast_advantages(advantages, mask).detach().to(f32)
    omega = adv / p_old * (p * (1 - p) * (torch.log(p) + entropy.detach().to(f32)))
    return torch.where(mask & torch.isfinite(omega), omega, torch.zeros_like(omega))


def steer_weights(omega_abs: Tensor, mask: Tensor, weight_min: float, weight_max: float, mapping: str = "exp",
                  omega_floor: float = 0.02) -> Tensor:
    """STEER's token weights λ from |Ω| over the valid tokens (``mask``), float32, 0 off the mask (and everywhere
    when no token is valid).

    exp: λ = clamp(exp(−k·|Ω|), weight_min, 1), k = −log(weight_min) / max(Ω_max, omega_floor).
    linear: λ = clamp(weight_max − (|Ω| − Ω_min)·(weight_max − weight_min)/(Ω_max − Ω_min), weight_min,
    weight_max); (weight_min + weight_max)/2 when Ω_max == Ω_min. Ω_min, Ω_max: over the valid tokens.
    Hao et al. 2025 (arXiv 2510.10150) as the authors' ``compute_token_weights`` maps them (``linear`` True /
    False); equation numbers not verified."""
    mask = as_mask(mask)
    check_like(omega_abs, mask, "omega_abs")
    if mapping not in MAPPINGS:
        raise ValueError(f"mapping must be one of {list(MAPPINGS)}, got {mapping!r}")
    x = omega_abs.detach().to(torch.float32)
    zero = torch.zeros_like(x)
    if not bool(mask.any()):
        return zero
    valid = x[mask]
    lo, hi = valid.min(), valid.max()
    if mapping == "linear":
        if hi > lo:
            lam = weight_max - (x - lo) * ((weight_max - weight_min) / (hi - lo))
        else:
            lam = torch.full_like(x, (weight_min + weight_max) / 2)
        lam = lam.clamp(weight_min, weight_max)
    else:
        k = -math.log(weight_min) / torch.clamp(hi, min=omega_floor)
        lam = torch.exp(-k * x).clamp(weight_min, 1.0)
    return torch.where(mask, lam, zero)
