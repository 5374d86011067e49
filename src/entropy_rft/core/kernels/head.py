"""The fused LM head on an accelerator: log p_k, H and the statistics from hidden states and the head weight,
never the whole ``[tokens, V]`` logits (Triton + cuBLAS).

The loops run over vocabulary blocks inside token chunks, so that for micro-batches of up to ``_MAX_ROWS``
tokens (one chunk) the head weight is read once in forward and twice in backward, and each block's
grad_W is one GEMM over all tokens (no float32 [V, D] accumulator).

Forward, per vocabulary block W_j ([c, D]): z_j = h W_j^T (+ b_j), one GEMM in the input dtype ([N, c]);
``stats.block_partials`` folds it into the rows' moments (slice j of an [N, blocks, 6] scratch), and
``stats.merge_partials`` merges the slices in order into log p_k, H, S_k, E_p[S] and lse.
Backward, per block: the same GEMM recomputes z_j, ``_logit_grad_kernel`` overwrites it in place with

    dL/dz_i = (g_logp (1[i = k] - p_i) - g_ent p_i (log p_i + H)) / T       (d log p_k/dz = e_k - p;
                                                                              dH/dz_i = -S_i, Lemma 3.1)

then grad_h += (dL/dz_j) W_j (float32 accumulator, [N, D]) and grad_W_j = (dL/dz_j)^T h: input-dtype
tensor-core GEMMs with float32 accumulation. Nothing synchronises with the host (the forward's one
synchronisation is the caller's read of the error flags).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from entropy_rft.core.kernels.stats import block_partials, default_block, merge_partials

__all__ = ["FusedHead", "default_tiles", "logit_grad_"]

_TILE_LOGITS = 1 << 28  # logits per [token chunk, vocabulary block] tile on an accelerator (512 MiB in bf16)
_MAX_ROWS = 32768  # tokens per chunk: up to here the head weight is read once per pass (twice in backward)
_MIN_COLS = 4096


def default_tiles(n: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(tokens per chunk, vocabulary columns per block): on an accelerator the whole micro-batch (up to 32k
    tokens) against blocks of 2^28 / N columns (at least 4096); under the interpreter small tiles."""
    if device.type == "cpu":
        return max(1, min(n, 256)), min(vocab, 1024)
    rows = max(1, min(n, _MAX_ROWS))
    cols = min(vocab, max(_MIN_COLS, _TILE_LOGITS // rows))
    return rows, cols


@triton.jit
def _logit_grad_kernel(z_ptr, stride_z, ids_ptr, col0, t_ptr, t_scalar, lse_ptr, ent_ptr, gl_ptr, ge_ptr,
                       V: tl.constexpr, BLOCK: tl.constexpr, PER_ROW: tl.constexpr, HAS_LOGP: tl.constexpr,
                       HAS_ENT: tl.constexpr):
    """Overwrite one block of a row of logits z (columns col0 + [0, V) of the vocabulary) with dL/dz."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    ptrs = z_ptr + row.to(tl.int64) * stride_z + cols
    z = tl.load(ptrs, mask=inside, other=float("-inf")).to(tl.float32)
    if PER_ROW:  # noqa: SIM108 (a constexpr branch: Triton compiles one side)
        t = tl.load(t_ptr + row).to(tl.float32)
    else:
        t = t_scalar
    logp = z / t - tl.load(lse_ptr + row)
    p = tl.exp(logp)
    g = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_LOGP:
        gl = tl.load(gl_ptr + row)
        k = tl.load(ids_ptr + row).to(tl.int64) - col0
        g = tl.where(cols == k, gl, 0.0) - gl * p
    if HAS_ENT:
        ge = tl.load(ge_ptr + row)
        h = tl.load(ent_ptr + row)
        g = g - ge * tl.where(p > 0, p * (logp + h), 0.0)  # masked entries (p = 0) give 0, not 0 * -inf
    g = g / t
    tl.store(ptrs, g.to(z_ptr.dtype.element_ty), mask=inside)


def logit_grad_(z: Tensor, ids: Tensor, temperature: float | Tensor, lse: Tensor, entropy: Tensor,
                g_logp: Tensor | None, g_ent: Tensor | None, *, col0: int = 0, block: int | None = None) -> Tensor:
    """Overwrite the logits block ``z`` ([rows, c], unit last stride; columns [col0, col0 + c) of the
    vocabulary) with dL/dz for L = sum g_logp log p_k + sum g_ent H, given the rows' log-sum-exp and entropy
    from the forward. Returns ``z``."""
    rows, ncols = z.shape
    if rows == 0:
        return z
    blk = int(block) if block is not None else default_block(ncols)
    per_row = isinstance(temperature, Tensor)
    dummy = lse
    _logit_grad_kernel[(rows, triton.cdiv(ncols, blk))](
        z, z.stride(0), ids, col0, temperature if per_row else lse, 1.0 if per_row else float(temperature), lse,
        entropy, dummy if g_logp is None else g_logp.float().contiguous(),
        dummy if g_ent is None else g_ent.float().contiguous(),
        V=ncols, BLOCK=blk, PER_ROW=per_row, HAS_LOGP=g_logp is not None, HAS_ENT=g_ent is not None,
        num_warps=8 if blk >= 2048 else 4)
    return z


def _logits_into(buf: Tensor, h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """z = h w^T (+ b) into ``buf`` in the input dtype: one GEMM."""
    torch.matmul(h, w.T, out=buf)
    if b is not None:
        buf.add_(b)
    return buf


def _addmm_f32(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (float32) += a @ b for input-dtype a, b: on CUDA a low-precision tensor-core GEMM with float32
    output (``out_dtype``), so no partial product is rounded to bf16; elsewhere in float32."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _blocks(vocab: int, cols: int) -> list[slice]:
    return [slice(c, min(c + cols, vocab)) for c in range(0, vocab, cols)]


class FusedHead(torch.autograd.Function):
    """(log p_k, H, S_k, E_p[S], flags) of hidden [N, D] under head weight [V, D] (bias [V] or None), in token
    chunks of ``rows`` and vocabulary blocks of ``cols``; log p_k and H carry gradients to hidden, weight and
    bias (see the module docstring). ``temperature``: a float, or a float32 [N] tensor (one per row)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, rows, cols):
        n, vocab = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        blocks = _blocks(vocab, cols)
        out = torch.empty(5, n, dtype=torch.float32, device=dev)
        flags = torch.zeros(4, dtype=torch.int32, device=dev)
        part = torch.empty(n, len(blocks), 6, dtype=torch.float32, device=dev)
        buf = torch.empty(min(rows, max(n, 1)) * min(cols, vocab), dtype=hidden.dtype, device=dev)
        per_row = isinstance(temperature, Tensor)
        with torch.no_grad():
            for r0 in range(0, n, rows):
                sl = slice(r0, min(r0 + rows, n))
                t = temperature[sl] if per_row else temperature
                for j, cb in enumerate(blocks):
                    z = buf[: (sl.stop - sl.start) * (cb.stop - cb.start)].view(sl.stop - sl.start, -1)
                    _logits_into(z, hidden[sl], weight[cb], None if bias is None else bias[cb])
                    block_partials(z, ids[sl], cb.start, t, part[sl], j)
            merge_partials(part, ids, vocab, cols, temperature, out, flags)
        logp, ent, s_star, s_exp, lse = out
        t_saved = temperature if per_row else torch.tensor(float(temperature))
        ctx.save_for_backward(hidden, weight, bias, ids, lse, ent, t_saved)
        ctx.per_row, ctx.rows, ctx.cols = per_row, rows, cols
        ctx.mark_non_differentiable(s_star, s_exp, flags)
        return logp, ent, s_star, s_exp, flags

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g1, _g2, _g3):
        hidden, weight, bias, ids, lse, ent, t_saved = ctx.saved_tensors
        temperature = t_saved if ctx.per_row else float(t_saved)
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, cols = ctx.rows, ctx.cols
        one_chunk = n <= rows  # each block's grad_W is then one GEMM over every token: no accumulator
        dev = hidden.device
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_h else None
        grad_w = None
        if need_w:
            grad_w = (torch.empty(weight.shape, dtype=weight.dtype, device=dev) if one_chunk
                      else torch.zeros(weight.shape, dtype=torch.float32, device=dev))
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_b else None
        buf = torch.empty(min(rows, max(n, 1)) * min(cols, vocab), dtype=hidden.dtype, device=dev)
        with torch.no_grad():
            for r0 in range(0, n, rows):
                sl = slice(r0, min(r0 + rows, n))
                t = t_saved[sl] if ctx.per_row else temperature
                for cb in _blocks(vocab, cols):
                    g = buf[: (sl.stop - sl.start) * (cb.stop - cb.start)].view(sl.stop - sl.start, -1)
                    _logits_into(g, hidden[sl], weight[cb], None if bias is None else bias[cb])
                    logit_grad_(g, ids[sl], t, lse[sl], ent[sl], None if g_logp is None else g_logp[sl],
                                None if g_ent is None else g_ent[sl], col0=cb.start)
                    if grad_h is not None:
                        _addmm_f32(grad_h[sl], g, weight[cb])
                    if grad_w is not None and one_chunk:
                        torch.matmul(g.T, hidden[sl], out=grad_w[cb])
                    elif grad_w is not None:
                        _addmm_f32(grad_w[cb], g.T, hidden[sl])
                    if grad_b is not None:
                        grad_b[cb] += g.sum(0, dtype=torch.float32)
        gh = grad_h.to(hidden.dtype) if grad_h is not None else None
        gw = grad_w.to(weight.dtype) if grad_w is not None else None
        gb = grad_b.to(bias.dtype) if grad_b is not None else None
        return gh, gw, gb, None, None, None, None
