"""Global (all-process) views of per-rank tensors, for selections over the whole batch.

ClipB's mean and std, ClipV's std and cap, the 80/20 quantile and Clip-Cov's candidate set and random pick
must be taken over the *global* batch, never per rank (DESIGN.md, "When each method selects its tokens").
The simplest exact way is to all-gather the per-token statistics (a few floats per token, small next to the
logits), run the unchanged ``control`` functions on the concatenation on every rank (same inputs, same
seeded generator, hence the same result everywhere), and keep this rank's rows. ``integrations.dist_select``
gets the same selections for ClipB, ClipV, Clip-Cov and KL-Cov from sums, counts and top-k candidates
instead; what still gathers here is the 80/20 quantile and any method without such a path.

Rows are concatenated in rank order, so the global batch equals the one a single process would hold if it
had all ranks' rows in that order (TRL hands process i the i-th slice of the generation batch). Ranks may
hold different row counts and different padded lengths; padding added here is masked out by the caller's
``mask`` (padded with False), so it never enters a statistic.

Works with any initialised ``torch.distributed`` process group (gloo on CPU, NCCL on GPU, as set up by
``accelerate launch``); without one, every function is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import Tensor

__all__ = ["all_gather_rows", "all_reduce_sum", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when no process group is initialised."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank(), torch_dist.get_world_size()
    return 0, 1


def _pad_to(x: Tensor, rows: int, width: int | None, value: float | bool) -> Tensor:
    """Pad ``x`` with ``value`` to ``rows`` rows and (for x.dim() >= 2) ``width`` columns."""
    shape = list(x.shape)
    shape[0] = rows
    if width is not None:
        shape[1] = width
    out = torch.full(shape, value, dtype=x.dtype, device=x.device)
    idx = (slice(0, x.shape[0]),) + ((slice(0, x.shape[1]),) if width is not None else ())
    out[idx] = x
    return out


def all_gather_rows(x: Tensor, pad_value: float | bool = 0) -> tuple[Tensor, slice]:
    """Concatenate every rank's ``x`` ([B_r] or [B_r, T_r, ...]) along dim 0, in rank order.

    Dim 1 is padded with ``pad_value`` to the largest T_r (other dims must agree). Returns the global
    tensor and the slice of dim 0 holding this rank's rows; ``global[sl, :T_r]`` is ``x`` again.
    Bool tensors travel as uint8 (gloo has no bool all-gather).
    """
    rank, world = rank_and_world()
    if world == 1:
        return x, slice(0, x.shape[0])
    has_width = x.dim() >= 2
    shape = torch.tensor([x.shape[0], x.shape[1] if has_width else 0], dtype=torch.long, device=x.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    torch_dist.all_gather(shapes, shape)
    rows = [int(s[0]) for s in shapes]
    width = max(int(s[1]) for s in shapes) if has_width else None
    send = x.to(torch.uint8) if x.dtype == torch.bool else x
    pad = int(pad_value) if x.dtype == torch.bool else pad_value
    send = _pad_to(send.contiguous(), max(rows), width, pad)
    parts = [torch.empty_like(send) for _ in range(world)]
    torch_dist.all_gather(parts, send)
    out = torch.cat([p[:r] for p, r in zip(parts, rows)], dim=0)
    if x.dtype == torch.bool:
        out = out.bool()
    start = sum(rows[:rank])
    return out, slice(start, start + rows[rank])


def all_reduce_sum(x: Tensor) -> Tensor:
    """Sum of ``x`` over ranks (a new tensor; ``x`` itself is left alone)."""
    _, world = rank_and_world()
    out = x.clone()
    if world > 1:
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM)
    return out
