"""Pure token-mask functions for entropy control. Every function returns a bool tensor shaped like ``mask``.

Padding (``mask == False``) is never kept, never selected and never enters a statistic. Means and stds are
population statistics over the valid tokens passed in. The batch-level rules (ClipB, ClipV, Clip-Cov, KL-Cov) take
their reductions as ``reduce`` (``control.reductions``): this process's tokens by default, every rank's where an
engine passes its global ones (``integrations.dist_select.GLOBAL``), so each rule is written once. The exact rules
are fixed in DESIGN.md ("Semantics of the mask functions"); papers.md restates the papers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from entropy_rft.control._common import (
    ADVANTAGE_SIGNS,
    as_mask,
    broadcast_advantages,
    check_bool_like,
    check_fraction,
    check_like,
    check_mu,
    check_sign,
    count_for_ratio,
    droppable,
)
from entropy_rft.control.reductions import LOCAL, Reductions

__all__ = [
    "clip_b_mask",
    "clip_v_mask",
    "clip_cov_mask",
    "kl_cov_select",
    "high_entropy_mask",
    "grad_mask",
]


def _violation(
    x: Tensor, low: Tensor | None, high: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Whether x < low or x > high, and by how much it lies past the threshold it breaks (0 if none)."""
    excess = torch.zeros_like(x)
    viol = torch.zeros_like(x, dtype=torch.bool)
    if low is not None:
        below = x < low
        viol |= below
        excess = torch.where(below, low - x, excess)
    if high is not None:
        above = x > high
        viol |= above
        excess = torch.where(above, x - high, excess)
    return viol, excess


def _check_common(s: Tensor, s_name: str, advantages: Tensor, mask: Tensor, mu_low, mu_high,
                  sign, signs: tuple[str, ...] = ADVANTAGE_SIGNS) -> tuple[Tensor, Tensor]:
    """(advantages broadcast to the mask, the mask as bool) after the common checks."""
    mask = as_mask(mask)
    check_like(s, mask, s_name)
    check_mu(mu_low, "mu_low")
    check_mu(mu_high, "mu_high")
    check_sign(sign, allowed=signs)
    return broadcast_advantages(advantages, mask), mask


def clip_b_mask(
    s_star: Tensor,
    advantages: Tensor,
    mask: Tensor,
    mu_low: float | None,
    mu_high: float | None,
    advantage_sign: str,
    *,
    reduce: Reductions = LOCAL,
) -> Tensor:
    """ClipB keep-mask (Wang et al. 2026, arXiv 2602.03392, batch-level entropy-discriminator clipping).

    With S = p_k(H + log p_k) the entropy discriminator of the sampled token and m, s its population mean
    and std over the valid tokens, a token whose advantage sign allows it is dropped when
    ``S − m < −mu_low·s`` or ``S − m > mu_high·s``. ``None`` leaves a side unbounded. The paper's rule is
    two-sided with ``advantage_sign="any"``; the released code is ``mu_low=mu, mu_high=None,
    advantage_sign="negative"`` (A < 0 strictly).
    """
    adv, mask = _check_common(s_star, "s_star", advantages, mask, mu_low, mu_high, advantage_sign)
    mean, std, n = reduce.mean_std(s_star, mask)
    if n == 0:
        return mask.clone()
    d = s_star.detach().to(torch.float64) - mean
    low = -mu_low * std if mu_low is not None else None
    high = mu_high * std if mu_high is not None else None
    viol, _ = _violation(d, low, high)
    drop = viol & mask & droppable(adv, advantage_sign)
    return mask & ~drop


# ClipV's advantage rules: "released" is Trinity-RFT's clipv_advantage.py (A > 0 kept; A < 0 violators dropped,
# at most K of them; A == 0 violators dropped, outside the cap); the others as ``droppable`` (all capped).
CLIP_V_SIGNS = ("released", *ADVANTAGE_SIGNS)
RELEASED_MIN_STD = 1e-12  # the released code keeps every token when the std of S_c is below this


