"""One read of materialised logits -> log p_k, H, S_k, E_p[S] and log-sum-exp per row (Triton).

The statistics come from four running sums per row of e = exp(y - m), y = z / T, m the running max
(``dynamics._stats_from_moments`` states the algebra):

    S0 = sum e,   S1 = sum e (y - m),   S2 = sum e^2,   S3 = sum e^2 (y - m)
    H = log S0 - S1/S0,   log p_k = y_k - m - log S0,   S_k = p_k (y_k - m - S1/S0)      (Lemma 3.1)
    E_p[S] = (S3 - (S1/S0) S2) / S0^2                                                      (Thm 3.3)

When the running max moves from m to m' (d = m - m', a = e^d) the sums are rescaled online:
S0 <- a S0, S1 <- a (S1 + d S0), S2 <- a^2 S2, S3 <- a^2 (S3 + d S2), the same rule ``fused`` uses.

A program sweeps one row (or one slice of a row's vocabulary, when there are too few rows to fill the
device) in blocks of ``BLOCK`` columns. Slices are merged by a second kernel in slice order, so results are
bitwise reproducible for a given (shape, block, splits). Bad input never stops a kernel: rows with no finite
logit (or a NaN / +inf), ids outside [0, V) and temperatures that are not finite and > 0 are counted in a
4-entry int32 ``flags`` tensor that the caller reads once (the call's one host synchronisation).
Scratch: ``flags`` and, when a row is split, ``splits x 6`` float32 per row; nothing of the logits' size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["RowStats", "block_partials", "default_block", "default_splits", "merge_partials", "row_stats"]

FLAG_ROWS, FLAG_IDS, FLAG_TEMPERATURE = 0, 1, 2
_MAX_BLOCK = 4096
_MAX_SPLITS = 64


class RowStats(NamedTuple):
    """What ``row_stats`` returns: float32 ``[rows]`` tensors and the int32 ``flags`` (bad rows, bad ids,
    bad temperatures, unused), still on the device: the caller decides when to synchronise."""

    logp: Tensor
    entropy: Tensor
    s_star: Tensor
    s_expected: Tensor
    lse: Tensor
    flags: Tensor


@triton.jit
def _block_update(y, m, s0, s1, s2, s3):
    """Fold one block of scaled logits ``y`` (masked lanes -inf) into the running (m, S0..S3)."""
    m_new = tl.maximum(m, tl.max(y, 0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that is -inf so far stays at zero mass
    a = tl.exp(m - shift)
    ad = tl.where(a > 0, a * (m - shift), 0.0)
    e = tl.exp(y - shift)
    d = tl.where(e > 0, y - shift, 0.0)  # -inf entries carry no mass: 0, not 0 * -inf
    ed = e * d
    s1 = a * s1 + ad * s0 + tl.sum(ed, 0)
    s3 = a * a * s3 + a * ad * s2 + tl.sum(ed * e, 0)
    s0 = a * s0 + tl.sum(e, 0)
    s2 = a * a * s2 + tl.sum(e * e, 0)
    return m_new, s0, s1, s2, s3


@triton.jit
def _merge(m, s0, s1, s2, s3, mj, s0j, s1j, s2j, s3j):
    """(m, S0..S3) of the union of two disjoint column sets, each given relative to its own max."""
    m_new = tl.maximum(m, mj)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m - shift)
    b = tl.exp(mj - shift)
    ad = tl.where(a > 0, a * (m - shift), 0.0)
    bd = tl.where(b > 0, b * (mj - shift), 0.0)
    s1 = a * s1 + ad * s0 + b * s1j + bd * s0j
    s3 = a * a * s3 + a * ad * s2 + b * b * s3j + b * bd * s2j
    s0 = a * s0 + b * s0j
    s2 = a * a * s2 + b * b * s2j
    return m_new, s0, s1, s2, s3


@triton.jit
def _finish(out_ptr, out_stride, row, m, s0, s1, s2, s3, zk, flags_ptr):
    """Write (log p_k, H, S_k, E_p[S], lse) of one row from its moments; count a row with no finite mass."""
    bad = (m != m) | (m == float("inf")) | (m == float("-inf")) | (s0 != s0) | (s1 != s1) | (s0 == float("inf"))
    tl.atomic_add(flags_ptr + 0, bad.to(tl.int32))
    log_s0 = tl.log(s0)
    ybar = s1 / s0
    entropy = tl.maximum(log_s0 - ybar, 0.0)
    yk = zk - m
    logp = yk - log_s0
    pk = tl.exp(logp)
    s_star = tl.where(pk > 0, pk * (yk - ybar), 0.0)
    s_exp = (s3 - ybar * s2) / (s0 * s0)
    tl.store(out_ptr + row, logp)
    tl.store(out_ptr + out_stride + row, entropy)
    tl.store(out_ptr + 2 * out_stride + row, s_star)
    tl.store(out_ptr + 3 * out_stride + row, s_exp)
    tl.store(out_ptr + 4 * out_stride + row, m + log_s0)


@triton.jit
def _row_offset(row, inner, stride_outer, stride_inner):
    r = row.to(tl.int64)
    return (r // inner) * stride_outer + (r % inner) * stride_inner


@triton.jit
def _load_temperature(t_ptr, t_scalar, row, flags_ptr, PER_ROW: tl.constexpr):
    if PER_ROW:
        t = tl.load(t_ptr + row).to(tl.float32)
        ok = (t > 0) & (t < float("inf"))
        tl.atomic_add(flags_ptr + 2, (ok == 0).to(tl.int32))
        t = tl.where(ok, t, 1.0)
    else:
        t = t_scalar
    return t


@triton.jit
def _load_id(ids_ptr, row, V: tl.constexpr, flags_ptr):
    k = tl.load(ids_ptr + row).to(tl.int64)
    bad = (k < 0) | (k >= V)
    tl.atomic_add(flags_ptr + 1, bad.to(tl.int32))
    return tl.where(bad, 0, k)


@triton.jit
def _sweep(x_ptr, off, t, k, start, V: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    """Moments of columns [start, start + SPAN) of one row, and the scaled logit of id k if it lies there."""
    m = float("-inf")
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    zk = 0.0
    lanes = tl.arange(0, BLOCK)
    for c in range(0, SPAN, BLOCK):
        cols = start + c + lanes
        inside = (cols < V) & (c + lanes < SPAN)
        y = tl.load(x_ptr + off + cols, mask=inside, other=float("-inf")).to(tl.float32) / t
        hit = (cols == k) & inside
        zk += tl.sum(tl.where(hit, y, 0.0), 0)
        m, s0, s1, s2, s3 = _block_update(y, m, s0, s1, s2, s3)
    return m, s0, s1, s2, s3, zk


@triton.jit
def _stats_rows_kernel(x_ptr, ids_ptr, t_ptr, t_scalar, out_ptr, flags_ptr, out_stride, inner, stride_outer,
                       stride_inner, V: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr,
                       PER_ROW: tl.constexpr):
    """One program per row, whole vocabulary (SPAN: V rounded up to a whole number of blocks)."""
    row = tl.program_id(0)
    off = _row_offset(row, inner, stride_outer, stride_inner)
    t = _load_temperature(t_ptr, t_scalar, row, flags_ptr, PER_ROW)
    k = _load_id(ids_ptr, row, V, flags_ptr)
    m, s0, s1, s2, s3, zk = _sweep(x_ptr, off, t, k, 0, V, SPAN, BLOCK)
    _finish(out_ptr, out_stride, row, m, s0, s1, s2, s3, zk, flags_ptr)


@triton.jit
def _slice_temperature(t_ptr, t_scalar, row, PER_ROW: tl.constexpr):
    """A slice's temperature: a bad per-row value reads as 1 here (counted once, by the merge kernel)."""
    if PER_ROW:
        t = tl.load(t_ptr + row).to(tl.float32)
        t = tl.where((t > 0) & (t < float("inf")), t, 1.0)
    else:
        t = t_scalar
    return t


