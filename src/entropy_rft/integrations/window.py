"""Global selections for an engine that splits its batches over ranks and micro-batches.

- A generation batch: ``global_rollout_batch`` builds the rollout-stage masks (ClipB, ClipV, 80/20,
  grad-mask) of this rank's rows, as chosen on the batch of all ranks, by what the method's ``exchange``
  declares (``integrations.dist_select``): ClipB and ClipV from exchanged sums and top-k candidates, per-token
  rules on each rank's rows, the others (``tokens``) by all-gathering the old-policy TokenStats, advantages and
  mask. ``global_batch_metrics`` gives the batch metrics from sums over ranks.
- An optimizer window (one optimizer step's micro-batches, gradient accumulation): ``select_window`` runs
  ``control.select_minibatch`` (the one rule of all engines) once on the window's micro-batches of all ranks
  (``global_minibatch_selection``), splits the result back per local micro-batch, and gives the factors
  (``global_loss_scales``, ``control.microbatch_loss_scale``) that make the accumulated, DDP-averaged
  gradient that of the window's loss over the global counted tokens.
- A step's metrics row (``StepMetrics``): the mean of each metric over the step's micro-batches, and the
  kept and zeroed fractions over the global token counts of its windows.

Engine-neutral (no TRL, no verl): the gathers are ``integrations.dist`` (the identity without a process
group), so every rank runs the unchanged ``control`` functions on the same inputs and gets the same result;
Clip-Cov, KL-Cov, ClipB and ClipV (their ``Method.exchange``) instead exchange O(k + world) numbers per rank
(``integrations.dist_select``) and give the same selection. Without a process group every number is the
single-process one, bit for bit.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from entropy_rft.common.metric_names import mean_defined
from entropy_rft.control.carriage import checked_masks
from entropy_rft.control.registry import Method
from entropy_rft.control.selection import MinibatchSelection, combine_selection, microbatch_loss_scale, select_minibatch
from entropy_rft.core.dynamics import TokenStats
from entropy_rft.core.loss import agg_weights, aggregation_weights, ppo_clipped_mask
from entropy_rft.core.loss_types import MASK_FIELDS, LossSettings, Masks, check_agg, ratio_clip
from entropy_rft.core.metrics import stats_metrics
from entropy_rft.integrations.dist import all_gather_rows, all_reduce_sum, rank_and_world
from entropy_rft.integrations.dist_select import (
    dist_minibatch_masks,
    dist_rollout_masks,
    dist_stats_metrics,
    gather_small,
    global_sum,
)
from entropy_rft.integrations.stats_forward import map_stats

__all__ = [
    "GlobalBatch",
    "StepMetrics",
    "Window",
    "global_batch_metrics",
    "global_loss_scales",
    "global_minibatch_masks",
    "global_minibatch_selection",
    "global_rollout_batch",
    "kept_fractions",
    "select_window",
    "window_token_counts",
]


def _local_rows(x: Tensor | None, rows: slice, width: int) -> Tensor | None:
    """This rank's ``rows`` of a gathered [N, T] tensor, cut back to its own ``width`` (None stays None)."""
    return None if x is None else x[rows, :width]


def _pad_cols(x: Tensor, width: int, value: float | bool) -> Tensor:
    if x.shape[1] == width:
        return x
    out = torch.full((x.shape[0], width), value, dtype=x.dtype, device=x.device)
    out[:, : x.shape[1]] = x
    return out


def _cat_rows(xs: list[Tensor], value: float | bool) -> Tensor:
    width = max(x.shape[1] for x in xs)
    return torch.cat([_pad_cols(x, width, value) for x in xs])


def _split_rows(x: Tensor | None, like: list[Tensor]) -> list[Tensor | None]:
    if x is None:
        return [None] * len(like)
    out, r = [], 0
    for m in like:
        out.append(x[r : r + m.shape[0], : m.shape[1]])
        r += m.shape[0]
    return out


# ----------------------------------------------------------------------------- a generation batch


class GlobalBatch(NamedTuple):
    """A generation batch: this rank's rows, and their part of the rollout-stage masks chosen on the batch of
    all ranks."""

    stats: TokenStats  # this rank's [B, T] (float32)
    adv: Tensor  # [B] sequence advantages (float32)
    mask: Tensor  # [B, T] bool
    masks: Masks  # this rank's rows of the global rollout-stage masks (keep, ...), [B, T]

    def local_keep(self, mask: Tensor) -> Tensor:
        """This rank's rollout keep mask ∧ its response ``mask`` ([B, T] bool)."""
        keep = self.masks.keep
        return mask.clone() if keep is None else keep[:, : mask.shape[1]] & mask