def clip_v_mask(
    s_centered: Tensor,
    advantages: Tensor,
    mask: Tensor,
    mu_low: float | None,
    mu_high: float | None,
    advantage_sign: str,
    max_frac: float | None = None,
    *,
    reduce: Reductions = LOCAL,
) -> Tensor:
    """ClipV keep-mask (Wang et al. 2026, arXiv 2602.03392, vocabulary-level clipping).

    S_c = S_k − E_{i~p}[S_i] (Theorem 3.3) is compared *uncentred*: a token whose advantage sign allows
    it is a violator when ``S_c < −mu_low·s_c`` or ``S_c > mu_high·s_c``, with s_c the population std of
    S_c about its batch mean over the valid tokens.

    Cap (released code): with N valid tokens and K = max(int(max_frac·N), 1), if there are more than K
    capped violators only the K lying farthest past their threshold are dropped; ties go to the earlier
    position in row-major order. ``max_frac=None`` means no cap. ``advantage_sign`` (``CLIP_V_SIGNS``):
    "released" is the authors' rule (Trinity-RFT ``clipv_advantage.py``): A > 0 tokens are kept, A < 0
    violators are capped, A == 0 violators are dropped outside the cap (they carry no gradient, but leave
    the token-mean loss's denominator), and every token is kept when s_c < 1e-12; "negative", "positive" and
    "any" drop only the violators of that sign, all of them capped.
    """
    adv, mask = _check_common(s_centered, "s_centered", advantages, mask, mu_low, mu_high, advantage_sign,
                              CLIP_V_SIGNS)
    if max_frac is not None:
        check_fraction(max_frac, "max_frac")
    _, std, n = reduce.mean_std(s_centered, mask)
    if n == 0 or (advantage_sign == "released" and float(std) < RELEASED_MIN_STD):
        return mask.clone()
    x = s_centered.detach().to(torch.float64)
    low = -mu_low * std if mu_low is not None else None
    high = mu_high * std if mu_high is not None else None
    viol, excess = _violation(x, low, high)
    k = max(int(max_frac * n), 1) if max_frac is not None else None
    return mask & ~clip_v_drop(viol & mask, excess, adv, advantage_sign, k, reduce.top_k)


def clip_v_drop(viol: Tensor, excess: Tensor, adv: Tensor, advantage_sign: str, k: int | None,
                top_k) -> Tensor:
    """The tokens ClipV drops among the valid violators ``viol``: those its advantage rule allows, with at most
    ``k`` of the capped ones (``None``: no cap), the ``top_k(excess, k)`` farthest past the threshold."""
    if advantage_sign == "released":
        capped, free = viol & (adv < 0), viol & (adv == 0)
    else:
        capped, free = viol & droppable(adv, advantage_sign), torch.zeros_like(viol)
    if k is not None:
        flat = capped.flatten()
        idx = flat.nonzero().squeeze(-1)
        kept = torch.zeros_like(flat)
        kept[idx[top_k(excess.flatten()[idx], k)]] = True
        capped = kept.view(viol.shape)
    return capped | free


def clip_cov_mask(
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ratio: float,
    lb: float,
    ub: float,
    generator: torch.Generator | None = None,
    exclude: Tensor | None = None,
    *,
    reduce: Reductions = LOCAL,
) -> Tensor:
    """Clip-Cov keep-mask; False marks a token whose loss is zeroed (Cui et al. 2025, arXiv 2505.22617).

    cov_t = (logp_t − mean logp)(A_t − mean A) over the valid tokens (logp detached). Candidates are
    valid tokens not in ``exclude`` (the reference excludes PPO-clipped tokens) with ``lb < cov < ub``.
    max(int(ratio·N), 1) of them are picked uniformly at random with ``generator`` (all of them if fewer);
    ``ratio == 0`` picks none. The keep-mask is ``mask & ~picked``; a caller passes ``mask & ~keep`` to
    ``policy_loss`` as ``zeroed``, so picked tokens still count.
    """
    mask = as_mask(mask)
    check_like(logp, mask, "logp")
    check_fraction(ratio, "ratio")
    for v, name in ((lb, "lb"), (ub, "ub")):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
            raise ValueError(f"{name} must be a number, got {v!r}")
    if not lb < ub:
        raise ValueError(f"lb must be < ub, got lb={lb!r}, ub={ub!r}")
    exclude = check_bool_like(exclude, mask, "exclude")
    adv = broadcast_advantages(advantages, mask)
    cov, n = reduce.covariance(logp, adv, mask)
    k = count_for_ratio(ratio, n)
    if k == 0:
        return mask.clone()
    cand = mask & (cov > lb) & (cov < ub)
    if exclude is not None:
        cand &= ~exclude
    idx = cand.flatten().nonzero().squeeze(-1)
    idx = idx[reduce.pick(idx.numel(), k, generator, idx.device)]
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    picked[idx] = True
    return mask & ~picked.view(mask.shape)


