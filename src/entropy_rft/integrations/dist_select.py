"""Global selections without gathering every token: ClipB, ClipV (with its cap), Clip-Cov and KL-Cov on the
batch of all ranks, from O(k + world) numbers per rank instead of every token's score.

The rules are ``control.masks``'s own, run on each rank's rows with the ranks' reductions (``GLOBAL``, a
``control.reductions.Reductions``: the method's hook is called with ``reduce=``), so no rule is restated here.
Each reduction returns what the local one returns on the concatenation of all ranks' rows (in rank order, as
``integrations.dist.all_gather_rows`` builds it), and the rule returns this rank's part:

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
Without a process group (one process) the rules run with ``control.reductions.LOCAL`` (``reductions()``), so
single-process numbers are unchanged bit for bit.

Bytes each rank sends per call, besides a few numbers (sums, counts): top-k 16·min(k, max_r n_r), random
pick 0 (docs/trl.md tabulates them per step).

Which of these a method's selection uses is the method's own declaration, ``Method.exchange`` (a class
variable, inherited; ``control.exchange.EXCHANGES``), read by ``dist_rollout_masks`` and
``dist_minibatch_masks``: ``local`` (each rank's rows as they are), ``tokens`` (the caller gathers), or one of
the statistics (``control.exchange.STATISTICS``: the hook with ``reduce=GLOBAL``). No method class is named here.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import Tensor

from entropy_rft.control._common import as_mask, broadcast_advantages
from entropy_rft.control.carriage import checked_masks
from entropy_rft.control.exchange import exchange_problem
from entropy_rft.control.reductions import LOCAL, Reductions
from entropy_rft.control.registry import Masks, Method
from entropy_rft.core import theory
from entropy_rft.core.dynamics import TokenStats
from entropy_rft.integrations.dist import rank_and_world

__all__ = [
    "GLOBAL",
    "declared_exchange",
    "dist_minibatch_masks",
    "dist_rollout_masks",
    "dist_stats_metrics",
    "gather_small",
    "global_count",
    "global_covariance",
    "global_mean_std",
    "global_random_pick",
    "global_sum",
    "global_top_k",
    "rank_counts",
    "rank_offsets",
    "reductions",
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


# ----------------------------------------------------------------------------- the rules' reductions, over all ranks


def global_count(mask: Tensor) -> int:
    """The valid tokens of every rank (one float64 sum)."""
    return int(global_sum(mask.sum().reshape(1))[0])


def global_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, int]:
    """``control._common.token_covariance`` with the means over all ranks (one round of float64 sums), and the
    global number of valid tokens."""
    lp = logp.detach().to(torch.float64)
    a = broadcast_advantages(advantages, mask).detach().to(torch.float64)
    s = global_sum(torch.stack([lp[mask].sum(), a[mask].sum(),
                                torch.tensor(float(mask.sum()), dtype=torch.float64, device=mask.device)]))
    n = int(s[2])
    if n == 0:
        return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device), 0
    cov = (lp - s[0] / n) * (a - s[1] / n)
    return torch.where(mask, cov, torch.zeros_like(cov)), n


# The reductions of ``control.reductions`` over every rank's tokens: a rule of ``control.masks`` run with them on
# each rank's rows is the rule on the concatenated batch (the module docstring).
GLOBAL = Reductions(count=global_count, mean_std=global_mean_std, top_k=global_top_k, covariance=global_covariance,
                    pick=global_random_pick)


def reductions() -> Reductions:
    """``GLOBAL`` on several ranks; ``control.reductions.LOCAL`` in one process (single-process numbers unchanged
    bit for bit)."""
    return GLOBAL if rank_and_world()[1] > 1 else LOCAL


# ----------------------------------------------------------------------------- methods and batch metrics


def declared_exchange(method: Method) -> str:
    """What ``method``'s selection exchanges across ranks (``Method.exchange``, inherited by subclasses); a method
    that declares none, or one that does not fit its rule, is refused in one line (``control.exchange``)."""
    if (problem := exchange_problem(type(method), on_ranks=True)) is not None:
        raise ValueError(problem)
    return str(method.exchange)


def dist_rollout_masks(method: Method, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks | None:
    """``method.rollout_masks`` of this rank's rows on the batch of all ranks, as the method's ``exchange``
    declares: ``local``, its own rule on this rank's rows as they are (grad_mask, ...); a statistic
    (``control.exchange.STATISTICS``: ClipB, ClipV and their subclasses), its own rule with the ranks'
    reductions (``reductions()``); None for ``tokens`` (80/20: the caller gathers)."""
    how = declared_exchange(method)
    if how == "tokens":
        return None
    extra = {} if how == "local" else {"reduce": reductions()}
    return checked_masks(method, method.rollout_masks(stats, advantages, mask, **extra))


def dist_minibatch_masks(method: Method, logp: Tensor, advantages: Tensor, mask: Tensor, clipped: Tensor | None,
                         generator: torch.Generator | None, old_logp: Tensor | None = None) -> Masks | None:
    """``method.minibatch_masks`` of this rank's rows on the minibatch of all ranks, as the method's ``exchange``
    declares: a statistic (Clip-Cov, KL-Cov and their subclasses), its own rule with the ranks' reductions;
    ``local``, its own rule on this rank's rows (``old_logp`` needed); None for ``tokens`` (the caller
    gathers)."""
    how = declared_exchange(method)
    if how == "tokens":
        return None
    if how == "local" and old_logp is None:
        raise ValueError(f"method {method.name!r} selects on each rank's rows: pass old_logp")
    extra = {} if how == "local" else {"reduce": reductions()}
    old = old_logp if old_logp is not None else logp  # a statistic's rule reads the current log-probs only
    return checked_masks(method, method.minibatch_masks(logp, old, advantages, mask, clipped=clipped,
                                                        generator=generator, **extra))


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
