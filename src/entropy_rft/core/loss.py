"""The PPO/GRPO policy surrogate with its optional terms, as small pure functions.

Methods enter only through masks (``keep``, ``zeroed``, ``kl_cov_select``) and coefficients: this module
never knows which method produced them. Semantics are fixed in DESIGN.md ("Semantics of policy_loss").

References: PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, Eq. 7); asymmetric clip
"clip-higher" (DAPO, Yu et al. 2025, arXiv 2503.14476); dual clip (Ye et al. 2020, arXiv 1912.09729);
KL estimators k1/k2/k3 (Schulman 2020, "Approximating KL Divergence"); aggregation modes as in verl's
``agg_loss`` and Dr.GRPO (Liu et al. 2025, arXiv 2503.20783); the advantage-shaping term ``adv_shift``
(Cheng et al. 2025, arXiv 2506.14758); CE-GPPO's gradient-preserving clip (Su et al. 2025, arXiv 2509.20712);
EntroPIC's sample-weight adjustment (Yang et al. 2025, arXiv 2511.15248). Each of the last three is off at its
default, and the loss is then the same computation as before they existed. The full texts of those three papers
could not be read when they were checked (issue 28), so no equation numbers are cited for them; CE-GPPO's and
EntroPIC's terms are checked against their authors' released code instead (``tests/test_field_methods.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from entropy_rft.common.options import AGG_MODES, KL_ESTIMATORS
from entropy_rft.core.tensor_checks import as_mask, broadcast_advantages, check_bool_like, check_like, is_number

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "agg_weights",
    "aggregate",
    "importance_ratio",
    "kl_estimate",
    "policy_loss",
    "ppo_clipped_mask",
    "token_logprobs",
    "value_loss",
]


def _check_agg(agg: str, mask: Tensor) -> None:
    """``agg`` is one of ``AGG_MODES``; the per-sequence modes need a ``[B, T]`` mask."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {list(AGG_MODES)}, got {agg!r}")
    if agg != "token-mean" and mask.dim() < 2:
        raise ValueError(f"agg={agg!r} needs a mask shaped [B, T], got {tuple(mask.shape)}")


