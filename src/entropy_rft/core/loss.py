"""The PPO/GRPO policy surrogate with its optional terms, as small pure functions.

Methods enter only through masks (``keep``, ``zeroed``, ``kl_cov_select``) and coefficients: this module
never knows which method produced them. Semantics are fixed in DESIGN.md ("Semantics of policy_loss").
``compute_policy_loss`` takes the typed inputs and settings of ``core.loss_types``; ``policy_loss`` is the same
as one keyword call, each keyword given to the field of its name (``loss_arguments``).

Each rule of the loss has one home here: the ratio clip (its bounds ``clip_bounds``, where it removes the
gradient ``clip_regions``; the surrogate, ``ppo_clipped_mask``, CE-GPPO and TRL's clip log all read them) and the
aggregation modes (their weights ``aggregation_weights``, over a batch's own counts or a global batch's; their
names and shape rule ``loss_types.check_agg``).

References: PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, Eq. 7); asymmetric clip
"clip-higher" (DAPO, Yu et al. 2025, arXiv 2503.14476); dual clip (Ye et al. 2020, arXiv 1912.09729);
KL estimators k1/k2/k3 (Schulman 2020, "Approximating KL Divergence"); aggregation modes as in verl's
``agg_loss`` and Dr.GRPO (Liu et al. 2025, arXiv 2503.20783); the advantage-shaping term ``adv_shift``
(Cheng et al. 2025, arXiv 2506.14758); CE-GPPO's gradient-preserving clip (Su et al. 2025, arXiv 2509.20712);
EntroPIC's sample-weight adjustment (Yang et al. 2025, arXiv 2511.15248). Each of the last three is off at its
default, and the loss is then the same computation as before they existed. The full texts of those three papers
could not be read when they were checked, so no equation numbers are cited for them; CE-GPPO's and
EntroPIC's terms are checked against their authors' released code instead (``tests/test_field_methods.py``).
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor

from entropy_rft.common.options import AGG_MODES, KL_ESTIMATORS
from entropy_rft.core.loss_types import ClipRegions, LossInputs, LossOutputs, LossSettings, Masks, check_agg
from entropy_rft.core.tensor_checks import as_mask, broadcast_advantages, check_like

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LossInputs",
    "LossOutputs",
    "LossSettings",
    "Masks",
    "agg_weights",
    "aggregate",
    "aggregation_weights",
    "clip_bounds",
    "clip_regions",
    "compute_policy_loss",
    "importance_ratio",
    "kl_estimate",
    "loss_arguments",
    "policy_loss",
    "ppo_clipped_mask",
    "token_logprobs",
    "value_loss",
]


def aggregation_weights(mf: Tensor, agg: str, *, tokens: Tensor | float | None = None,
                        sequences: Tensor | float | None = None, width: float | None = None) -> Tensor:
    """The aggregation modes' per-token weights w (verl's ``agg_loss``; Dr.GRPO), the one place their formulas
    stand, for the counting mask ``mf`` as floats and the counts it is normalised by: the batch's own
    (``agg_weights``) or a global batch's (an engine's ranks and micro-batches: ``integrations.window``, verl's
    ``global_batch_info``). The caller clamps the counts to at least 1.

    - ``token-mean``: w = m / N_tok (``tokens``);
    - ``seq-mean-token-mean``: w = m / max(Σ_t m_b, 1) / N_seq (``sequences``);
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): w = m / (N_seq · T) (``sequences``, ``width`` T).
    """
    check_agg(agg)

    def given(count: Any, what: str) -> Any:
        if count is None:
            raise ValueError(f"{agg} weights need {what}")
        return count

    if agg == "token-mean":
        return mf / given(tokens, "the token count")
    if agg == "seq-mean-token-mean":
        return mf / mf.sum(-1, keepdim=True).clamp(min=1.0) / given(sequences, "the sequence count")
    return mf / (given(sequences, "the sequence count") * given(width, "the width"))


def agg_weights(m: Tensor, agg: str = "token-mean", dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-token weights w with ``aggregate(ℓ, m, agg) == Σ w·ℓ`` (zeros when nothing counts): the formulas of
    ``aggregation_weights`` with ``m``'s own counts, N_tok = Σm and N_seq = the sequences with Σ_t m > 0 (each at
    least 1), T = ``m.shape[-1]``.
    """
    m = as_mask(m, "m")
    check_agg(agg, m)
    return _weights(m, agg, dtype)


