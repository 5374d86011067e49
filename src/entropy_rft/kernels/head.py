"""The fused LM head on an accelerator: log p_k, H and the statistics from hidden states and the head weight,
in token chunks whose logits are one GEMM each, never the whole ``[tokens, V]`` (Triton + cuBLAS).

Forward, per chunk of C tokens: z = h W^T (+ b) as one GEMM in the input dtype (C x V), then
``stats.row_stats`` reads it once. Backward, per chunk: the same GEMM recomputes z, ``_logit_grad_kernel``
overwrites it in place with

    dL/dz_i = (g_logp (1[i = k] - p_i) - g_ent p_i (log p_i + H)) / T       (d log p_k/dz = e_k - p;
                                                                              dH/dz_i = -S_i, Lemma 3.1)

and two GEMMs give grad_h = (dL/dz) W and grad_W += (dL/dz)^T h (input-dtype tensor-core GEMMs with
float32 accumulation; grad_W accumulates in float32). The head weight is read once per chunk in forward and
twice per chunk in backward (recompute, grad_h); no pass synchronises with the host (the forward's one
synchronisation is the caller's read of the error flags).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from entropy_rft.kernels.stats import default_block, row_stats

__all__ = ["FusedHead", "default_chunk_tokens", "logit_grad_"]

_CHUNK_LOGITS = 1 << 28  # logits per token chunk on an accelerator (512 MiB in bf16)


def default_chunk_tokens(n: int, vocab: int, device: torch.device) -> int:
    """Tokens per chunk: 2^28 logits on an accelerator (the GEMM's M in the thousands at V ~ 150k), 256
    under the interpreter (small shapes)."""
    if device.type == "cpu":
        return max(1, min(n, 256))
    return max(1, min(n, _CHUNK_LOGITS // max(vocab, 1)))


@triton.jit
def _logit_grad_kernel(z_ptr, stride_z, ids_ptr, t_ptr, t_scalar, lse_ptr, ent_ptr, gl_ptr, ge_ptr,
                       V: tl.constexpr, BLOCK: tl.constexpr, PER_ROW: tl.constexpr, HAS_LOGP: tl.constexpr,
                       HAS_ENT: tl.constexpr):
    """Overwrite one block of a row of logits z with dL/dz (see the module docstring)."""
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
        k = tl.load(ids_ptr + row).to(tl.int64)
        g = tl.where(cols == k, gl, 0.0) - gl * p
    if HAS_ENT:
        ge = tl.load(ge_ptr + row)
        h = tl.load(ent_ptr + row)
        g = g - ge * tl.where(p > 0, p * (logp + h), 0.0)  # masked entries (p = 0) give 0, not 0 * -inf
    g = g / t
    tl.store(ptrs, g.to(z_ptr.dtype.element_ty), mask=inside)


def logit_grad_(z: Tensor, ids: Tensor, temperature: float | Tensor, lse: Tensor, entropy: Tensor,
                g_logp: Tensor | None, g_ent: Tensor | None, *, block: int | None = None) -> Tensor:
    """Overwrite the [rows, V] logits ``z`` (unit last stride) with dL/dz for L = sum g_logp log p_k +
    sum g_ent H, given the rows' log-sum-exp and entropy from the forward. Returns ``z``."""
    rows, vocab = z.shape
    if rows == 0:
        return z
    blk = int(block) if block is not None else default_block(vocab)
    per_row = isinstance(temperature, Tensor)
    t_tensor = temperature if per_row else lse
    dummy = lse
    _logit_grad_kernel[(rows, triton.cdiv(vocab, blk))](
        z, z.stride(0), ids, t_tensor, 1.0 if per_row else float(temperature), lse, entropy,
        dummy if g_logp is None else g_logp.float().contiguous(),
        dummy if g_ent is None else g_ent.float().contiguous(),
        V=vocab, BLOCK=blk, PER_ROW=per_row, HAS_LOGP=g_logp is not None, HAS_ENT=g_ent is not None,
        num_warps=8 if blk >= 2048 else 4)
    return z


def _logits_into(buf: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """z = h W^T (+ b) into ``buf`` [C, V] in the input dtype: one GEMM."""
    torch.matmul(h, weight.T, out=buf)
    if bias is not None:
        buf.add_(bias)
    return buf


def _accumulate_grad_w(acc: Tensor, g: Tensor, h: Tensor) -> None:
    """acc (float32 [V, D]) += g^T h for input-dtype g [C, V] and h [C, D]: on CUDA a low-precision GEMM with
    float32 output (``out_dtype``), so the tensor cores run it and nothing is rounded to bf16; else float32."""
    if g.dtype == acc.dtype:
        acc.addmm_(g.T, h)
    elif g.is_cuda:
        acc.add_(torch.mm(g.T, h, out_dtype=acc.dtype))
    else:
        acc.addmm_(g.T.to(acc.dtype), h.to(acc.dtype))


class FusedHead(torch.autograd.Function):
    """(log p_k, H, S_k, E_p[S], flags) of hidden [N, D] under head weight [V, D] in token chunks of ``rows``;
    log p_k and H carry gradients to hidden, weight and bias (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, rows):  # type: ignore[override]
        n, vocab = hidden.shape[0], weight.shape[0]
        out = torch.empty(5, n, dtype=torch.float32, device=hidden.device)
        flags = torch.zeros(4, dtype=torch.int32, device=hidden.device)
        buf = torch.empty(min(rows, max(n, 1)), vocab, dtype=hidden.dtype, device=hidden.device)
        per_row = isinstance(temperature, Tensor)
        with torch.no_grad():
            for r0 in range(0, n, rows):
                sl = slice(r0, min(r0 + rows, n))
                z = _logits_into(buf[: sl.stop - sl.start], hidden[sl], weight, None if bias is None else bias)
                row_stats(z, ids[sl], temperature[sl] if per_row else temperature, out=out[:, sl], flags=flags)
        logp, ent, s_star, s_exp, lse = out
        t_saved = temperature if per_row else torch.tensor(float(temperature))
        ctx.save_for_backward(hidden, weight, bias, ids, lse, ent, t_saved)
        ctx.per_row, ctx.rows = per_row, rows
        ctx.mark_non_differentiable(s_star, s_exp, flags)
        return logp, ent, s_star, s_exp, flags

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g1, _g2, _g3):  # type: ignore[override]
        hidden, weight, bias, ids, lse, ent, t_saved = ctx.saved_tensors
        temperature = t_saved if ctx.per_row else float(t_saved)
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        n, vocab = hidden.shape[0], weight.shape[0]
        rows = ctx.rows
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_b else None
        buf = torch.empty(min(rows, max(n, 1)), vocab, dtype=hidden.dtype, device=hidden.device)
        for r0 in range(0, n, rows):
            sl = slice(r0, min(r0 + rows, n))
            with torch.no_grad():
                g = _logits_into(buf[: sl.stop - sl.start], hidden[sl], weight, bias)
                logit_grad_(g, ids[sl], temperature[sl] if ctx.per_row else temperature, lse[sl], ent[sl],
                            None if g_logp is None else g_logp[sl], None if g_ent is None else g_ent[sl])
                if need_h:
                    torch.matmul(g, weight, out=grad_h[sl])
                if need_w:
                    _accumulate_grad_w(grad_w, g, hidden[sl])
                if need_b:
                    grad_b.add_(g.sum(0, dtype=torch.float32))
        gw = grad_w.to(weight.dtype) if need_w else None
        gb = grad_b.to(bias.dtype) if need_b else None
        return grad_h, gw, gb, None, None, None
