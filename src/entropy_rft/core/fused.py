"""The fused LM-head path: sampled-token log p (with grad), entropy and TokenStats straight from the hidden
states and the LM-head weight, never materialising the ``[tokens, V]`` logits (formulas: ``dynamics``).

Logits are formed one [token tile, vocab block] tile at a time, in the input dtype for the matmul and
float32 (float64 for float64 inputs) after it, and recomputed in backward. Every tile reuses one set of
buffers (``out=`` and in-place ops), so no tile allocates, and page-faults, fresh temporaries.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from entropy_rft.core import dynamics as dyn
from entropy_rft.core.dynamics import GPU_CHUNK_ELEMS, TokenStats, check_ids_range, check_temperature

__all__ = ["FusedOut", "fused_logp"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# CPU tiles: up to this many tokens per tile (the matmuls' M), and vocab blocks of about _CPU_FUSED_ELEMS
# logits per tile (the forward holds 4 buffers of a tile's size, the backward 3), at least _MIN_COLS wide.
# On an accelerator a tile is whole rows: GPU_CHUNK_ELEMS / 4 logits.
_CPU_TILE_ROWS = 1024
_CPU_FUSED_ELEMS = 1 << 21
_MIN_COLS = 256


class FusedOut(NamedTuple):
    """What ``fused_logp`` returns.

    logp:    log p_k of the sampled tokens, shape ``[...]``, with grad w.r.t. hidden, weight (and bias);
             float32 (float64 for float64 inputs).
    entropy: H with grad, shape ``[...]`` when ``with_entropy=True`` (for an entropy bonus), else None.
    stats:   TokenStats of the same positions, float32, no grad.
    """

    logp: Tensor
    entropy: Tensor | None
    stats: TokenStats



def _block_logits(h: Tensor, weight: Tensor, bias: Tensor | None, t: float, out: Tensor) -> Tensor:
    """z = (h W^T + b) / T into ``out`` ([r, c] in the compute dtype), as ``(h @ W.T + b).to(cd) / T``."""
    if h.dtype == out.dtype and weight.dtype == out.dtype:
        z = torch.matmul(h, weight.T, out=out)
        if bias is not None:
            z.add_(bias)
    else:  # low-precision inputs: the matmul (and bias) in their dtype, as the materialised path does
        z = out.copy_(h @ weight.T if bias is None else h @ weight.T + bias)
    return z.div_(t) if t != 1.0 else z


def _tiles(n: int, vocab: int, rows: int, cols: int):
    """(token slice, vocab slice) pairs: token tiles of ``rows``, each swept over vocab blocks of ``cols``."""
    for r0 in range(0, n, rows):
        for c0 in range(0, vocab, cols):
            yield slice(r0, min(r0 + rows, n)), slice(c0, min(c0 + cols, vocab))


class _FusedLogp(torch.autograd.Function):
    """log p_k (and H) from hidden states and the LM head in [token tile, vocab block] tiles, recomputing the
    logits in backward. Each tile's matmul has a whole token tile as M, and the LM head is read once per
    token tile and pass (a token-only chunking reads it once per small chunk and re-writes its gradient).

    Forward keeps per-row running moments over the vocab blocks (online softmax): with m the running max and
    y = z - m, S0 = sum e^y, S1 = sum e^y y, S2 = sum e^2y, S3 = sum e^2y y; a new max m' rescales them with
    a = e^(m - m'), d = m - m': S0 <- a S0, S1 <- a (S1 + d S0), S2 <- a^2 S2, S3 <- a^2 (S3 + d S2). The
    statistics then follow from the moments exactly as in ``dynamics.token_stats``.
    Gradients (z = (h W^T + b) / T, p = softmax(z)):
      d log p_k / dz = e_k - p;   dH / dz_i = -p_i (log p_i + H) = -S_i   (the entropy discriminator).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, rows, cols, cd):
        n, vocab = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        m = torch.full((n,), float("-inf"), dtype=cd, device=dev)
        mom = torch.zeros(4, n, dtype=cd, device=dev)  # S0, S1, S2, S3 relative to m
        z_k = torch.zeros(n, dtype=cd, device=dev)
        bufs = torch.empty(4, min(rows, n) * min(cols, vocab), dtype=cd, device=dev)
        with torch.no_grad():
            for sl, cb in _tiles(n, vocab, rows, cols):
                shape = (sl.stop - sl.start, cb.stop - cb.start)
                y, scratch = bufs[0, : shape[0] * shape[1]].view(shape), bufs[1:, : shape[0] * shape[1]]
                y = _block_logits(hidden[sl], weight[cb], None if bias is None else bias[cb], temperature, y)
                local = ids[sl] - cb.start
                inside = (local >= 0) & (local < shape[1])
                z_k[sl] = torch.where(inside, y.gather(-1, local.clamp(0, shape[1] - 1).unsqueeze(-1)).squeeze(-1),
                                      z_k[sl])
                if shape[1] == vocab:  # one block holds whole rows: no running max to rescale against
                    m[sl] = y.amax(-1)
                    y.sub_(m[sl].unsqueeze(-1))
                    mom[:, sl] = torch.stack(dyn._moments(y, scratch.view(3, *shape)))
                    continue
                m_old = m[sl]
                m_new = torch.maximum(m_old, y.amax(-1))
                shift = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)  # an all -inf row
                y.sub_(shift.unsqueeze(-1))
                a = torch.exp(m_old - shift)
                ad = torch.where(a > 0, a * (m_old - shift), torch.zeros_like(a))
                s0, s1, s2, s3 = mom[:, sl]
                b0, b1, b2, b3 = dyn._moments(y, scratch.view(3, *shape))
                s1.mul_(a).add_(ad * s0).add_(b1)
                s3.mul_(a * a).add_(a * ad * s2).add_(b3)
                s0.mul_(a).add_(b0)
                s2.mul_(a * a).add_(b2)
                m[sl] = m_new
        dyn._check_rows_finite(m)
        logp, ent, s_star, s_exp, log_s0 = dyn._stats_from_moments(z_k - m, *mom)
        lse = m + log_s0
        ctx.save_for_backward(hidden, weight, bias, ids, lse, ent)
        ctx.temperature, ctx.rows, ctx.cols, ctx.cd = temperature, rows, cols, cd
        s_star, s_exp = s_star.to(torch.float32), s_exp.to(torch.float32)
        ctx.mark_non_differentiable(s_star, s_exp)
        return logp, ent, s_star, s_exp

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g1, _g2):
        hidden, weight, bias, ids, lse, ent = ctx.saved_tensors
        t, rows, cols, cd = ctx.temperature, ctx.rows, ctx.cols, ctx.cd
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        n, vocab = hidden.shape[0], weight.shape[0]
        bufs = torch.empty(3, min(rows, n) * min(cols, vocab), dtype=cd, device=hidden.device)
        for sl, cb in _tiles(n, vocab, rows, cols):
            shape = (sl.stop - sl.start, cb.stop - cb.start)
            zb, pb, gb_ = (b[: shape[0] * shape[1]].view(shape) for b in bufs)
            hc = hidden[sl]
            with torch.no_grad():
                z = _block_logits(hc, weight[cb], None if bias is None else bias[cb], t, zb)
                logp_all = z.sub_(lse[sl].unsqueeze(-1))  # log p, in place
                p = torch.exp(logp_all, out=pb)
                g = None
                if g_logp is not None:
                    gl = g_logp[sl].to(cd)
                    g = torch.mul(p, -gl.unsqueeze(-1), out=gb_)
                    local = ids[sl] - cb.start
                    inside = (local >= 0) & (local < shape[1])  # no host sync: rows outside add 0
                    g.scatter_add_(-1, local.clamp(0, shape[1] - 1).unsqueeze(-1),
                                   torch.where(inside, gl, torch.zeros_like(gl)).unsqueeze(-1))
                if g_ent is not None:
                    # dH/dz_i = -p_i (log p_i + H) = -S_i; masked entries (log p = -inf, p = 0) give 0, not nan
                    term = logp_all.clamp_(min=torch.finfo(cd).min).add_(ent[sl].unsqueeze(-1)).mul_(p)
                    term.mul_(-g_ent[sl].to(cd).unsqueeze(-1))
                    g = term if g is None else g.add_(term)
                if g is None:
                    g = gb_.zero_()
                if t != 1.0:
                    g.div_(t)
                if grad_h is not None:
                    grad_h[sl] += (g.to(weight.dtype) @ weight[cb]).to(acc)
                if grad_w is not None:
                    grad_w[cb].addmm_(g.T.to(acc), hc.to(acc))
                if grad_b is not None:
                    grad_b[cb] += g.sum(0).to(acc)
        gh = grad_h.to(hidden.dtype) if grad_h is not None else None
        gw = grad_w.to(weight.dtype) if grad_w is not None else None
        gb = grad_b.to(bias.dtype) if grad_b is not None else None
        return gh, gw, gb, None, None, None, None, None