def _weights(m: Tensor, agg: str, dtype: torch.dtype) -> Tensor:
    """``agg_weights`` of a bool ``m`` and a valid ``agg``, unchecked."""
    mf = m.to(dtype)
    if agg == "token-mean":
        return aggregation_weights(mf, agg, tokens=mf.sum().clamp(min=1.0))
    n_seq = (mf.sum(-1, keepdim=True) > 0).sum().clamp(min=1).to(dtype)
    return aggregation_weights(mf, agg, sequences=n_seq, width=m.shape[-1])


def aggregate(token_loss: Tensor, m: Tensor, agg: str = "token-mean") -> Tensor:
    """Aggregate a token loss over the counting mask ``m`` by one of ``AGG_MODES`` (see ``agg_weights``).

    Tokens outside ``m`` contribute exactly 0 even when their loss is inf or NaN. With no counted token
    the result is a zero that still carries the graph (so ``backward`` works).
    """
    w = agg_weights(m, agg, token_loss.dtype)
    return torch.where(m, token_loss * w, torch.zeros_like(token_loss)).sum()


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log p_k of the sampled tokens, **with grad**, from materialised logits: the ``logp`` of ``policy_loss``.

    log p_k = z_k − logsumexp(z), z = logits / temperature in float32 (float64 stays float64), as
    ``dynamics.token_stats`` computes its (gradient-free) ``logp``; d log p_k / dz = e_k − p.
    logits: [..., V] (e.g. ``model(...).logits`` shifted to the response positions); token_ids: [...] in
    [0, V). Without materialised logits, ``fused.fused_logp`` gives the same from hidden states.
    """
    from entropy_rft.core.dynamics import check_logits_ids, check_temperature

    check_logits_ids(logits, token_ids)
    t = check_temperature(temperature)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / t
    return z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def importance_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """r = exp(logp − old_logp) on valid tokens, 1 on padding (so padding never makes inf or NaN)."""
    lr = torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))
    return torch.exp(lr)


def clip_bounds(eps_low: float | Tensor | None, eps_high: float | Tensor | None
                ) -> tuple[float | Tensor | None, float | Tensor | None]:
    """PPO's ratio clip range [1 − eps_low, 1 + eps_high] (Schulman et al. 2017, Eq. 7; clip-higher: DAPO); a side
    whose eps is None is unbounded (None). Per-token widths (tensors) give per-token bounds."""
    return None if eps_low is None else 1 - eps_low, None if eps_high is None else 1 + eps_high


def clip_regions(adv: Tensor, r: Tensor, eps_low: float | Tensor | None, eps_high: float | Tensor | None,
                 dual_clip: float | None = None) -> ClipRegions:
    """Where the ratio clip removes a token's gradient (PPO Eq. 7), the one statement of that rule: ``low`` A < 0
    and r < 1 − eps_low, ``high`` A > 0 and r > 1 + eps_high (``clip_bounds``; a side whose eps is None never
    clips), and with ``dual_clip = c`` (Ye et al. 2020) ``dual`` A < 0 and r > c. ``r`` detached."""
    lo, hi = clip_bounds(eps_low, eps_high)

    def never() -> Tensor:
        return torch.zeros(torch.broadcast_shapes(adv.shape, r.shape), dtype=torch.bool, device=r.device)

    low = (adv < 0) & (r < lo) if lo is not None else never()
    high = (adv > 0) & (r > hi) if hi is not None else never()
    return ClipRegions(low, high, None if dual_clip is None else (adv < 0) & (r > dual_clip))


def ppo_clipped_mask(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float | None,
    eps_high: float | None,
    dual_clip: float | None = None,
) -> Tensor:
    """Valid tokens whose gradient the ratio clip removes (``clip_regions``: low, high or dual)."""
    mask = as_mask(mask)
    check_like(logp, mask, "logp")
    check_like(old_logp, mask, "old_logp")
    adv = broadcast_advantages(advantages, mask)
    with torch.no_grad():
        c = clip_regions(adv, importance_ratio(logp.detach(), old_logp, mask), eps_low, eps_high, dual_clip)
        out = c.low | c.high if c.dual is None else c.low | c.high | c.dual
    return out & mask


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman 2020, "Approximating KL Divergence").

    With x = ref_logp − logp: k1 = −x; k2 = x²/2; k3 = exp(x) − x − 1 (unbiased, always ≥ 0).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"ref_kl_estimator must be one of {list(KL_ESTIMATORS)}, got {estimator!r}")
    x = ref_logp.detach() - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    return torch.exp(x) - x - 1


def value_loss(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """PPO's critic loss: the squared error (V − R)² averaged over the valid tokens (0 with none)."""
    m = mask.float()
    return (((values - returns) ** 2) * m).sum() / m.sum().clamp(min=1)


