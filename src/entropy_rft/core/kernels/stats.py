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

__all__ = ["RowStats", "block_partials", "default_block", "default_splits", "default_warps", "merge_partials",
           "row_stats"]

FLAG_ROWS, FLAG_IDS, FLAG_TEMPERATURE = 0, 1, 2
_MAX_BLOCK = 2048
_MAX_SPLITS = 64
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # the sums are kept in base 2: one exp2 a column
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


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
def _rescale(m, m_new, s0, s1, s2, s3):
    """The running sums, taken relative to the old max ``m``, made relative to the new ``m_new`` (base-2 units:
    a = 2^(m - m_new)); a max that was -inf carried no mass and scales to zero."""
    a = tl.exp2(m - m_new)
    ad = tl.where(a > 0, a * (m - m_new), 0.0)
    s1 = a * s1 + ad * s0
    s3 = a * a * s3 + a * ad * s2
    s0 = a * s0
    s2 = a * a * s2
    return s0, s1, s2, s3


@triton.jit
def _merge(m, s0, s1, s2, s3, mj, s0j, s1j, s2j, s3j):
    """(m, S0..S3) of the union of two disjoint column sets, each given relative to its own max (base 2)."""
    m_new = tl.maximum(m, mj)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    s0, s1, s2, s3 = _rescale(m, shift, s0, s1, s2, s3)
    s0j, s1j, s2j, s3j = _rescale(mj, shift, s0j, s1j, s2j, s3j)
    return m_new, s0 + s0j, s1 + s1j, s2 + s2j, s3 + s3j


@triton.jit
def _finish(out_ptr, out_stride, row, m, s0, s1, s2, s3, dk, flags_ptr):
    """Write (log p_k, H, S_k, E_p[S], lse) of one row from its base-2 moments (``dk``: id k's scaled logit
    minus ``m``); count a row with no finite mass."""
    bad = (m != m) | (m == float("inf")) | (m == float("-inf")) | (s0 != s0) | (s1 != s1) | (s0 == float("inf"))
    tl.atomic_add(flags_ptr + 0, bad.to(tl.int32))
    log_s0 = tl.log(s0)
    ybar = s1 * LN2 / s0
    entropy = tl.maximum(log_s0 - ybar, 0.0)
    yk = dk * LN2
    logp = yk - log_s0
    pk = tl.exp(logp)
    s_star = tl.where(pk > 0, pk * (yk - ybar), 0.0)
    s_exp = (s3 * LN2 - ybar * s2) / (s0 * s0)
    tl.store(out_ptr + row, logp)
    tl.store(out_ptr + out_stride + row, entropy)
    tl.store(out_ptr + 2 * out_stride + row, s_star)
    tl.store(out_ptr + 3 * out_stride + row, s_exp)
    tl.store(out_ptr + 4 * out_stride + row, m * LN2 + log_s0)


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
def _sweep(x_ptr, off, t, k, start, stop, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    """Base-2 moments of columns [start, stop) of one row (stop - start <= SPAN), and id k's scaled logit
    relative to their max (0 when k lies outside).

    The max is a scalar, taken per block; the four sums are BLOCK-wide vectors, rescaled only when a block
    raises the max, and reduced once at the end: per column one exp2 and five multiply-adds."""
    c = LOG2E / t
    lanes = tl.arange(0, BLOCK)
    m = float("-inf")  # max of c * x so far
    shift = 0.0  # the sums' reference: m, or 0 while m is -inf (no mass yet)
    s0 = tl.zeros([BLOCK], dtype=tl.float32)
    s1 = tl.zeros([BLOCK], dtype=tl.float32)
    s2 = tl.zeros([BLOCK], dtype=tl.float32)
    s3 = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, SPAN, BLOCK):
        cols = start + j + lanes
        x = tl.load(x_ptr + off + cols, mask=cols < stop, other=float("-inf")).to(tl.float32)
        m_blk = tl.max(x, 0) * c
        if m_blk > m:
            s0, s1, s2, s3 = _rescale(m, m_blk, s0, s1, s2, s3)
            m = m_blk
            shift = m_blk
        d = x * c - shift
        e = tl.exp2(d)
        ed = e * tl.maximum(d, -3.0e38)  # a -inf column: 0, not 0 * -inf (a NaN still reaches s0 through e)
        s0 += e
        s1 += ed
        s2 += e * e
        s3 += ed * e
    own = (k >= start) & (k < stop)
    xk = tl.load(x_ptr + off + tl.where(own, k, start)).to(tl.float32)
    dk = tl.where(own, xk * c - shift, 0.0)
    return m, tl.sum(s0, 0), tl.sum(s1, 0), tl.sum(s2, 0), tl.sum(s3, 0), dk