def fused_logp(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
    vocab_chunk: int | None = None,
    with_entropy: bool = False,
    backend: str = "auto",
) -> FusedOut:
    """Sampled-token log-probs with grad, from hidden states and the LM-head weight, without the full logits.

    hidden: [..., D] (any leading dims); weight: [V, D] (``model.get_output_embeddings().weight``);
    token_ids: [...] matching ``hidden.shape[:-1]``; bias: optional [V].
    The logits z = (hidden @ weight.T + bias) / temperature are formed in tiles of ``chunk_size`` tokens
    (default 1024 on CPU) by ``vocab_chunk`` vocabulary entries (default on CPU: about 2^21 logits per tile,
    at least 256 columns; on an accelerator, the whole vocabulary and 2^22 logits per tile), in the input
    dtype for the matmul and float32 (float64 for
    float64 inputs) after it, exactly as the materialised ``log_softmax(logits.float() / T)`` path; backward
    recomputes each tile's logits (as fused linear-cross-entropy kernels do), so peak memory is O(tile)
    rather than O(N V). Results do not depend on the tiling beyond float rounding (the forward sums the
    vocabulary block by block, with an online max). Returns ``FusedOut(logp, entropy, stats)``:
    logp [...] with grad; entropy [...] with grad if ``with_entropy`` else None; stats a float32 TokenStats
    without grad. Gradients: d log p_k/dz = e_k - p; dH/dz = -S (Lemma 3.1).

    backend: ``auto`` (default) runs ``kernels.head.FusedHead`` on CUDA when Triton is installed and the
    inputs are float32, bfloat16 or float16 (vocabulary blocks inside token chunks of up to 32k tokens, so
    the head weight is read once in forward and twice in backward; the statistics kernel on each block;
    input-dtype GEMMs with float32 accumulation; one host sync per call), and the tiled torch path below
    elsewhere; ``torch`` or ``triton`` forces one, as ``dynamics.token_stats``'s switch does
    (``chunk_size`` and ``vocab_chunk`` are the tile of either).
    """
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating-point tensor of shape [..., D], got {type(hidden).__name__}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError("weight must be a floating-point [V, D] tensor (the LM-head weight)")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must have shape [..., {weight.shape[1]}] to match weight [V, D]={tuple(weight.shape)}, "
            f"got {tuple(hidden.shape)}"
        )
    vocab, dim = weight.shape
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"bias must have shape ({vocab},), got {tuple(bias.shape)}")
    if not isinstance(token_ids, Tensor) or token_ids.is_floating_point():
        raise ValueError(f"token_ids must be an integer tensor of shape {tuple(hidden.shape[:-1])}")
    if tuple(token_ids.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"token_ids must have shape {tuple(hidden.shape[:-1])} (hidden without D), got {tuple(token_ids.shape)}"
        )
    t = check_temperature(temperature)
    for name, v in (("chunk_size", chunk_size), ("vocab_chunk", vocab_chunk)):
        if v is not None and int(v) < 1:
            raise ValueError(f"{name} must be a positive number, got {v!r}")
    path = dyn.resolve_backend(backend, hidden.device)
    if path == "triton" and hidden.dtype not in _TRITON_DTYPES:
        if backend == "triton":
            raise ValueError(f"backend='triton' takes float32, bfloat16 or float16 hidden states, got {hidden.dtype}")
        path = "torch"
    if path == "torch":
        check_ids_range(token_ids, vocab)
    n = max(1, token_ids.numel())
    if path == "triton":
        return _fused_logp_triton(hidden, weight, bias, token_ids, t, chunk_size, vocab_chunk, with_entropy)
    if hidden.device.type != "cpu":  # whole-vocabulary tiles: fewer, larger kernels
        rows = int(chunk_size) if chunk_size is not None else max(1, GPU_CHUNK_ELEMS // 4 // vocab)
        cols = int(vocab_chunk) if vocab_chunk is not None else vocab
    else:  # cache-sized tiles whose matmuls have a whole token tile as M
        rows = int(chunk_size) if chunk_size is not None else _CPU_TILE_ROWS
        cols = int(vocab_chunk) if vocab_chunk is not None else max(_MIN_COLS, _CPU_FUSED_ELEMS // min(rows, n))
    rows = min(rows, n)
    cd = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    batch_shape = hidden.shape[:-1]
    h2 = hidden.reshape(-1, dim)
    ids = token_ids.reshape(-1).to(device=hidden.device, dtype=torch.long)
    logp, ent, s_star, s_exp = _FusedLogp.apply(h2, weight, bias, ids, t, rows, min(cols, vocab), cd)
    stats_ent = ent.detach().to(torch.float32).reshape(batch_shape)
    s_star = s_star.reshape(batch_shape)
    s_exp = s_exp.reshape(batch_shape)
    stats = TokenStats(
        entropy=stats_ent,
        logp=logp.detach().to(torch.float32).reshape(batch_shape),
        s_star=s_star,
        s_expected=s_exp,
        s_centered=s_star - s_exp,
    )
    return FusedOut(logp.reshape(batch_shape), ent.reshape(batch_shape) if with_entropy else None, stats)


def _fused_logp_triton(hidden: Tensor, weight: Tensor, bias: Tensor | None, token_ids: Tensor, t: float,
                       chunk_size: int | None, vocab_chunk: int | None, with_entropy: bool) -> FusedOut:
    """``fused_logp`` through ``kernels.head.FusedHead``; bad ids and rows raise as the torch path raises
    them, after the call's one host sync."""
    from entropy_rft.core.kernels.head import FusedHead, default_tiles

    vocab, dim = weight.shape
    batch_shape = hidden.shape[:-1]
    h2 = hidden.reshape(-1, dim)
    ids = token_ids.reshape(-1).to(device=hidden.device, dtype=torch.long)
    rows, cols = default_tiles(ids.numel(), vocab, hidden.device)
    rows = int(chunk_size) if chunk_size is not None else rows
    cols = int(vocab_chunk) if vocab_chunk is not None else cols
    logp, ent, s_star, s_exp, flags = FusedHead.apply(h2, weight, bias, ids, t, rows, cols)
    dyn._raise_flags(flags.tolist(), token_ids, vocab)
    s_star, s_exp = s_star.reshape(batch_shape), s_exp.reshape(batch_shape)
    stats = TokenStats(entropy=ent.detach().reshape(batch_shape), logp=logp.detach().reshape(batch_shape),
                       s_star=s_star, s_expected=s_exp, s_centered=s_star - s_exp)
    return FusedOut(logp.reshape(batch_shape), ent.reshape(batch_shape) if with_entropy else None, stats)