@triton.jit
def _store_partial(part_ptr, row, j, SPLITS: tl.constexpr, m, s0, s1, s2, s3, zk):
    """Slice j's six partials (m, S0..S3, z_k) of a row, at part[row, j, :]."""
    base = part_ptr + (row.to(tl.int64) * SPLITS + j) * 6
    tl.store(base + 0, m)
    tl.store(base + 1, s0)
    tl.store(base + 2, s1)
    tl.store(base + 3, s2)
    tl.store(base + 4, s3)
    tl.store(base + 5, zk)


@triton.jit
def _stats_split_kernel(x_ptr, ids_ptr, t_ptr, t_scalar, part_ptr, flags_ptr, inner, stride_outer,
                        stride_inner, V: tl.constexpr, SPAN: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    """Program (row, j) sweeps columns [j SPAN, (j+1) SPAN) and writes its 6 partials (m, S0..S3, z_k)."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    off = _row_offset(row, inner, stride_outer, stride_inner)
    t = _slice_temperature(t_ptr, t_scalar, row, PER_ROW)
    k = tl.load(ids_ptr + row).to(tl.int64)
    m, s0, s1, s2, s3, zk = _sweep(x_ptr, off, t, k, j * SPAN, V, SPAN, BLOCK)
    _store_partial(part_ptr, row, j, SPLITS, m, s0, s1, s2, s3, zk)


@triton.jit
def _stats_block_kernel(x_ptr, stride_x, ids_ptr, col0, t_ptr, t_scalar, part_ptr, j, NCOLS: tl.constexpr,
                        SPAN: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    """Partials of vocabulary block j for every row of a [rows, NCOLS] buffer holding columns
    [col0, col0 + NCOLS) of the logits (the fused head's GEMM output), written as slice j of ``part``."""
    row = tl.program_id(0)
    t = _slice_temperature(t_ptr, t_scalar, row, PER_ROW)
    k = tl.load(ids_ptr + row).to(tl.int64) - col0
    m, s0, s1, s2, s3, zk = _sweep(x_ptr, row.to(tl.int64) * stride_x, t, k, 0, NCOLS, SPAN, BLOCK)
    _store_partial(part_ptr, row, j, SPLITS, m, s0, s1, s2, s3, zk)


@triton.jit
def _merge_kernel(part_ptr, ids_ptr, t_ptr, out_ptr, flags_ptr, out_stride, V: tl.constexpr, SPAN: tl.constexpr,
                  SPLITS: tl.constexpr, PER_ROW: tl.constexpr):
    """Merge a row's slices in slice order (bitwise reproducible) and write its statistics."""
    row = tl.program_id(0)
    _load_temperature(t_ptr, 1.0, row, flags_ptr, PER_ROW)  # counts a bad per-row temperature once
    k = _load_id(ids_ptr, row, V, flags_ptr)
    base = part_ptr + row.to(tl.int64) * SPLITS * 6
    m = float("-inf")
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    for j in range(0, SPLITS):
        p = base + j * 6
        m, s0, s1, s2, s3 = _merge(m, s0, s1, s2, s3, tl.load(p), tl.load(p + 1), tl.load(p + 2),
                                   tl.load(p + 3), tl.load(p + 4))
    zk = tl.load(base + (k // SPAN) * 6 + 5)
    _finish(out_ptr, out_stride, row, m, s0, s1, s2, s3, zk, flags_ptr)


def default_block(vocab: int) -> int:
    """Columns per block: the vocabulary's next power of two, at most 4096."""
    return min(_MAX_BLOCK, triton.next_power_of_2(max(vocab, 16)))


def default_splits(rows: int, vocab: int, block: int, device: torch.device) -> int:
    """Vocabulary slices per row: 1 when the rows alone give every SM four programs, else enough slices to
    do so (at most 64, each at least one block)."""
    # under the interpreter: 2 "SMs", few programs, but the split path stays exercised on short batches
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    want = 4 * sms
    if rows >= want:
        return 1
    return max(1, min(_MAX_SPLITS, triton.cdiv(want, max(rows, 1)), triton.cdiv(vocab, block)))


def _rows_view(logits: Tensor) -> tuple[Tensor, int, int, int]:
    """(tensor, inner, stride_outer, stride_inner) addressing row r at (r // inner) * so + (r % inner) * si,
    without a copy for 2-D and 3-D views with a unit last stride (a contiguous copy otherwise)."""
    x = logits
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    try:
        v = x.view(-1, x.shape[-1])
        return v, 1, v.stride(0), 0
    except RuntimeError:
        pass
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    v = x.contiguous().view(-1, x.shape[-1])
    return v, 1, v.stride(0), 0


def row_stats(logits: Tensor, token_ids: Tensor, temperature: float | Tensor = 1.0, *,
              block: int | None = None, splits: int | None = None, out: Tensor | None = None,
              flags: Tensor | None = None) -> RowStats:
    """The five per-row statistics of ``softmax(logits / temperature)`` in float32, in one read of the logits.

    logits: [..., V] float32, bfloat16 or float16; token_ids: [...] integer; temperature: a float (checked by
    the caller) or a float tensor of shape [...] (one per row, checked here, on the device).
    block / splits: columns per block and vocabulary slices per row (defaults: ``default_block``,
    ``default_splits``); results are reproducible bit for bit for fixed values of both.
    out / flags: optional destinations, a float32 [5, rows] view with a unit last stride (rows of a larger
    buffer, as the fused head's token chunks write them) and an int32 [4] counter that is added to.
    Nothing is synchronised: the caller reads ``flags`` (bad rows, bad ids, bad temperatures).
    """
    vocab = logits.shape[-1]
    x, inner, s_outer, s_inner = _rows_view(logits)
    ids = token_ids.reshape(-1)
    rows = ids.numel()
    dev = logits.device
    if out is None:
        out = torch.empty(5, rows, dtype=torch.float32, device=dev)
    if flags is None:
        flags = torch.zeros(4, dtype=torch.int32, device=dev)
    if rows == 0:
        return RowStats(*out, flags)
    per_row = isinstance(temperature, Tensor)
    t_tensor = temperature.reshape(-1) if per_row else flags  # an unread placeholder when scalar
    t_scalar = 1.0 if per_row else float(temperature)
    blk = int(block) if block is not None else default_block(vocab)
    n_split = int(splits) if splits is not None else default_splits(rows, vocab, blk, dev)
    warps = 8 if blk >= 2048 else 4
    if n_split <= 1:
        _stats_rows_kernel[(rows,)](x, ids, t_tensor, t_scalar, out, flags, out.stride(0), inner, s_outer,
                                    s_inner, V=vocab, SPAN=triton.cdiv(vocab, blk) * blk, BLOCK=blk,
                                    PER_ROW=per_row, num_warps=warps)
        return RowStats(*out, flags)
    span = triton.cdiv(triton.cdiv(vocab, n_split), blk) * blk
    n_split = triton.cdiv(vocab, span)
    part = torch.empty(rows, n_split, 6, dtype=torch.float32, device=dev)
    _stats_split_kernel[(rows, n_split)](x, ids, t_tensor, t_scalar, part, flags, inner, s_outer, s_inner,
                                         V=vocab, SPAN=span, SPLITS=n_split, BLOCK=blk, PER_ROW=per_row,
                                         num_warps=warps)
    _merge_kernel[(rows,)](part, ids, t_tensor, out, flags, out.stride(0), V=vocab, SPAN=span,
                           SPLITS=n_split, PER_ROW=per_row, num_warps=1)
    return RowStats(*out, flags)


def block_partials(z: Tensor, ids: Tensor, col0: int, temperature: float | Tensor, part: Tensor, j: int, *,
                   block: int | None = None) -> None:
    """Write slice ``j`` of ``part`` ([rows, splits, 6] float32): the moments of the logits block ``z``
    ([rows, c], unit last stride), which holds columns [col0, col0 + c) of each row; ids are global."""
    rows, ncols = z.shape
    if rows == 0:
        return
    blk = int(block) if block is not None else default_block(ncols)
    per_row = isinstance(temperature, Tensor)
    t_tensor = temperature.reshape(-1) if per_row else part
    _stats_block_kernel[(rows,)](z, z.stride(0), ids, col0, t_tensor, 1.0 if per_row else float(temperature), part,
                                 j, NCOLS=ncols, SPAN=triton.cdiv(ncols, blk) * blk, SPLITS=part.shape[1],
                                 BLOCK=blk, PER_ROW=per_row, num_warps=8 if blk >= 2048 else 4)


def merge_partials(part: Tensor, ids: Tensor, vocab: int, span: int, temperature: float | Tensor, out: Tensor,
                   flags: Tensor) -> None:
    """Merge ``part``'s slices (slice j holds columns [j span, (j + 1) span)) in order into ``out`` [5, rows]
    (log p_k, H, S_k, E_p[S], lse); bad ids, rows and per-row temperatures are counted in ``flags``."""
    rows = part.shape[0]
    if rows == 0:
        return
    per_row = isinstance(temperature, Tensor)
    t_tensor = temperature.reshape(-1) if per_row else flags
    _merge_kernel[(rows,)](part, ids, t_tensor, out, flags, out.stride(0), V=vocab, SPAN=span, SPLITS=part.shape[1],
                           PER_ROW=per_row, num_warps=1)