def _local_masks(m: Masks, rows: slice, width: int) -> Masks:
    """This rank's ``rows`` of every mask of ``m``, cut back to its own ``width``."""
    return m.map(lambda x: x[rows, :width])


def global_rollout_batch(method: Method, stats: TokenStats, adv: Tensor, mask: Tensor) -> GlobalBatch:
    """The rollout-stage masks (ClipB, ClipV, 80/20, grad-mask, ...) of this rank's rows, chosen on the
    generation batch of all ranks (identical to the single-process masks of the concatenated batch).

    As the method's ``exchange`` declares (``dist_select.dist_rollout_masks``): ClipB and ClipV exchange only
    sums and their cap's top-k candidates, a per-token rule (``local``) runs on this rank's rows, and a method
    that exchanges its ``tokens`` all-gathers the old-policy TokenStats, advantages and mask and runs
    ``method.rollout_masks`` on the concatenation. ``mask`` must be bool; ``adv`` per sequence ([B])."""
    stats = map_stats(lambda x: x.float(), stats)
    adv = adv.float()
    masks = Masks()
    if method.stage == "rollout":
        found = dist_rollout_masks(method, stats, adv, mask) if rank_and_world()[1] > 1 else None
        if found is None:
            g_stats = map_stats(lambda x: all_gather_rows(x, 0.0)[0], stats)
            g_adv, rows = all_gather_rows(adv, 0.0)
            g_mask, _ = all_gather_rows(mask, False)
            found = _local_masks(checked_masks(method, method.rollout_masks(g_stats, g_adv, g_mask)), rows,
                                 mask.shape[1])
        masks = found
    return GlobalBatch(stats, adv, mask, masks)


def global_batch_metrics(gb: GlobalBatch, truncated: Tensor | None = None) -> dict[str, float | None]:
    """The native trainer's per-step batch metrics (same names), over the generation batch of all ranks.
    ``truncated``: this rank's [B] flags of the responses that hit the length limit. With several ranks the
    figures come from float64 sums over ranks (``dist_select.dist_stats_metrics``), equal to the single-
    process ones up to summation order; no token is gathered."""
    st, m = gb.stats, gb.mask
    adv = gb.adv[:, None].expand_as(m).float() * m
    keep = m if gb.masks.keep is None else m & gb.masks.keep
    if rank_and_world()[1] > 1:
        t = torch.zeros(1, device=m.device) if truncated is None else truncated.float()
        n_flags = 0 if truncated is None else truncated.numel()
        n_valid, n_kept, rows, n_trunc, n_flags = global_sum(torch.stack([x.double() for x in (
            m.sum(), keep.sum(), torch.tensor(m.shape[0], device=m.device), t.sum(),
            torch.tensor(n_flags, device=m.device))])).tolist()
        out = {**dist_stats_metrics(st, adv, m),
               "control/rollout_kept_frac": n_kept / n_valid if n_valid else None,
               "response/length": n_valid / rows if rows else None}
        if truncated is not None:
            out["response/truncated_frac"] = n_trunc / n_flags if n_flags else None
        return out
    n_valid = int(m.sum())
    out = {
        **stats_metrics(st, adv, m),
        "control/rollout_kept_frac": int(keep.sum()) / n_valid if n_valid else None,
        "response/length": float(m.sum(-1).float().mean()) if m.shape[0] else None,
    }
    if truncated is not None:
        out["response/truncated_frac"] = float(truncated.float().mean()) if truncated.numel() else None
    return out


# ----------------------------------------------------------------------------- an optimizer window


