"""The "unified lens" of Wang et al. 2026 (arXiv 2602.03392, Sec. 5), made measurable.

For any keep-mask, report which tokens it removes in the quadrants sign(A) × sign(S_c), and the first-order
entropy change those tokens carried: Theorem 3.3 per token with the aggregation weights and the off-policy
factor, −w·A·r·S_c (lr dropped; a PPO-clipped token has no gradient and carries 0), as
``dynamics.first_order_entropy_change`` computes it (formulas: ``entropy_rft.dynamics``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from entropy_rft.control._common import (
    agg_weights,
    as_mask,
    broadcast_advantages,
    check_bool_like,
    check_like,
)
from entropy_rft.dynamics import first_order_entropy_change

__all__ = ["QUADRANTS", "lens_attribution"]

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