def kl_cov_select(logp: Tensor, advantages: Tensor, mask: Tensor, ratio: float, *,
                  reduce: Reductions = LOCAL) -> Tensor:
    """KL-Cov selected-mask (Cui et al. 2025, arXiv 2505.22617).

    Selects the top max(int(ratio·N), 1) valid tokens by cov_t = (logp_t − mean logp)(A_t − mean A)
    (logp detached; ties go to the earlier position). ``ratio == 0`` selects none. ``policy_loss`` adds
    kl_cov_coef·|logp − old_logp| on the selected tokens.
    """
    mask = as_mask(mask)
    check_like(logp, mask, "logp")
    check_fraction(ratio, "ratio")
    adv = broadcast_advantages(advantages, mask)
    cov, n = reduce.covariance(logp, adv, mask)
    k = count_for_ratio(ratio, n)
    sel = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if k == 0:
        return sel.view(mask.shape)
    idx = mask.flatten().nonzero().squeeze(-1)
    sel[idx[reduce.top_k(cov.flatten()[idx], k)]] = True
    return sel.view(mask.shape)


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_q: float) -> Tensor:
    """Keep-mask of the top-q fraction of valid tokens by entropy, the "80/20" rule.

    Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for LLM
    Reasoning", arXiv 2506.01939: only the highest-entropy ~20% of tokens get policy gradient. Here
    k = round-half-up(top_q·N), at least 1 when top_q > 0; ties go to the earlier position. ``top_q=1``
    keeps every valid token, ``top_q=0`` none.
    """
    mask = as_mask(mask)
    check_like(entropy, mask, "entropy")
    check_fraction(top_q, "top_q")
    n = int(mask.sum())
    keep = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if n == 0 or top_q == 0:
        return keep.view(mask.shape)
    k = min(max(int(math.floor(top_q * n + 0.5)), 1), n)
    idx = mask.flatten().nonzero().squeeze(-1)
    ent = entropy.detach().to(torch.float64).flatten()[idx]
    order = torch.sort(ent, descending=True, stable=True).indices
    keep[idx[order[:k]]] = True
    return keep.view(mask.shape)


def grad_mask(
    s: Tensor,
    advantages: Tensor,
    mask: Tensor,
    sample_sign: str,
    s_sign: str,
    drop_other_samples: bool = True,
) -> Tensor:
    """Keep-mask of the gradient-masking ablation (Wang et al. 2026, arXiv 2602.03392, Sec. 4).

    Among tokens with sign(A) = ``sample_sign`` (strict: "positive" is A > 0, "negative" A < 0) only those
    with sign(s) = ``s_sign`` (strict) train. Tokens of the other samples (including A == 0) are dropped
    when ``drop_other_samples`` (default) and train normally otherwise. ``s`` is S (``s_star``) or S_c.
    The paper's four conditions are the four (sample_sign, s_sign) combinations.
    """
    mask = as_mask(mask)
    check_like(s, mask, "s")
    check_sign(sample_sign, "sample_sign", ("positive", "negative"))
    check_sign(s_sign, "s_sign", ("positive", "negative"))
    if not isinstance(drop_other_samples, bool):
        raise ValueError(f"drop_other_samples must be a bool, got {drop_other_samples!r}")
    adv = broadcast_advantages(advantages, mask)
    chosen = adv > 0 if sample_sign == "positive" else adv < 0
    s_ok = s > 0 if s_sign == "positive" else s < 0
    keep = chosen & s_ok
    if not drop_other_samples:
        keep |= ~chosen
    return mask & keep