def agg_weights(m: Tensor, agg: str = "token-mean", dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-token weights w with ``aggregate(ℓ, m, agg) == Σ w·ℓ`` (zeros when nothing counts).

    - ``token-mean``: w = 1/Σm;
    - ``seq-mean-token-mean``: w = 1/(n_seq · Σ_t m_b), n_seq = sequences with Σ_t m > 0;
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): w = 1/(n_seq · T), T = ``m.shape[-1]``.
    """
    m = as_mask(m, "m")
    _check_agg(agg, m)
    mf = m.to(dtype)
    if agg == "token-mean":
        return mf / mf.sum().clamp(min=1.0)
    per_seq = mf.sum(-1, keepdim=True)
    n_seq = (per_seq > 0).sum().clamp(min=1).to(dtype)
    if agg == "seq-mean-token-mean":
        return mf / per_seq.clamp(min=1.0) / n_seq
    return mf / (n_seq * m.shape[-1])


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


def ppo_clipped_mask(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float | None,
    eps_high: float | None,
    dual_clip: float | None = None,
) -> Tensor:
    """Valid tokens whose gradient the ratio clip removes (PPO, Schulman et al. 2017, Eq. 7).

    A > 0 and r > 1 + eps_high, or A < 0 and r < 1 − eps_low; with ``dual_clip = c`` also A < 0 and r > c.
    A side whose eps is None never clips.
    """
    mask = as_mask(mask)
    check_like(logp, mask, "logp")
    check_like(old_logp, mask, "old_logp")
    adv = broadcast_advantages(advantages, mask)
    with torch.no_grad():
        r = importance_ratio(logp.detach(), old_logp, mask)
        out = torch.zeros_like(mask)
        if eps_high is not None:
            out |= (adv > 0) & (r > 1 + eps_high)
        if eps_low is not None:
            out |= (adv < 0) & (r < 1 - eps_low)
        if dual_clip is not None:
            out |= (adv < 0) & (r > dual_clip)
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


def _check_eps(value: float | Tensor | None, name: str, mask: Tensor | None = None) -> None:
    """A clip width: None (that side unclipped), a number >= 0, or (with ``mask``) per-token widths >= 0 shaped
    like the mask (Flexible Entropy Control's probability-dependent bounds)."""
    if isinstance(value, Tensor) and mask is not None:
        check_like(value, mask, name)
        if not bool(((value >= 0) & torch.isfinite(value)).all()):
            raise ValueError(f"{name} must be finite and >= 0 on every token")
        return
    if value is not None and (not is_number(value) or not value >= 0):
        raise ValueError(f"{name} must be None or a number >= 0, got {value!r}")


def _check_coef(value: float, name: str) -> None:
    if not is_number(value) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


def _frac(x: Tensor, m: Tensor, n: int) -> float | None:
    return float((x & m).sum()) / n if n else None


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
    """The clipped policy-gradient loss with its optional terms, aggregated over the counted tokens.

    Token loss ℓ = max(−A·r, −A·clip(r, 1−eps_low, 1+eps_high)), r = exp(logp − old_logp) (PPO Eq. 7;
    a None eps leaves that side unclipped, both None give the plain −A·r of KL-Cov; an eps may be per-token
    widths shaped like the mask, Flexible Entropy Control's probability-dependent bounds). ``dual_clip = c``
    (c > 1) bounds ℓ of A < 0 tokens by −A·c. Then ℓ gains kl_cov_coef·|logp − old_logp| on
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

    Metrics (Python floats; None when no token counts or the term is absent), all over counted tokens:
    ``loss/total``, ``loss/pg``, ``loss/kl_cov``, ``loss/kl_ref`` (coefficient-weighted contributions that
    sum to ``loss/total``), ``loss/entropy_bonus`` (= −entropy_coef·agg(H)), ``kl/ref`` (the raw
    aggregated estimate), ``clip/ratio_low_frac``, ``clip/ratio_high_frac``, ``clip/ratio_frac``,
    ``clip/dual_frac`` (token fractions where that clip removes the gradient), ``ratio/mean``,
    ``ratio/max``, ``ratio/min``, ``loss/counted_frac`` (Σm/Σmask: zeroed tokens count; not
    ``control/kept_frac``, the share that trains), ``loss/zeroed_frac`` and ``control/kl_cov_selected_frac``
    (over counted tokens), ``tokens/counted`` (names: ``entropy_rft.common.metric_names``).
    """
    mask = as_mask(mask)
    check_like(logp, mask, "logp")
    check_like(old_logp, mask, "old_logp")
    adv = broadcast_advantages(advantages, mask)
    keep = check_bool_like(keep, mask, "keep")
    zeroed = check_bool_like(zeroed, mask, "zeroed")
    kl_cov_select = check_bool_like(kl_cov_select, mask, "kl_cov_select")
    weight_select = check_bool_like(weight_select, mask, "weight_select")
    if adv_shift is not None:
        check_like(adv_shift, mask, "adv_shift")
    _check_coef(ce_beta_low, "ce_beta_low")
    _check_coef(ce_beta_high, "ce_beta_high")
    _check_coef(weight_alpha, "weight_alpha")
    if weight_alpha != 0 and weight_select is None:
        raise ValueError("weight_alpha is non-zero but weight_select is None (pass EntroPIC's token selection)")
    _check_eps(eps_low, "eps_low", mask)
    _check_eps(eps_high, "eps_high", mask)
    if dual_clip is not None and (not is_number(dual_clip) or not dual_clip > 1):
        raise ValueError(f"dual_clip must be None or a number > 1, got {dual_clip!r}")
    _check_agg(agg, mask)
    _check_coef(kl_cov_coef, "kl_cov_coef")
    _check_coef(ref_kl_coef, "ref_kl_coef")
    _check_coef(entropy_coef, "entropy_coef")
    if kl_cov_coef != 0 and kl_cov_select is None:
        raise ValueError("kl_cov_coef is non-zero but kl_cov_select is None (pass the KL-Cov selection)")
    if ref_logp is not None:
        check_like(ref_logp, mask, "ref_logp")
    elif ref_kl_coef != 0:
        raise ValueError("ref_kl_coef is non-zero but ref_logp is None")
    if ref_kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"ref_kl_estimator must be one of {list(KL_ESTIMATORS)}, got {ref_kl_estimator!r}")
    if entropy is not None:
        check_like(entropy, mask, "entropy")
    elif entropy_coef != 0:
        raise ValueError("entropy_coef is non-zero but entropy is None")

    m = mask if keep is None else mask & keep
    dt = torch.promote_types(logp.dtype, torch.float32)  # statistics in float32 at least (DESIGN.md)
    logp, old_logp = logp.to(dt), old_logp.detach().to(dt)
    adv = adv.detach().to(dt)
    if adv_shift is not None:
        adv = adv + torch.where(mask, adv_shift.detach().to(dt), torch.zeros_like(adv))
    r = importance_ratio(logp, old_logp, mask)

    pg1 = -adv * r
    if eps_low is None and eps_high is None:
        pg = pg1
    else:
        lo = None if eps_low is None else 1 - eps_low
        hi = None if eps_high is None else 1 + eps_high
        if isinstance(lo, Tensor) or isinstance(hi, Tensor):  # per-token bounds: clamp's min and max as tensors
            lo, hi = (None if b is None else torch.as_tensor(b, dtype=dt, device=r.device) for b in (lo, hi))
        pg = torch.maximum(pg1, -adv * torch.clamp(r, lo, hi))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    ce = None
    if ce_beta_low != 0 or ce_beta_high != 0:
        # CE-GPPO: value 0, gradient -beta·bound·A·grad(log pi) on the tokens the ratio clip removes
        unit = r / r.detach() - 1
        ce = torch.zeros_like(mask)
        if eps_low is not None and ce_beta_low != 0:
            low_c = (adv < 0) & (r.detach() < 1 - eps_low)
            pg = torch.where(low_c, pg - ce_beta_low * (1 - eps_low) * adv * unit, pg)
            ce = ce | low_c
        if eps_high is not None and ce_beta_high != 0:
            high_c = (adv > 0) & (r.detach() > 1 + eps_high)
            pg = torch.where(high_c, pg - ce_beta_high * (1 + eps_high) * adv * unit, pg)
            ce = ce | high_c

    live = m if zeroed is None else m & ~zeroed  # tokens whose loss is not multiplied by 0

    def term(x: Tensor) -> Tensor:
        return aggregate(torch.where(live, x, torch.zeros_like(x)), m, agg)

    loss_pg = term(pg)
    total = loss_pg
    metrics: dict[str, float | None] = {}
    n = int(m.sum())

    loss_kl_cov = None
    if kl_cov_select is not None:
        abs_kl = torch.where(mask, logp - old_logp, torch.zeros_like(logp)).abs()
        kl_cov_term = torch.where(kl_cov_select, kl_cov_coef * abs_kl, torch.zeros_like(abs_kl))
        loss_kl_cov = term(kl_cov_term)
        total = total + loss_kl_cov
    loss_kl_ref = kl_raw = None
    if ref_logp is not None:
        zero = torch.zeros_like(logp)  # padding enters as x = 0, so inf there cannot leak NaN into grads
        lp, ref = torch.where(mask, logp, zero), torch.where(mask, ref_logp.to(dt), zero)
        kl = kl_estimate(lp, ref, ref_kl_estimator)
        if ref_kl_ratio_weighted:
            kl = kl * r
        kl_raw = aggregate(kl.detach(), m, agg)
        loss_kl_ref = term(ref_kl_coef * kl)
        total = total + loss_kl_ref
    loss_ent = None
    if entropy is not None:
        loss_ent = term(-entropy_coef * entropy.to(dt))
        total = total + loss_ent
    loss_adjust = None
    if weight_select is not None:
        sel = live & weight_select
        loss_adjust = weight_alpha * aggregate(torch.where(sel, -r * adv.abs(), torch.zeros_like(r)), sel, agg)
        total = total + loss_adjust

    def val(x: Tensor | None) -> float | None:
        return None if x is None or n == 0 else float(x.detach())

    with torch.no_grad():
        low = (adv < 0) & (r < 1 - eps_low) if eps_low is not None else torch.zeros_like(m)
        high = (adv > 0) & (r > 1 + eps_high) if eps_high is not None else torch.zeros_like(m)
        dual = (adv < 0) & (r > dual_clip) if dual_clip is not None else torch.zeros_like(m)
        rm = r.detach()[m]
        n_valid = int(mask.sum())
        metrics.update({
            "loss/total": val(total),
            "loss/pg": val(loss_pg),
            "loss/kl_cov": val(loss_kl_cov),
            "loss/kl_ref": val(loss_kl_ref),
            "kl/ref": val(kl_raw),
            "loss/entropy_bonus": val(loss_ent),
            "clip/ratio_low_frac": _frac(low, m, n),
            "clip/ratio_high_frac": _frac(high, m, n),
            "clip/ratio_frac": _frac(low | high, m, n),
            "clip/dual_frac": _frac(dual, m, n) if dual_clip is not None else None,
            "ratio/mean": float(rm.to(torch.float64).mean()) if n else None,
            "ratio/max": float(rm.max()) if n else None,
            "ratio/min": float(rm.min()) if n else None,
            "loss/counted_frac": n / n_valid if n_valid else None,
            "loss/zeroed_frac": _frac(zeroed, m, n) if zeroed is not None else None,
            "control/kl_cov_selected_frac": _frac(kl_cov_select, m, n) if kl_cov_select is not None else None,
            "tokens/counted": float(n),
        })
        if adv_shift is not None:
            metrics["loss/adv_shift_mean"] = float(adv_shift.detach().to(torch.float64)[m].mean()) if n else None
        if ce is not None:
            metrics["clip/ce_frac"] = _frac(ce, m, n)
        if weight_select is not None:
            metrics["loss/weight_adjust"] = val(loss_adjust)
            metrics["control/weight_selected_frac"] = _frac(weight_select, m, n)
    return total, metrics