@triton.jit
def _stats_rows_kernel(x_ptr, ids_ptr, t_ptr, t_scalar, out_ptr, flags_ptr, out_stride, inner, stride_outer,
                       stride_inner, V: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr,
                       PER_ROW: tl.constexpr):
    """One program per row, whole vocabulary (SPAN: V rounded up to a whole number of blocks)."""
    row = tl.program_id(0)
    off = _row_offset(row, inner, stride_outer, stride_inner)
    t = _load_temperature(t_ptr, t_scalar, row, flags_ptr, PER_ROW)
    k = _load_id(ids_ptr, row, V, flags_ptr)
    m, s0, s1, s2, s3, dk = _sweep(x_ptr, off, t, k, 0, V, SPAN, BLOCK)
    _finish(out_ptr, out_stride, row, m, s0, s1, s2, s3, dk, flags_ptr)


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
def _store_partial(part_ptr, row, j, SPLITS: tl.constexpr, m, s0, s1, s2, s3, dk):
    """Slice j's six partials (m, S0..S3 in base 2, id k's logit minus m) of a row, at part[row, j, :]."""
    base = part_ptr + (row.to(tl.int64) * SPLITS + j) * 6
    tl.store(base + 0, m)
    tl.store(base + 1, s0)
    tl.store(base + 2, s1)
    tl.store(base + 3, s2)
    tl.store(base + 4, s3)
    tl.store(base + 5, dk)


