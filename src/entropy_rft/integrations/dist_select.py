"""Global selections without gathering every token: ClipB, ClipV (with its cap), Clip-Cov and KL-Cov on the
batch of all ranks, from O(k + world) numbers per rank instead of every token's score.

Each function equals its ``control.masks`` rule applied to the concatenation of all ranks' rows (in rank
order, as ``integrations.dist.all_gather_rows`` builds it), and returns this rank's part:

- **Means and stds** (ClipB's m and s, ClipV's s_c, the covariance's means): float64 partial sums per rank
  (sum and count, then, two-pass, the sum of squared deviations about the global mean), all-gathered and
  added in rank order, so every rank holds the same bits. They equal the single-process statistics up to
  float64 summation order (relative differences ~1e-16, not bit for bit).
- **Top-k** (KL-Cov's k tokens of largest cov, ClipV's cap on the violators): two stages. Each rank sorts its
  own candidates (score descending, ties to the earlier position) and sends its first min(k, n_r) scores
  (float64) and global positions (int64); every rank merges the world·k candidates by (score descending,
  global position ascending) and keeps the first k. The global top k under that total order lies in the
  union of the local top k, so this is the single-process selection, ties included: ``control.masks``
  breaks ties by the earlier row-major position of the concatenated batch, i.e. by (global row, column),
  which is the order of the global position used here (earlier ranks first, then row-major within a rank).
- **Clip-Cov's random pick**: the ranks exchange their candidate counts c_r; every rank draws the same
  ``torch.randperm(C, generator)`` of the C = Σ c_r global candidates (the single-process call, same
  generator, same device), takes its first k, and keeps the positions in [offset_r, offset_r + c_r).
  Candidates are numbered in (rank, row-major) order, the single-process order of ``nonzero()``.

A score that sits within float64 rounding of a threshold, or two scores that differ only in the last bits of
the means they subtract, could order differently from the single-process run; exact ties cannot.
Without a process group (one process) every function calls the ``control.masks`` rule itself, so single-
process numbers are unchanged bit for bit.

Bytes each rank sends per call, besides a few numbers (sums, counts): top-k 16·min(k, max_r n_r), random
pick 0 (docs/trl.md tabulates them per step).

Which of these a method's selection uses is the method's own declaration, ``Method.exchange`` (a class
variable, inherited; ``control.exchange.EXCHANGES``), read by ``dist_rollout_masks`` and
``dist_minibatch_masks``: ``local`` (each rank's rows as they are), ``tokens`` (the caller gathers), or one of
the statistics of ``ROLLOUT_EXCHANGES`` / ``MINIBATCH_EXCHANGES``. No method class is named here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist
from torch import Tensor

from entropy_rft.control._common import (
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
from entropy_rft.control.carriage import checked_masks
from entropy_rft.control.exchange import exchange_problem
from entropy_rft.control.masks import (
    CLIP_V_SIGNS,
    RELEASED_MIN_STD,
    _violation,
    clip_b_mask,
    clip_cov_mask,
    clip_v_drop,
    clip_v_mask,
    kl_cov_select,
)
from entropy_rft.control.paper_methods import warn_tiny_cap
from entropy_rft.control.registry import Masks, Method
from entropy_rft.core import theory
from entropy_rft.core.dynamics import TokenStats
from entropy_rft.integrations.dist import rank_and_world

__all__ = [
    "MINIBATCH_EXCHANGES",
    "ROLLOUT_EXCHANGES",
    "declared_exchange",
    "dist_clip_b_mask",
    "dist_clip_cov_mask",
    "dist_clip_v_mask",
    "dist_kl_cov_select",
    "dist_minibatch_masks",
    "dist_rollout_masks",
    "dist_stats_metrics",
    "gather_small",
    "global_mean_std",
    "global_random_pick",
    "global_sum",
    "global_top_k",
    "rank_counts",
    "rank_offsets",
]


def gather_small(x: Tensor) -> list[Tensor]:
    """Every rank's ``x`` (same shape and dtype on all ranks), in rank order (all_gather)."""
    _, world = rank_and_world()
    if world == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(world)]
    torch_dist.all_gather(parts, x.contiguous())
    return parts


