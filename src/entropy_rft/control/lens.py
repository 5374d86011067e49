"""The "unified lens" of Wang et al. 2026 (arXiv 2602.03392, Sec. 5), made measurable.

For any keep-mask, report which tokens it removes in the quadrants sign(A) × sign(S_c), and the first-order
entropy change those tokens carried: Theorem 3.3 per token with the aggregation weights and the off-policy
factor, −w·A·r·S_c (lr dropped; a PPO-clipped token has no gradient and carries 0), as
``theory.first_order_entropy_change`` computes it (formulas: ``entropy_rft.core.dynamics``).

Methods that reweight tokens, add gradient to them or change the clip (advantage shaping, EntroPIC, CE-GPPO,
clip-low/high) drop nothing, so the drop lens cannot see them. ``weight_lens`` extends it to any method: with
g_t = −∂L/∂log π_t the gradient coefficient of token t in the loss (``loss_gradient``, by autograd on
``loss.compute_policy_loss`` itself; ``gradient_coefficients`` is its keyword call), Theorem 3.3 per token gives the
first-order entropy change −g_t·S_c,t (a logit step along g_t·(e_k − p)), so the method's change in token weights
carries Σ_t −(g_t^method − g_t^vanilla)·S_c,t, per quadrant. For a keep-mask with vanilla settings g_t = w_t·A_t·r_t
on the kept tokens, which is the drop lens with the aggregation weights renormalised over the kept tokens.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from entropy_rft.control._common import agg_weights, as_mask, broadcast_advantages, check_bool_like, check_like
from entropy_rft.core.loss import compute_policy_loss, loss_arguments
from entropy_rft.core.loss_types import LossInputs, LossSettings
from entropy_rft.core.theory import first_order_entropy_change

__all__ = ["QUADRANTS", "gradient_coefficients", "lens_attribution", "loss_gradient", "quadrant_effects",
           "weight_lens"]

# name -> (advantage condition, S_c condition); S_c == 0 (no first-order effect) goes with "sneg".
QUADRANTS = ("pos_spos", "pos_sneg", "neg_spos", "neg_sneg", "zero")


def _quadrant_masks(adv: Tensor, s_c: Tensor) -> dict[str, Tensor]:
    spos = s_c > 0
    return {
        "pos_spos": (adv > 0) & spos,
        "pos_sneg": (adv > 0) & ~spos,
        "neg_spos": (adv < 0) & spos,
        "neg_sneg": (adv < 0) & ~spos,
        "zero": adv == 0,
    }


def lens_attribution(
    keep: Tensor,
    advantages: Tensor,
    s_centered: Tensor,
    mask: Tensor,
    *,
    ratio: Tensor | None = None,
    clipped: Tensor | None = None,
    agg: str = "token-mean",
) -> dict[str, float | None]:
    """Quadrant drop fractions and first-order entropy change of dropped vs kept tokens.

    Quadrants: ``pos``/``neg`` = A > 0 / A < 0, ``spos``/``sneg`` = S_c > 0 / S_c ≤ 0; A == 0 is its own
    bucket ``zero``. With N valid tokens and D = mask & ~keep the dropped ones:

    - ``lens/drop_frac`` = |D|/N and ``lens/drop_frac/<q>`` = |D ∩ q|/N (these sum to ``lens/drop_frac``);
    - ``lens/drop_rate/<q>`` = |D ∩ q|/|q| (None when the quadrant is empty);
    - ``lens/dH_dropped``, ``lens/dH_kept``, ``lens/dH_total`` = Σ −w·A·r·S_c over D, over the kept valid
      tokens, and over all valid tokens; ``lens/dH_dropped/<q>`` per quadrant. w are the weights of
      ``agg`` over the *full* valid mask, so dropped + kept = total (the vanilla step's prediction).
      ``ratio`` defaults to 1 (on-policy); tokens in ``clipped`` (e.g. ``loss.ppo_clipped_mask``) carry 0.

    For PPO's own clipping as a diagnostic, pass ``keep = ~clipped`` and no ``clipped``.
    Every value is None when there is no valid token.
    """
    mask = as_mask(mask)
    keep = as_mask(keep, "keep")
    check_like(keep, mask, "keep")
    check_like(s_centered, mask, "s_centered")
    clipped = check_bool_like(clipped, mask, "clipped")
    if ratio is not None:
        check_like(ratio, mask, "ratio")
    adv = broadcast_advantages(advantages, mask).detach().to(torch.float64)
    s_c = s_centered.detach().to(torch.float64)
    n = int(mask.sum())
    dropped = mask & ~keep
    kept = mask & keep
    quads = _quadrant_masks(adv, s_c)

    w = agg_weights(mask, agg, torch.float64)
    r = None if ratio is None else ratio.detach().to(torch.float64)
    dh = first_order_entropy_change(s_c, adv, weights=w, ratio=r, mask=mask, clipped=clipped)
    contrib = dh.per_token

    out: dict[str, float | None] = {}
    out["lens/drop_frac"] = float(dropped.sum()) / n if n else None
    for q, qm in quads.items():
        nd = int((dropped & qm).sum())
        nq = int((mask & qm).sum())
        out[f"lens/drop_frac/{q}"] = nd / n if n else None
        out[f"lens/drop_rate/{q}"] = nd / nq if nq else None
        out[f"lens/dH_dropped/{q}"] = float(contrib[dropped & qm].sum()) if n else None
    out["lens/dH_dropped"] = float(contrib[dropped].sum()) if n else None
    out["lens/dH_kept"] = float(contrib[kept].sum()) if n else None
    out["lens/dH_total"] = dh.batch
    return out


def quadrant_effects(declared: dict[str, str]) -> dict[str, str]:
    """A method's declared effect per quadrant (``Method.quadrants``), every quadrant named: "all" fills the
    quadrants not named on their own, a quadrant not declared is "-" (untouched). Unknown keys raise."""
    bad = sorted(set(declared) - set(QUADRANTS) - {"all"})
    if bad:
        raise ValueError(f"unknown quadrant(s) {bad}; quadrants: {', '.join(QUADRANTS)} or 'all'")
    return {q: declared.get(q, declared.get("all", "-")) for q in QUADRANTS}


def loss_gradient(inputs: LossInputs, settings: LossSettings) -> Tensor:
    """g_t = −∂L/∂log π_t of the loss (``loss.compute_policy_loss`` of ``inputs`` with ``settings``, the method's
    masks in ``inputs.masks``) at ``inputs.logp`` (float64; 0 off the mask). The vanilla surrogate gives
    g_t = w_t·A_t·r_t on unclipped counted tokens (PPO Eq. 7 with the aggregation weights w). Terms whose gradient
    does not flow through log π_t of the sampled token (the entropy bonus, the reference KL) must be off in
    ``settings``. No metric is read."""
    lp = inputs.logp.detach().to(torch.float64).requires_grad_(True)
    at = replace(inputs, logp=lp, old_logp=inputs.old_logp.detach().to(torch.float64))
    (grad,) = torch.autograd.grad(compute_policy_loss(at, settings).loss, lp)
    return torch.where(at.mask, -grad, torch.zeros_like(grad))


def gradient_coefficients(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                          **loss_kwargs) -> Tensor:
    """``loss_gradient`` as one keyword call: each keyword is the ``LossSettings``, ``Masks`` or ``LossInputs``
    field of that name (``loss.loss_arguments``, as ``loss.policy_loss`` takes them)."""
    return loss_gradient(*loss_arguments(logp, old_logp, advantages, mask, **loss_kwargs))


def weight_lens(g_method: Tensor, g_vanilla: Tensor, advantages: Tensor, s_centered: Tensor,
                mask: Tensor) -> dict[str, float | None]:
    """First-order entropy change of a method's change in token weights, per quadrant (Theorem 3.3 per token).

    With g the gradient coefficients (``gradient_coefficients``) of the method's loss and of the vanilla loss
    on the same tokens and ratios, and per token ΔH_t = −g_t·S_c,t (lr dropped):

    - ``lensw/dH_vanilla`` = Σ −g^vanilla·S_c, ``lensw/dH_method`` = Σ −g^method·S_c;
    - ``lensw/dH_change/<q>`` = Σ_{t∈q} −(g^method − g^vanilla)·S_c; they sum to ``lensw/dH_change`` =
      dH_method − dH_vanilla;
    - per quadrant, the share of its tokens the method ``removed`` (g^vanilla ≠ 0, g^method = 0: drops, zeroing,
      the clip), ``added`` (g^vanilla = 0, g^method ≠ 0: CE-GPPO's clipped tokens, a looser clip) and
      ``reweighted`` (both ≠ 0, different): ``lensw/removed_rate/<q>`` etc. (None for an empty quadrant).

    Every value is None when there is no valid token.
    """
    mask = as_mask(mask)
    for name, x in (("g_method", g_method), ("g_vanilla", g_vanilla), ("s_centered", s_centered)):
        check_like(x, mask, name)
    adv = broadcast_advantages(advantages, mask).detach().to(torch.float64)
    s_c = s_centered.detach().to(torch.float64)
    gm, gv = g_method.detach().to(torch.float64), g_vanilla.detach().to(torch.float64)
    zero = torch.zeros_like(s_c)
    dh_m = torch.where(mask, -gm * s_c, zero)
    dh_v = torch.where(mask, -gv * s_c, zero)
    change = dh_m - dh_v
    n = int(mask.sum())
    out: dict[str, float | None] = {
        "lensw/dH_vanilla": float(dh_v.sum()) if n else None,
        "lensw/dH_method": float(dh_m.sum()) if n else None,
        "lensw/dH_change": float(change.sum()) if n else None,
    }
    removed, added = (gv != 0) & (gm == 0), (gv == 0) & (gm != 0)
    reweighted = (gv != 0) & (gm != 0) & (gv != gm)
    for q, qm in _quadrant_masks(adv, s_c).items():
        qv = mask & qm
        nq = int(qv.sum())
        out[f"lensw/dH_change/{q}"] = float(change[qv].sum()) if n else None
        for key, sel in (("removed", removed), ("added", added), ("reweighted", reweighted)):
            out[f"lensw/{key}_rate/{q}"] = int((sel & qv).sum()) / nq if nq else None
    return out