def compute_policy_loss(inputs: LossInputs, settings: LossSettings) -> LossOutputs:
    """The clipped policy-gradient loss with its optional terms, aggregated over the counted tokens.

    Token loss ℓ = max(−A·r, −A·clip(r, 1−eps_low, 1+eps_high)), r = exp(logp − old_logp) (PPO Eq. 7;
    a None eps leaves that side unclipped, both None give the plain −A·r of KL-Cov; per-token widths in
    ``Masks.eps_low/eps_high``, Flexible Entropy Control's probability-dependent bounds, replace the settings').
    ``dual_clip = c`` (c > 1) bounds ℓ of A < 0 tokens by −A·c. Then ℓ gains kl_cov_coef·|logp − old_logp| on
    ``kl_cov_select`` (KL-Cov), ref_kl_coef·KL_est(logp, ref_logp) (times r, gradient through both, when
    ``ref_kl_ratio_weighted``: the importance-sampled KL of off-policy tokens, TRL's ``use_bias_correction_kl``)
    and −entropy_coef·H (entropy bonus, the gradient flows through ``entropy``).

    Counting mask m = mask & keep: tokens with keep False leave the loss and every count (ClipB, ClipV,
    high_entropy, grad_mask). Tokens with ``zeroed`` True have their whole token loss multiplied by 0 but
    still count (Clip-Cov). The loss is ``aggregate(ℓ, m, agg)``.

    Three method terms, each off by default:

    - ``adv_shift`` ψ (float, like the mask): the surrogate uses A + ψ in place of A on every token (entropy
      advantage shaping, Cheng et al. 2025, where ψ = min(α·H_detached, |A|/κ), a form not checked against the
      paper's full text); metrics ``loss/adv_shift_mean``.
    - ``ce_beta_low`` β1, ``ce_beta_high`` β2 (CE-GPPO, Su et al. 2025): a token the ratio clip removes
      (A < 0, r < 1 − eps_low; or A > 0, r > 1 + eps_high) keeps a bounded gradient: ℓ gains
      −β·b·A·(r/sg(r) − 1), b = 1 − eps_low or 1 + eps_high, whose value is 0 and whose gradient is
      −β·b·A·∇log π (the authors' code, github.com/Kwai-Klear/CE-GPPO ``compute_gppo_loss_general_beta``: token
      loss −β·b·A·r/sg(r)). The gradient is theirs; the forward value is not: PPO's clipped value −b·A is kept
      (theirs: −β·b·A), so ``loss/pg`` does not depend on β. 0 = PPO. ``clip/ce_frac``: share of counted tokens
      that got it.
    - ``weight_alpha`` α with ``weight_select`` (EntroPIC, Yang et al. 2025): the loss gains
      α·aggregate(−r·|A|, m ∧ weight_select, agg) (the authors' code, github.com/yk7333/EntroPIC
      ``compute_policy_loss_entropic``: high-probability tokens, p > 0.95), so
      α > 0 weighs those tokens of positive samples up and of negative samples down (entropy falls), α < 0
      the reverse; ``loss/weight_adjust`` is that term.

    Statistics in float32 at least (DESIGN.md). No host sync: the metrics stay tensors (``LossOutputs.metrics``).
    """
    inputs.check_against(settings)
    s, mk, mask = settings, inputs.masks, inputs.mask
    eps_low = s.eps_low if mk.eps_low is None else mk.eps_low
    eps_high = s.eps_high if mk.eps_high is None else mk.eps_high
    m = mask if mk.keep is None else mask & mk.keep
    dt = torch.promote_types(inputs.logp.dtype, torch.float32)
    logp, old_logp = inputs.logp.to(dt), inputs.old_logp.detach().to(dt)
    adv = inputs.advantages.detach().to(dt)
    if mk.adv_shift is not None:
        adv = adv + torch.where(mask, mk.adv_shift.detach().to(dt), torch.zeros_like(adv))
    r = importance_ratio(logp, old_logp, mask)
    rd = r.detach()
    clipped = clip_regions(adv, rd, eps_low, eps_high, s.dual_clip)

    pg = _clipped_surrogate(adv, r, eps_low, eps_high, s.dual_clip, dt)
    ce = None
    if s.ce_beta_low != 0 or s.ce_beta_high != 0:
        pg, ce = _ce_gppo(pg, adv, r, mask, clipped, eps_low, eps_high, s.ce_beta_low, s.ce_beta_high)

    live = m if mk.zeroed is None else m & ~mk.zeroed  # tokens whose loss is not multiplied by 0
    w = _weights(m, s.agg, dt)  # aggregate()'s weights over m, the same for every term

    def agg_m(x: Tensor) -> Tensor:  # aggregate(x, m, agg)
        return torch.where(m, x * w, torch.zeros_like(x)).sum()

    def term(x: Tensor) -> Tensor:
        return agg_m(torch.where(live, x, torch.zeros_like(x)))

    loss_pg = term(pg)
    total = loss_pg
    loss_kl_cov = None
    if mk.kl_cov_select is not None:
        abs_kl = torch.where(mask, logp - old_logp, torch.zeros_like(logp)).abs()
        loss_kl_cov = term(torch.where(mk.kl_cov_select, s.kl_cov_coef * abs_kl, torch.zeros_like(abs_kl)))
        total = total + loss_kl_cov
    loss_kl_ref = kl_raw = None
    if inputs.ref_logp is not None:
        zero = torch.zeros_like(logp)  # padding enters as x = 0, so inf there cannot leak NaN into grads
        lp, ref = torch.where(mask, logp, zero), torch.where(mask, inputs.ref_logp.to(dt), zero)
        kl = kl_estimate(lp, ref, s.ref_kl_estimator)
        if s.ref_kl_ratio_weighted:
            kl = kl * r
        kl_raw = agg_m(kl.detach())
        loss_kl_ref = term(s.ref_kl_coef * kl)
        total = total + loss_kl_ref
    loss_ent = None
    if inputs.entropy is not None:
        loss_ent = term(-s.entropy_coef * inputs.entropy.to(dt))
        total = total + loss_ent
    loss_adjust = None
    if mk.weight_select is not None:
        sel = live & mk.weight_select
        loss_adjust = s.weight_alpha * aggregate(torch.where(sel, -r * adv.abs(), torch.zeros_like(r)), sel, s.agg)
        total = total + loss_adjust

    def det(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.detach()

    terms = {"loss/total": det(total), "loss/pg": det(loss_pg), "loss/kl_cov": det(loss_kl_cov),
             "loss/kl_ref": det(loss_kl_ref), "kl/ref": det(kl_raw), "loss/entropy_bonus": det(loss_ent)}
    return LossOutputs(total, terms, m, mask, rd, clipped, mk, ce, det(loss_adjust))


def _clipped_surrogate(adv: Tensor, r: Tensor, eps_low: float | Tensor | None, eps_high: float | Tensor | None,
                       dual_clip: float | None, dt: torch.dtype) -> Tensor:
    """PPO's token loss max(−A·r, −A·clip(r, 1−eps_low, 1+eps_high)) (Eq. 7; ``clip_bounds``), and the dual clip's
    bound −A·c on A < 0 tokens."""
    pg1 = -adv * r
    if eps_low is None and eps_high is None:
        pg = pg1
    else:
        lo, hi = clip_bounds(eps_low, eps_high)
        if isinstance(lo, Tensor) or isinstance(hi, Tensor):  # per-token bounds: clamp's min and max as tensors
            lo, hi = (None if b is None else torch.as_tensor(b, dtype=dt, device=r.device) for b in (lo, hi))
        pg = torch.maximum(pg1, -adv * torch.clamp(r, lo, hi))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    return pg


def _ce_gppo(pg: Tensor, adv: Tensor, r: Tensor, mask: Tensor, clipped: ClipRegions, eps_low: float | Tensor | None,
             eps_high: float | Tensor | None, beta_low: float, beta_high: float) -> tuple[Tensor, Tensor]:
    """CE-GPPO's term on the tokens the ratio clip removes (``clipped``: low, high): value 0, gradient
    −β·b·A·∇log π, b = 1 − eps_low or 1 + eps_high; and those tokens."""
    unit = r / r.detach() - 1
    lo, hi = clip_bounds(eps_low, eps_high)
    ce = torch.zeros_like(mask)
    if lo is not None and beta_low != 0:
        pg = torch.where(clipped.low, pg - beta_low * lo * adv * unit, pg)
        ce = ce | clipped.low
    if hi is not None and beta_high != 0:
        pg = torch.where(clipped.high, pg - beta_high * hi * adv * unit, pg)
        ce = ce | clipped.high
    return pg, ce


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    keep: Tensor | None = None,
    zeroed: Tensor | None = None,
    eps_low: float | Tensor | None = 0.2,
    eps_high: float | Tensor | None = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    kl_cov_select: Tensor | None = None,
    kl_cov_coef: float = 0.0,
    ref_logp: Tensor | None = None,
    ref_kl_coef: float = 0.0,
    ref_kl_estimator: str = "k3",
    ref_kl_ratio_weighted: bool = False,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    adv_shift: Tensor | None = None,
    ce_beta_low: float = 0.0,
    ce_beta_high: float = 0.0,
    weight_select: Tensor | None = None,
    weight_alpha: float = 0.0,
) -> tuple[Tensor, dict[str, float | None]]:
    """``compute_policy_loss`` as one keyword call: the loss and its metrics as numbers (``LossOutputs.metrics``,
    one transfer). Each keyword is the ``LossSettings``, ``Masks`` or ``LossInputs`` field of that name
    (``loss_arguments``); an ``eps_low``/``eps_high`` tensor shaped like the mask is per-token widths
    (``Masks.eps_*``)."""
    inputs, settings = loss_arguments(
        logp, old_logp, advantages, mask, keep=keep, zeroed=zeroed, eps_low=eps_low, eps_high=eps_high,
        dual_clip=dual_clip, agg=agg, kl_cov_select=kl_cov_select, kl_cov_coef=kl_cov_coef, ref_logp=ref_logp,
        ref_kl_coef=ref_kl_coef, ref_kl_estimator=ref_kl_estimator, ref_kl_ratio_weighted=ref_kl_ratio_weighted,
        entropy=entropy, entropy_coef=entropy_coef, adv_shift=adv_shift, ce_beta_low=ce_beta_low,
        ce_beta_high=ce_beta_high, weight_select=weight_select, weight_alpha=weight_alpha)
    out = compute_policy_loss(inputs, settings)
    return out.loss, out.metrics()