def global_sum(x: Tensor) -> Tensor:
    """Σ over ranks of ``x`` (float64), added in rank order on every rank, so all ranks hold the same bits
    (an all-reduce may not promise that)."""
    parts = gather_small(x.to(torch.float64))
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def rank_counts(n: int, device: torch.device) -> list[int]:
    """Every rank's ``n``, in rank order (one int64 per rank)."""
    return [int(c) for c in gather_small(torch.tensor([n], dtype=torch.long, device=device))]


def rank_offsets(n: int, device: torch.device) -> tuple[int, int]:
    """(Σ of ``n`` over the earlier ranks, Σ over all ranks): this rank's first global position."""
    counts = rank_counts(n, device)
    return sum(counts[: rank_and_world()[0]]), sum(counts)


def global_mean_std(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """``control._common.masked_mean_std`` over all ranks' valid tokens: population mean and std (float64) and
    n, from two rounds of float64 partial sums (sum and count; then the squared deviations about the global
    mean). Mean and std 0 when no rank has a valid token."""
    xd = x.detach().to(torch.float64)[mask]
    s = global_sum(torch.stack([xd.sum(), torch.tensor(float(xd.numel()), dtype=torch.float64, device=x.device)]))
    n = int(s[1])
    if n == 0:
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return zero, zero, 0
    mean = s[0] / n
    ss = global_sum(((xd - mean) ** 2).sum().reshape(1))[0]
    return mean, torch.sqrt(ss / n), n


def global_top_k(score: Tensor, k: int) -> Tensor:
    """Which of this rank's candidates (``score``, 1-D, in this rank's row-major order) are among the k of
    largest score over all ranks' candidates; ties go to the earlier global position (rank, then position).
    Two stages: a local top-k, then each rank's first min(k, n_r) candidates (16 bytes each, padded to the
    largest such count) gathered and merged. Bool, like ``score``. All candidates when there are at most k."""
    n = score.numel()
    counts = rank_counts(n, score.device)
    offset, total = sum(counts[: rank_and_world()[0]]), sum(counts)
    out = torch.zeros(n, dtype=torch.bool, device=score.device)
    if total <= k:
        out[:] = True
        return out
    if k == 0:
        return out
    m, width = min(k, n), max(min(k, c) for c in counts)
    order = torch.sort(score, descending=True, stable=True).indices[:m]
    send_score = torch.full((width,), float("-inf"), dtype=torch.float64, device=score.device)
    send_pos = torch.full((width,), -1, dtype=torch.long, device=score.device)
    send_score[:m] = score.to(torch.float64)[order]
    send_pos[:m] = order + offset
    scores = torch.cat(gather_small(send_score))
    pos = torch.cat(gather_small(send_pos))
    real = pos >= 0
    scores, pos = scores[real], pos[real]
    by_pos = torch.sort(pos).indices  # positions are distinct: ascending position first,
    scores, pos = scores[by_pos], pos[by_pos]
    best = torch.sort(scores, descending=True, stable=True).indices[:k]  # then score, ties kept in position order
    top = pos[best]
    mine = top[(top >= offset) & (top < offset + n)] - offset
    out[mine] = True
    return out


def global_random_pick(n: int, k: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """The positions among this rank's n candidates that the single-process draw picks: k of all ranks' C
    candidates uniformly at random, ``torch.randperm(C, generator)[:k]`` (all of them when C <= k), numbered
    in rank order. Only the counts travel (one int64 per rank)."""
    offset, total = rank_offsets(n, device)
    if total <= k:
        return torch.arange(n, device=device)
    dev = generator.device if generator is not None else torch.device("cpu")
    perm = torch.randperm(total, generator=generator, device=dev).to(device)[:k]
    return perm[(perm >= offset) & (perm < offset + n)] - offset


# ----------------------------------------------------------------------------- the rules, over all ranks


def dist_clip_b_mask(s_star: Tensor, advantages: Tensor, mask: Tensor, mu_low: float | None,
                     mu_high: float | None, advantage_sign: str) -> Tensor:
    """``control.clip_b_mask`` on the batch of all ranks; this rank's rows (mean and std: ``global_mean_std``)."""
    if rank_and_world()[1] == 1:
        return clip_b_mask(s_star, advantages, mask, mu_low, mu_high, advantage_sign)
    mask = as_mask(mask)
    check_like(s_star, mask, "s_star")
    check_mu(mu_low, "mu_low")
    check_mu(mu_high, "mu_high")
    check_sign(advantage_sign)
    adv = broadcast_advantages(advantages, mask)
    mean, std, n = global_mean_std(s_star, mask)
    if n == 0:
        return mask.clone()
    d = s_star.detach().to(torch.float64) - mean
    viol, _ = _violation(d, -mu_low * std if mu_low is not None else None,
                         mu_high * std if mu_high is not None else None)
    return mask & ~(viol & mask & droppable(adv, advantage_sign))


def dist_clip_v_mask(s_centered: Tensor, advantages: Tensor, mask: Tensor, mu_low: float | None,
                     mu_high: float | None, advantage_sign: str, max_frac: float | None = None) -> Tensor:
    """``control.clip_v_mask`` on the batch of all ranks; this rank's rows. s_c from ``global_mean_std``; the
    cap keeps the K = max(int(max_frac·N), 1) violators farthest past their threshold (``global_top_k``)."""
    if rank_and_world()[1] == 1:
        return clip_v_mask(s_centered, advantages, mask, mu_low, mu_high, advantage_sign, max_frac)
    mask = as_mask(mask)
    check_like(s_centered, mask, "s_centered")
    check_mu(mu_low, "mu_low")
    check_mu(mu_high, "mu_high")
    check_sign(advantage_sign, allowed=CLIP_V_SIGNS)
    if max_frac is not None:
        check_fraction(max_frac, "max_frac")
    adv = broadcast_advantages(advantages, mask)
    _, std, n = global_mean_std(s_centered, mask)
    if n == 0 or (advantage_sign == "released" and float(std) < RELEASED_MIN_STD):
        return mask.clone()
    x = s_centered.detach().to(torch.float64)
    viol, excess = _violation(x, -mu_low * std if mu_low is not None else None,
                              mu_high * std if mu_high is not None else None)
    k = max(int(max_frac * n), 1) if max_frac is not None else None
    return mask & ~clip_v_drop(viol & mask, excess, adv, advantage_sign, k, global_top_k)


def _global_covariance(logp: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, int]:
    """``control._common.token_covariance`` with the means over all ranks (one round of float64 sums), and
    the global number of valid tokens."""
    lp = logp.detach().to(torch.float64)
    a = adv.detach().to(torch.float64)
    s = global_sum(torch.stack([lp[mask].sum(), a[mask].sum(),
                                torch.tensor(float(mask.sum()), dtype=torch.float64, device=mask.device)]))
    n = int(s[2])
    if n == 0:
        return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device), 0
    cov = (lp - s[0] / n) * (a - s[1] / n)
    return torch.where(mask, cov, torch.zeros_like(cov)), n


def dist_clip_cov_mask(logp: Tensor, advantages: Tensor, mask: Tensor, ratio: float, lb: float, ub: float,
                       generator: torch.Generator | None = None, exclude: Tensor | None = None) -> Tensor:
    """``control.clip_cov_mask`` on the batch of all ranks; this rank's rows. The covariance's means from
    float64 sums, the pick from the exchanged candidate counts (``global_random_pick``)."""
    if rank_and_world()[1] == 1:
        return clip_cov_mask(logp, advantages, mask, ratio, lb, ub, generator, exclude)
    mask = as_mask(mask)
    check_like(logp, mask, "logp")
    check_fraction(ratio, "ratio")
    if not lb < ub:
        raise ValueError(f"lb must be < ub, got lb={lb!r}, ub={ub!r}")
    exclude = check_bool_like(exclude, mask, "exclude")
    cov, n = _global_covariance(logp, broadcast_advantages(advantages, mask), mask)
    k = count_for_ratio(ratio, n)
    if k == 0:
        return mask.clone()
    cand = mask & (cov > lb) & (cov < ub)
    if exclude is not None:
        cand &= ~exclude
    idx = cand.flatten().nonzero().squeeze(-1)
    idx = idx[global_random_pick(idx.numel(), k, generator, idx.device)]
    picked = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    picked[idx] = True
    return mask & ~picked.view(mask.shape)


def dist_kl_cov_select(logp: Tensor, advantages: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """``control.kl_cov_select`` on the batch of all ranks; this rank's rows (``global_top_k`` by cov)."""
    if rank_and_world()[1] == 1:
        return kl_cov_select(logp, advantages, mask, ratio)
    mask = as_mask(mask)
    check_like(logp, mask, "logp")
    check_fraction(ratio, "ratio")
    cov, n = _global_covariance(logp, broadcast_advantages(advantages, mask), mask)
    k = count_for_ratio(ratio, n)
    sel = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if k == 0:
        return sel.view(mask.shape)
    idx = mask.flatten().nonzero().squeeze(-1)
    sel[idx[global_top_k(cov.flatten()[idx], k)]] = True
    return sel.view(mask.shape)


# ----------------------------------------------------------------------------- methods and batch metrics


def declared_exchange(method: Method) -> str:
    """What ``method``'s selection exchanges across ranks (``Method.exchange``, inherited by subclasses); a method
    that declares none, or one that does not fit its rule, is refused in one line (``control.exchange``)."""
    if (problem := exchange_problem(type(method), on_ranks=True)) is not None:
        raise ValueError(problem)
    return str(method.exchange)


def _clip_b_rule(method: Any, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
    """``s_star_mean_std``: ``clip_b_mask`` with the method's ``thresholds()`` and ``advantage_sign``."""
    low, high = method.thresholds()
    return Masks(keep=dist_clip_b_mask(stats.s_star, advantages, mask, low, high, method.advantage_sign))


def _clip_v_rule(method: Any, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
    """``s_centered_std_top_k``: ``clip_v_mask`` with the method's ``thresholds()``, ``advantage_sign`` and
    ``max_frac``; the tiny-cap warning counts the global batch's tokens."""
    if method.max_frac is not None:
        warn_tiny_cap(method, int(global_sum(as_mask(mask).sum().reshape(1))[0]))
    low, high = method.thresholds()
    return Masks(keep=dist_clip_v_mask(stats.s_centered, advantages, mask, low, high, method.advantage_sign,
                                       method.max_frac))


def _clip_cov_rule(method: Any, logp: Tensor, advantages: Tensor, mask: Tensor, clipped: Tensor | None,
                   generator: torch.Generator | None) -> Masks:
    """``covariance_random_pick``: ``clip_cov_mask`` with the method's ``ratio``, ``lb``, ``ub`` and
    ``exclude_clipped``."""
    keep = dist_clip_cov_mask(logp.detach(), advantages, mask, method.ratio, method.lb, method.ub,
                              generator=generator, exclude=clipped if method.exclude_clipped else None)
    return Masks(zeroed=mask & ~keep)


def _kl_cov_rule(method: Any, logp: Tensor, advantages: Tensor, mask: Tensor, clipped: Tensor | None,
                 generator: torch.Generator | None) -> Masks:
    """``covariance_top_k``: ``kl_cov_select`` with the method's ``ratio``."""
    return Masks(kl_cov_select=dist_kl_cov_select(logp.detach(), advantages, mask, method.ratio))


# The statistics of control.exchange.EXCHANGES, by stage (tests/test_dist_select.py keeps the two lists equal).
ROLLOUT_EXCHANGES = {"s_star_mean_std": _clip_b_rule, "s_centered_std_top_k": _clip_v_rule}
MINIBATCH_EXCHANGES = {"covariance_random_pick": _clip_cov_rule, "covariance_top_k": _kl_cov_rule}


def dist_rollout_masks(method: Method, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks | None:
    """``method.rollout_masks`` of this rank's rows on the batch of all ranks, as the method's ``exchange``
    declares: ``local``, its own rule on this rank's rows as they are (grad_mask, ...); a statistic
    (``ROLLOUT_EXCHANGES``: ClipB, ClipV and their subclasses) from sums and top-k candidates; None for
    ``tokens`` (80/20: the caller gathers)."""
    how = declared_exchange(method)
    if how == "local":  # per-token rules: no batch statistic
        return checked_masks(method, method.rollout_masks(stats, advantages, mask))
    return None if how == "tokens" else ROLLOUT_EXCHANGES[how](method, stats, advantages, mask)


def dist_minibatch_masks(method: Method, logp: Tensor, advantages: Tensor, mask: Tensor, clipped: Tensor | None,
                         generator: torch.Generator | None, old_logp: Tensor | None = None) -> Masks | None:
    """``method.minibatch_masks`` of this rank's rows on the minibatch of all ranks, as the method's ``exchange``
    declares: a statistic (``MINIBATCH_EXCHANGES``: Clip-Cov, KL-Cov and their subclasses) from sums, counts and
    top-k candidates; ``local``, its own rule on this rank's rows (``old_logp`` needed); None for ``tokens``
    (the caller gathers)."""
    how = declared_exchange(method)
    if how == "local":
        if old_logp is None:
            raise ValueError(f"method {method.name!r} selects on each rank's rows: pass old_logp")
        return checked_masks(method, method.minibatch_masks(logp, old_logp, advantages, mask, clipped=clipped,
                                                            generator=generator))
    return None if how == "tokens" else MINIBATCH_EXCHANGES[how](method, logp, advantages, mask, clipped, generator)


def dist_stats_metrics(st: TokenStats, adv: Tensor, mask: Tensor) -> dict[str, float | None]:
    """``metrics.stats_metrics`` over all ranks' tokens from two rounds of float64 sums (means; then squared
    deviations and cross products about the global means): equal to the single-process figures up to float64
    summation order. ``adv`` per token [B, T]."""
    m = as_mask(mask)
    f = {k: getattr(st, k).detach().to(torch.float64)[m] for k in ("entropy", "logp", "s_star", "s_expected",
                                                                     "s_centered")}
    a = adv.detach().to(torch.float64)[m]
    dh = theory.first_order_entropy_change(st.s_centered, adv, mask=m).per_token.to(torch.float64)[m]
    keys = ("entropy", "s_star", "s_centered", "s_expected", "logp")
    one = torch.tensor(float(m.sum()), dtype=torch.float64, device=m.device)
    s = global_sum(torch.stack([*(f[k].sum() for k in keys), a.sum(), dh.sum(), one]))
    n = int(s[-1])
    if n == 0:
        return {k: None for k in ("entropy/mean", "dynamics/s_star_mean", "dynamics/s_star_std",
                                  "dynamics/s_centered_mean", "dynamics/s_centered_std", "dynamics/s_expected_mean",
                                  "dynamics/cov_logp_adv", "dynamics/cov_adv_s_centered", "dynamics/pred_dH")}
    mean = dict(zip((*keys, "adv", "dh"), (s[:-1] / n).unbind()))
    d = {k: f[k] - mean[k] for k in ("s_star", "s_centered", "logp")}
    da = a - mean["adv"]
    q = global_sum(torch.stack([(d["s_star"] ** 2).sum(), (d["s_centered"] ** 2).sum(), (d["logp"] * da).sum(),
                                (da * d["s_centered"]).sum()])) / n
    return {
        "entropy/mean": float(mean["entropy"]),
        "dynamics/s_star_mean": float(mean["s_star"]),
        "dynamics/s_star_std": float(q[0]) ** 0.5,
        "dynamics/s_centered_mean": float(mean["s_centered"]),
        "dynamics/s_centered_std": float(q[1]) ** 0.5,
        "dynamics/s_expected_mean": float(mean["s_expected"]),
        "dynamics/cov_logp_adv": float(q[2]),
        "dynamics/cov_adv_s_centered": float(q[3]),
        "dynamics/pred_dH": float(mean["dh"]),
    }