def global_minibatch_selection(method: Method, cur: list[Tensor] | None, old: list[Tensor], adv: list[Tensor],
                               mask: list[Tensor], keep: list[Tensor | None],
                               settings: LossSettings | Mapping[str, Any],
                               generator: torch.Generator | None) -> list[MinibatchSelection]:
    """``control.select_minibatch`` over one optimizer step's micro-batches of all ranks.

    Each argument lists this rank's micro-batches ([b_j, T_j]; ``adv`` [b_j]; ``keep`` the rollout keep,
    or None). A minibatch-stage method (Clip-Cov, KL-Cov) needs ``cur``: the rule runs once on the
    concatenation of all ranks' micro-batches, as the method's ``exchange`` declares
    (``dist_select.dist_minibatch_masks``): Clip-Cov and KL-Cov exchange only sums, counts and top-k
    candidates, a per-token rule runs on this rank's rows, a method that exchanges its ``tokens`` all-gathers
    the micro-batches (``integrations.dist``); any other method selects nothing
    per minibatch, so the rule runs on each local micro-batch as it is. Returns one selection per local
    micro-batch. ``settings``: the loss's (their ratio clip, ``ratio_clip``).
    """
    eps = ratio_clip(settings)
    if method.stage != "minibatch":
        return [select_minibatch(None, o, a, m, k, method, *eps, generator) for o, a, m, k in zip(old, adv, mask, keep)]
    assert cur is not None  # the callers (trl._build_window) pass cur for a minibatch-stage method
    l_cur = _cat_rows([c.detach().float() for c in cur], 0.0)
    l_old = _cat_rows([o.float() for o in old], 0.0)
    l_mask = _cat_rows(mask, False)
    l_adv = torch.cat([a.float() for a in adv])
    l_keep = None
    if any(k is not None for k in keep):
        l_keep = _cat_rows([m if k is None else k for m, k in zip(mask, keep)], False)
    selected = None
    if rank_and_world()[1] > 1:  # Clip-Cov and KL-Cov: sums, counts and top-k candidates only (Method.exchange)
        clipped = ppo_clipped_mask(l_cur, l_old, l_adv, l_mask, *eps)
        selected = dist_minibatch_masks(method, l_cur, l_adv, l_mask, clipped, generator, l_old)
    if selected is not None:
        sel, rows = combine_selection(selected, l_mask, l_keep), slice(0, l_mask.shape[0])
    else:
        g_cur, rows = all_gather_rows(l_cur, 0.0)
        g_old, _ = all_gather_rows(l_old, 0.0)
        g_mask, _ = all_gather_rows(l_mask, False)
        g_adv, _ = all_gather_rows(l_adv, 0.0)
        g_keep = None if l_keep is None else all_gather_rows(l_keep, False)[0]
        sel = select_minibatch(g_cur, g_old, g_adv, g_mask, g_keep, method, *eps, generator)
    width = l_mask.shape[1]

    def split(x: Tensor | None) -> list[Tensor | None]:
        return _split_rows(_local_rows(x, rows, width), mask)

    def split_masks(m: Masks) -> list[Masks]:
        cols = [split(getattr(m, name)) for name in MASK_FIELDS]
        return [Masks(**dict(zip(MASK_FIELDS, vals))) for vals in zip(*cols)]

    return [MinibatchSelection(*x) for x in zip(split_masks(sel.masks), split(sel.counted), split_masks(sel.method))]


def global_minibatch_masks(method: Method, cur: list[Tensor], old: list[Tensor], adv: list[Tensor],
                           mask: list[Tensor], settings: LossSettings | Mapping[str, Any],
                           generator: torch.Generator | None) -> list[Masks]:
    """The method's minibatch-stage masks (Clip-Cov, KL-Cov) over one optimizer step's micro-batches of all
    ranks (``global_minibatch_selection`` without a rollout keep). Returns one ``Masks`` per local
    micro-batch."""
    return [s.method for s in global_minibatch_selection(method, cur, old, adv, mask, [None] * len(mask),
                                                         settings, generator)]