_SETTING_NAMES = frozenset(f.name for f in fields(LossSettings))
_MASK_NAMES = frozenset(f.name for f in fields(Masks))
_INPUT_NAMES = frozenset({"ref_logp", "entropy"})


def loss_arguments(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                   **keywords: Any) -> tuple[LossInputs, LossSettings]:
    """The typed inputs and settings of a keyword call (``policy_loss``, ``control.gradient_coefficients``): each
    keyword goes to the field of its name, never by position: a ``LossSettings`` field (unnamed ones keep their
    defaults), a ``Masks`` field, or ``ref_logp``/``entropy``; ``eps_low``/``eps_high`` as tensors are
    ``Masks``' per-token widths, as numbers (or None) the settings'. Another keyword raises TypeError naming it.
    The settings are validated once per distinct set of values (``_settings``)."""
    unknown = sorted(set(keywords) - _SETTING_NAMES - _MASK_NAMES - _INPUT_NAMES)
    if unknown:
        raise TypeError(f"unexpected loss keyword(s) {', '.join(unknown)}; the loss takes "
                        f"{', '.join(sorted(_SETTING_NAMES | _MASK_NAMES | _INPUT_NAMES))}")
    widths = {k: keywords.pop(k) for k in ("eps_low", "eps_high") if isinstance(keywords.get(k), Tensor)}
    settings = _settings(**{k: v for k, v in keywords.items() if k in _SETTING_NAMES},
                         **{k: None for k in widths})
    masks = Masks(**{k: v for k, v in keywords.items() if k in _MASK_NAMES and k not in _SETTING_NAMES}, **widths)
    inputs = LossInputs(logp, old_logp, advantages, mask, masks, keywords.get("ref_logp"), keywords.get("entropy"))
    return inputs, settings


@functools.lru_cache(maxsize=64, typed=True)
def _cached_settings(**named: Any) -> LossSettings:
    return LossSettings(**named)


def _settings(**named: Any) -> LossSettings:
    """``LossSettings(**named)``, by field name, validated once per distinct set of names, values and types (``1``,
    ``1.0`` and ``True`` are distinct keys; a value that cannot be hashed, only possible in a wrong call, is
    validated anew and raises there)."""
    try:
        return _cached_settings(**named)
    except TypeError:
        return LossSettings(**named)