@triton.jit
def _stats_split_kernel(x_ptr, ids_ptr, t_ptr, t_scalar, part_ptr, flags_ptr, inner, stride_outer,
                        stride_inner, V: tl.constexpr, SPAN: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    """Program (row, j) sweeps columns [j SPAN, (j+1) SPAN) and writes its 6 partials."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    off = _row_offset(row, inner, stride_outer, stride_inner)
    t = _slice_temperature(t_ptr, t_scalar, row, PER_ROW)
    k = tl.load(ids_ptr + row).to(tl.int64)
    start = j * SPAN
    m, s0, s1, s2, s3, dk = _sweep(x_ptr, off, t, k, start, tl.minimum(start + SPAN, V), SPAN, BLOCK)
    _store_partial(part_ptr, row, j, SPLITS, m, s0, s1, s2, s3, dk)


@triton.jit
def _stats_block_kernel(x_ptr, stride_x, ids_ptr, col0, t_ptr, t_scalar, part_ptr, j, NCOLS: tl.constexpr,
                        SPAN: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PER_ROW: tl.constexpr):
    """Partials of vocabulary block j for every row of a [rows, NCOLS] buffer holding columns
    [col0, col0 + NCOLS) of the logits (the fused head's GEMM output), written as slice j of ``part``."""
    row = tl.program_id(0)
    t = _slice_temperature(t_ptr, t_scalar, row, PER_ROW)
    k = tl.load(ids_ptr + row).to(tl.int64) - col0
    m, s0, s1, s2, s3, dk = _sweep(x_ptr, row.to(tl.int64) * stride_x, t, k, 0, NCOLS, SPAN, BLOCK)
    _store_partial(part_ptr, row, j, SPLITS, m, s0, s1, s2, s3, dk)


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
    own = base + (k // SPAN) * 6
    dk = tl.load(own + 5) + (tl.load(own) - m)  # id k's logit, from its slice's max to the row's
    _finish(out_ptr, out_stride, row, m, s0, s1, s2, s3, dk, flags_ptr)


def default_block(vocab: int) -> int:
    """Columns per block: the vocabulary's next power of two, at most 2048."""
    return min(_MAX_BLOCK, triton.next_power_of_2(max(vocab, 16)))


def default_warps(block: int, itemsize: int) -> int:
    """Warps per program: 8 from 8 KiB of logits a block, else 4. Measured on the H200 (2026-11-27, second
    lease): bf16 [16384, 151936] at block 2048 took 2.23 ms with 4 warps, 2.57 ms with 8 (TRL's kernel 2.45 ms);
    float32 [1024, 151936] at block 2048 took 0.54 ms with 8 warps, 0.71 ms with 4."""
    return 8 if block * itemsize >= 8192 else 4


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
              block: int | None = None, splits: int | None = None, warps: int | None = None,
              out: Tensor | None = None, flags: Tensor | None = None) -> RowStats:
    """The five per-row statistics of ``softmax(logits / temperature)`` in float32, in one read of the logits.

    logits: [..., V] float32, bfloat16 or float16; token_ids: [...] integer; temperature: a float (checked by
    the caller) or a float tensor of shape [...] (one per row, checked here, on the device).
    block / splits / warps: columns per block, vocabulary slices per row and warps per program (defaults:
    ``default_block``, ``default_splits``, ``default_warps``); results are reproducible bit for bit for fixed
    values of all three.
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
        return RowStats(out[0], out[1], out[2], out[3], out[4], flags)
    per_row = isinstance(temperature, Tensor)
    t_tensor = temperature.reshape(-1) if isinstance(temperature, Tensor) else flags  # flags: unread placeholder
    t_scalar = 1.0 if per_row else float(temperature)
    blk = int(block) if block is not None else default_block(vocab)
    n_split = int(splits) if splits is not None else default_splits(rows, vocab, blk, dev)
    warps = int(warps) if warps is not None else default_warps(blk, x.element_size())
    if n_split <= 1:
        _stats_rows_kernel[(rows,)](x, ids, t_tensor, t_scalar, out, flags, out.stride(0), inner, s_outer,
                                    s_inner, V=vocab, SPAN=triton.cdiv(vocab, blk) * blk, BLOCK=blk,
                                    PER_ROW=per_row, num_warps=warps)
        return RowStats(out[0], out[1], out[2], out[3], out[4], flags)
    span = triton.cdiv(triton.cdiv(vocab, n_split), blk) * blk
    n_split = triton.cdiv(vocab, span)
    part = torch.empty(rows, n_split, 6, dtype=torch.float32, device=dev)
    _stats_split_kernel[(rows, n_split)](x, ids, t_tensor, t_scalar, part, flags, inner, s_outer, s_inner,
                                         V=vocab, SPAN=span, SPLITS=n_split, BLOCK=blk, PER_ROW=per_row,
                                         num_warps=warps)
    _merge_kernel[(rows,)](part, ids, t_tensor, out, flags, out.stride(0), V=vocab, SPAN=span,
                           SPLITS=n_split, PER_ROW=per_row, num_warps=1)
    return RowStats(out[0], out[1], out[2], out[3], out[4], flags)


def block_partials(z: Tensor, ids: Tensor, col0: int, temperature: float | Tensor, part: Tensor, j: int, *,
                   block: int | None = None) -> None:
    """Write slice ``j`` of ``part`` ([rows, splits, 6] float32): the moments of the logits block ``z``
    ([rows, c], unit last stride), which holds columns [col0, col0 + c) of each row; ids are global."""
    rows, ncols = z.shape
    if rows == 0:
        return
    blk = int(block) if block is not None else default_block(ncols)
    per_row = isinstance(temperature, Tensor)
    t_tensor = temperature.reshape(-1) if isinstance(temperature, Tensor) else part
    _stats_block_kernel[(rows,)](z, z.stride(0), ids, col0, t_tensor, 1.0 if per_row else float(temperature), part,
                                 j, NCOLS=ncols, SPAN=triton.cdiv(ncols, blk) * blk, SPLITS=part.shape[1],
                                 BLOCK=blk, PER_ROW=per_row, num_warps=default_warps(blk, z.element_size()))


def merge_partials(part: Tensor, ids: Tensor, vocab: int, span: int, temperature: float | Tensor, out: Tensor,
                   flags: Tensor) -> None:
    """Merge ``part``'s slices (slice j holds columns [j span, (j + 1) span)) in order into ``out`` [5, rows]
    (log p_k, H, S_k, E_p[S], lse); bad ids, rows and per-row temperatures are counted in ``flags``."""
    rows = part.shape[0]
    if rows == 0:
        return
    per_row = isinstance(temperature, Tensor)
    t_tensor = temperature.reshape(-1) if isinstance(temperature, Tensor) else flags
    _merge_kernel[(rows,)](part, ids, t_tensor, out, flags, out.stride(0), V=vocab, SPAN=span, SPLITS=part.shape[1],
                           PER_ROW=per_row, num_warps=1)