def global_loss_scales(counted: list[Tensor], agg: str, width: int | None = None) -> list[float]:
    """Factors c_j such that sum over ranks and micro-batches of c_j·policy_loss_j, averaged over ranks (as
    DDP averages gradients), equals ``aggregate(ℓ, m_global, agg)`` over all counted tokens of the window.

    ``counted[j]`` is micro-batch j's counting mask (mask & keep), at the width it has in ``policy_loss``.
    ``width`` is the common padded length T for ``seq-mean-token-sum-norm`` (Dr.GRPO's constant; default:
    the widest micro-batch, over all ranks). The minibatch-level weights are ``loss.agg_weights`` of the
    window's counted masks of all ranks; each factor is ``control.microbatch_loss_scale`` times the world size
    (DDP's average). With several ranks only three numbers per rank travel (counted tokens, sequences that
    count, width), and this rank's rows of the weights are ``agg_weights``'s formulas with those global
    counts: the same bits as on the gathered masks (the counts are exact in float64).
    """
    _, world = rank_and_world()
    w = max([width or 0] + [c.shape[1] for c in counted])
    local = _cat_rows([_pad_cols(c, w, False) for c in counted], False)
    if world == 1:
        mine = agg_weights(local, agg, torch.float64)
    else:
        check_agg(agg, local)
        mf = local.to(torch.float64)
        per_seq = mf.sum(-1, keepdim=True)
        parts = gather_small(torch.stack([mf.sum(), (per_seq > 0).sum().to(torch.float64),
                                          torch.tensor(float(w), dtype=torch.float64, device=mf.device)]))
        totals = parts[0][:2].clone()
        for p in parts[1:]:  # in rank order, as dist_select.global_sum
            totals += p[:2]
        n_tok, n_seq = totals.unbind()
        width_all = int(max(float(p[2]) for p in parts))
        mf = _pad_cols(mf, width_all, 0.0)  # the gathered masks' width, so Σ weights adds in the same order
        mine = aggregation_weights(mf, agg, tokens=n_tok.clamp(min=1.0), sequences=n_seq.clamp(min=1.0),
                                   width=width_all)
    scales, r = [], 0
    for c in counted:
        scales.append(microbatch_loss_scale(mine[r : r + c.shape[0]], c, agg) * world)
        r += c.shape[0]
    return scales


def window_token_counts(mask: list[Tensor], selections: list[MinibatchSelection]) -> Tensor:
    """[valid, kept, zeroed] tokens of a window's micro-batches, summed over ranks (float64, on the CPU):
    the response tokens, those that count and are not zeroed, and the counted ones zeroed (Clip-Cov)."""
    valid = live = zeroed = 0.0
    for m, s in zip(mask, selections):
        z = s.masks.zeroed
        valid += float(m.sum())
        live += float(s.counted.sum() if z is None else (s.counted & ~z).sum())
        zeroed += 0.0 if z is None else float((z & s.counted).sum())
    return all_reduce_sum(torch.tensor([valid, live, zeroed], dtype=torch.float64, device=mask[0].device)).cpu()


class Window(NamedTuple):
    """One optimizer window's selection: per local micro-batch, what ``select_minibatch`` chose (masks with the
    rollout keep, counted, the method's own) and the factor of its loss."""

    start: int  # the window's first micro-batch, in the engine's micro-batch count
    selections: list[MinibatchSelection]
    scales: list[float]

    @property
    def masks(self) -> list[Masks]:
        """The method's own minibatch masks per micro-batch (for inspection)."""
        return [s.method for s in self.selections]


def select_window(start: int, method: Method, cur: list[Tensor] | None, old: list[Tensor], adv: list[Tensor],
                  mask: list[Tensor], keep: list[Tensor | None], settings: LossSettings,
                  generator: torch.Generator | None, width: int | None = None) -> Window:
    """``global_minibatch_selection`` and ``global_loss_scales`` (at ``width``, with the settings' aggregation) of
    one optimizer window."""
    sel = global_minibatch_selection(method, cur, old, adv, mask, keep, settings, generator)
    return Window(start, sel, global_loss_scales([s.counted for s in sel], settings.agg, width))


def kept_fractions(counts: Tensor) -> dict[str, float | None]:
    """``control/kept_frac`` and ``control/zeroed_frac`` of ``window_token_counts`` (None without tokens)."""
    valid, live, zeroed = counts.tolist()
    return {"control/kept_frac": live / valid if valid else None,
            "control/zeroed_frac": zeroed / valid if valid else None}


class StepMetrics:
    """One step's metrics row, gathered over its micro-batches and windows."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = defaultdict(list)
        self.counts = torch.zeros(3, dtype=torch.float64)  # valid, kept (counted and not zeroed), zeroed

    def add(self, metrics: Mapping[str, float | None]) -> None:
        """Record one value per metric; None (undefined) and NaN are left out of the mean."""
        for k, v in metrics.items():
            vals = self.values[k]
            if v is not None and not math.isnan(x := float(v)):
                vals.append(x)

    def count(self, mask: list[Tensor], window: Window) -> Tensor:
        """Add a window's global token counts (``window_token_counts``) to the step's, and return them."""
        counts = window_token_counts(mask, window.selections)
        self.counts += counts
        return counts

    def pop(self) -> dict[str, float | None]:
        """The row since the last call: each metric's mean (None when never defined) and the step's kept and
        zeroed fractions; then start a new row."""
        row = {k: mean_defined(v) for k, v in self.values.items()}
        row.update(kept_fractions(self.counts))
        self.values.clear()
        self.counts.zero_()
        return row
