"""Token statistics of softmax policies: log p_k, the entropy H, the entropy discriminator S_k, its on-policy
expectation E_p[S] and the centered S_c = S_k - E_p[S] (Paper A, Lemma 3.1 and Thm 3.3; the formulas stand in
``entropy_rft.core.theory``'s docstring, which also holds the theorems' predictions).

All statistics are float32 whatever the input dtype, with the temperature applied as sampling applies it
(``z / T``). Statistics that need the whole vocabulary are computed in one pass over chunks of rows; the
full ``[tokens, V]`` float32 softmax is never materialised. ``entropy_rft.core.fused.fused_logp`` goes one step
further and never materialises the logits at all: it works from the hidden states and the LM-head weight.
On CUDA with Triton installed, ``backend="auto"`` runs the kernel of ``entropy_rft.core.kernels.stats``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["BACKENDS", "NonFiniteLogits", "TokenStats", "default_chunk_rows", "token_stats"]

# Per-chunk working set, in elements, for the row-chunked passes. On CPU a chunk of about 2 MiB of float32
# per temporary stays in cache, which makes the chunked pass faster than torch.logsumexp (which allocates a
# full-size temporary). On an accelerator, larger chunks amortise kernel launches.
_CPU_CHUNK_ELEMS = 1 << 19
GPU_CHUNK_ELEMS = 1 << 24
# token_stats keeps at most this fraction of the logits' size in temporaries (about 4 live per chunk).
_MAX_TEMP_FRACTION = 0.05 / 4
_SMALL_BYTES = 64 << 20  # below this the fraction rule is moot


@dataclass(frozen=True)
class TokenStats:
    """Per-token statistics of one position's distribution, all float32 with the batch shape ``[...]``.

    entropy:    H = -sum_i p_i log p_i
    logp:       log p_k of the sampled token k (-inf only if p_k is exactly zero, e.g. a masked token)
    s_star:     S_k = p_k (H + log p_k)                   (Lemma 3.1 / Thm 3.2)
    s_expected: E_{i~p}[S_i] = H sum p^2 + sum p^2 log p   (Thm 3.3)
    s_centered: S_c = S_k - E_p[S]                         (Thm 3.3)
    """

    entropy: Tensor
    logp: Tensor
    s_star: Tensor
    s_expected: Tensor
    s_centered: Tensor


# --------------------------------------------------------------------------------------------- validation


def check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def check_logits_ids(logits: Tensor, token_ids: Tensor, name: str = "logits", check_range: bool = True) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        dt = getattr(logits, "dtype", type(logits).__name__)
        raise ValueError(f"{name} must be a floating-point tensor of shape [..., V], got dtype {dt}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not isinstance(token_ids, Tensor) or token_ids.is_floating_point() or token_ids.is_complex():
        dt = getattr(token_ids, "dtype", type(token_ids).__name__)
        raise ValueError(f"token_ids must be an integer tensor of shape {tuple(logits.shape[:-1])}, got {dt}")
    if tuple(token_ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"token_ids must have shape {tuple(logits.shape[:-1])} (the {name} shape without V), "
            f"got {tuple(token_ids.shape)}"
        )
    if check_range:  # the Triton kernel checks the range on the device, without a host sync
        check_ids_range(token_ids, logits.shape[-1])


def check_ids_range(token_ids: Tensor, vocab: int) -> None:
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        lo, hi = int(token_ids.min()), int(token_ids.max())
        raise ValueError(f"token_ids must lie in [0, {vocab - 1}] (V={vocab}), got values in [{lo}, {hi}]")


def default_chunk_rows(rows: int, vocab: int, device: torch.device | str = "cpu") -> int:
    """Rows per chunk for ``token_stats``: a cache-sized working set (CPU) or launch-amortising one (GPU),
    and, for logits over 64 MiB, temporaries of at most ~5% of the logits' size."""
    dev = torch.device(device)
    budget = GPU_CHUNK_ELEMS if dev.type != "cpu" else _CPU_CHUNK_ELEMS
    chunk = max(1, min(rows, budget // max(vocab, 1)))
    if rows * vocab * 4 > _SMALL_BYTES:
        chunk = min(chunk, max(1, int(rows * _MAX_TEMP_FRACTION)))
    return chunk


# ------------------------------------------------------------------------------------------- core kernel


class NonFiniteLogits(ValueError):
    """Logits with a row of no finite entry, or a NaN or +inf: bad input, or (in training) a diverged policy."""


def _check_rows_finite(row_max: Tensor) -> None:
    bad = ~torch.isfinite(row_max)
    if bool(bad.any()):
        raise NonFiniteLogits(
            "logits must have at least one finite entry per row and no NaN or +inf; "
            f"{int(bad.sum())} row(s) violate this"
        )


def _row_blocks(x: Tensor) -> list[Tensor]:
    """2-D views [r, V] covering x's rows in row-major order, without copying (unlike ``reshape``)."""
    if x.dim() == 1:
        return [x.unsqueeze(0)]
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:
        return [b for sub in x.unbind(0) for b in _row_blocks(sub)]


def _stats_from_moments(y_k: Tensor, s0: Tensor, s1: Tensor, s2: Tensor, s3: Tensor) -> tuple[Tensor, ...]:
    """(logp_k, H, S_k, E_p[S], log S0) from the row moments of y = z/T - max (see ``_rows_stats``):
    S0 = sum e, S1 = sum e y, S2 = sum e^2, S3 = sum e^2 y, with e = exp(y); y_k is the sampled entry."""
    log_s0 = torch.log(s0)
    ybar = s1 / s0
    entropy = (log_s0 - ybar).clamp(min=0.0)
    logp = y_k - log_s0
    p_k = torch.exp(logp)
    s_star = torch.where(p_k > 0, p_k * (y_k - ybar), torch.zeros_like(p_k))  # S_k = p_k (H + log p_k)
    s_expected = (s3 - ybar * s2) / (s0 * s0)  # E_p[S] (Thm 3.3)
    return logp, entropy, s_star, s_expected, log_s0


def _rows_stats(y: Tensor, ids: Tensor, scratch: Tensor | None = None) -> tuple[Tensor, ...]:
    """Statistics of rows of scaled logits ``y`` [r, V] (a scratch buffer; it is modified in place).

    With m = max_i y_i, e_i = exp(y_i - m), S0 = sum e, ybar = sum p (y - m) (so that p_i = e_i / S0):
      log p_i = (y_i - m) - log S0                  H = log S0 - ybar
      S_i = p_i (H + log p_i) = p_i (y_i - m - ybar)
      E_p[S] = sum p_i^2 (y_i - m - ybar) = (sum e^2 (y - m) - ybar sum e^2) / S0^2     (Thm 3.3)
    scratch: [3, r, V] buffers in y's dtype for the temporaries (callers reuse one across chunks: fresh
    chunk-sized temporaries are mmapped and page-faulted on every chunk by glibc's default malloc).
    Returns (logp, entropy, s_star, s_expected, lse), each [r], in y's dtype.
    """
    m = y.amax(dim=-1, keepdim=True)
    _check_rows_finite(m)
    y.sub_(m)  # y <- y - m <= 0 ; masked entries stay -inf
    y_k = y.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    logp, entropy, s_star, s_expected, log_s0 = _stats_from_moments(y_k, *_moments(y, scratch))
    return logp, entropy, s_star, s_expected, m.squeeze(-1) + log_s0


def _moments(y: Tensor, scratch: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row sums S0 = sum e, S1 = sum e y, S2 = sum e^2, S3 = sum e^2 y of e = exp(y), for shifted logits y
    [r, V] (<= 0; -inf entries are clamped in place to a finite floor if they turn up in a product)."""
    e, ey, tmp = torch.empty((3, *y.shape), dtype=y.dtype, device=y.device) if scratch is None else scratch
    torch.exp(y, out=e)
    s0 = e.sum(-1)
    s1 = torch.mul(e, y, out=ey).sum(-1)
    s2 = torch.mul(e, e, out=tmp).sum(-1)
    s3 = torch.mul(ey, e, out=tmp).sum(-1)
    if not bool(torch.isfinite(s1).all()):
        # -inf entries give 0 * -inf = nan: they carry no mass, so clamp them to a finite floor and redo.
        y.clamp_(min=torch.finfo(y.dtype).min)
        s1 = torch.mul(e, y, out=ey).sum(-1)
        s3 = torch.mul(ey, e, out=tmp).sum(-1)
    return s0, s1, s2, s3


def _stats_kernel(y: Tensor, ids: Tensor) -> tuple[Tensor, ...]:
    """Pure-functional twin of ``_rows_stats`` (no in-place ops) for ``torch.compile``; same formulas."""
    m = y.amax(dim=-1, keepdim=True)
    y = y - m
    y_k = y.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    e = torch.exp(y)
    y = torch.where(e > 0, y, torch.zeros_like(y))
    s0 = e.sum(-1)
    s1 = (e * y).sum(-1)
    s2 = (e * e).sum(-1)
    s3 = (e * e * y).sum(-1)
    logp, entropy, s_star, s_expected, _ = _stats_from_moments(y_k, s0, s1, s2, s3)
    return logp, entropy, s_star, s_expected, m.squeeze(-1)


_COMPILED: dict[str, object] = {}


def _compiled_kernel(backend: str):
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(_stats_kernel, dynamic=True, backend=backend)
    return _COMPILED[backend]


BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """Whether Triton is installed (the optional extra ``pip install --no-deps 'triton==3.6.0'``)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """'torch' or 'triton' for tensors on ``device``: ``auto`` picks Triton on CUDA when it is installed and
    the torch path everywhere else; ``triton`` on CPU tensors needs Triton's interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs Triton: pip install --no-deps 'triton==3.6.0' "
                             "(or use backend='torch')")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on CPU tensors runs only under Triton's interpreter: set "
                             "TRITON_INTERPRET=1 before Triton is imported, or use backend='torch'")
    return backend


def _row_temperature(temperature: float | Tensor, batch_shape: torch.Size, device: torch.device
                     ) -> float | Tensor:
    """A checked scalar temperature, or a float32 per-row temperature tensor of the batch shape."""
    if not isinstance(temperature, Tensor):
        return check_temperature(temperature)
    if not temperature.is_floating_point() or tuple(temperature.shape) != tuple(batch_shape):
        raise ValueError(f"a per-row temperature must be a float tensor of shape {tuple(batch_shape)} (the "
                         f"logits without V), got {temperature.dtype} {tuple(temperature.shape)}")
    return temperature.to(device=device, dtype=torch.float32)


def _raise_flags(flags: list[int], token_ids: Tensor, vocab: int) -> None:
    """The Triton kernel's counts of bad ids, temperatures and rows, raised as the torch path raises them."""
    bad_rows, bad_ids, bad_t = flags[0], flags[1], flags[2]
    if bad_ids:
        check_ids_range(token_ids, vocab)
    if bad_t:
        raise ValueError(f"temperature must be finite and > 0 on every row; {bad_t} row(s) are not")
    if bad_rows:
        raise NonFiniteLogits(
            "logits must have at least one finite entry per row and no NaN or +inf; "
            f"{bad_rows} row(s) violate this"
        )


def _token_stats_triton(logits: Tensor, token_ids: Tensor, temperature: float | Tensor) -> TokenStats:
    """``token_stats`` through ``kernels.stats.row_stats``: one read of the logits, one host sync."""
    from entropy_rft.core.kernels.stats import row_stats

    batch_shape = logits.shape[:-1]
    ids = token_ids.to(device=logits.device)
    r = row_stats(logits, ids, temperature)
    _raise_flags(r.flags.tolist(), token_ids, logits.shape[-1])
    ent, logp, s_star, s_exp = (v.reshape(batch_shape) for v in (r.entropy, r.logp, r.s_star, r.s_expected))
    return TokenStats(entropy=ent, logp=logp, s_star=s_star, s_expected=s_exp, s_centered=s_star - s_exp)


@torch.no_grad()
def token_stats(
    logits: Tensor,
    token_ids: Tensor,
    temperature: float | Tensor = 1.0,
    *,
    chunk_size: int | None = None,
    compile: bool | str = False,
    backend: Literal["auto", "torch", "triton"] = "auto",
) -> TokenStats:
    """Entropy, log p_k, S_k, E_p[S] and S_c for every position (Paper A, Lemma 3.1 and Thm 3.3).

    logits: [..., V], any float dtype (computed in float32); -inf entries are masked tokens.
    token_ids: [...] integer ids of the sampled tokens, in [0, V).
    temperature: p = softmax(logits / temperature), as sampling applies it: a float, or a float tensor of
        shape [...] with one temperature per row (verl's per-token temperature); applied inside the pass.
    backend: ``auto`` (default) runs the Triton kernel (``kernels.stats``: one read of the logits, no
        scratch beyond O(rows), one host sync) on CUDA when Triton is installed, and the torch path below
        elsewhere; ``torch`` or ``triton`` forces one (``triton`` on CPU needs ``TRITON_INTERPRET=1``).
        ``chunk_size`` and ``compile`` apply to the torch path.
    chunk_size: rows per chunk (default: ``default_chunk_rows``). Per-chunk temporaries only; neither the
        full float32 softmax nor a full copy of the logits is ever made. Results do not depend on it.
    compile: False (default) runs the eager kernel, which is deterministic across processes for a fixed
        thread count (exact resume relies on it). True (or an inductor backend name) runs the same formulas
        under ``torch.compile(dynamic=True)``; numbers agree with eager to float32 rounding, not bitwise.

    Raises ValueError for non-float logits, mismatched shapes, ids out of range, temperature <= 0, and rows
    with no finite logit (or NaN / +inf).
    """
    path = resolve_backend(backend, logits.device)
    check_logits_ids(logits, token_ids, check_range=path == "torch")
    t = _row_temperature(temperature, logits.shape[:-1], logits.device)
    if path == "triton":
        return _token_stats_triton(logits, token_ids, t)
    if isinstance(t, Tensor) and not bool(((t > 0) & torch.isfinite(t)).all()):
        raise ValueError(f"temperature must be finite and > 0 on every row; {int((~(t > 0)).sum())} row(s) "
                         "are not")
    t_rows = t.reshape(-1) if isinstance(t, Tensor) else None
    batch_shape = logits.shape[:-1]
    vocab = logits.shape[-1]
    ids = token_ids.reshape(-1).to(device=logits.device, dtype=torch.long)
    rows = ids.shape[0]
    if chunk_size is None:
        chunk = default_chunk_rows(rows, vocab, logits.device)
    else:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size!r}")
        chunk = int(chunk_size)
    outs = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4)]
    kernel = _compiled_kernel("inductor" if compile is True else str(compile)) if compile else None
    # one set of chunk buffers for the whole pass (the scaled logits and 3 temporaries), reused by every chunk
    bufs = torch.empty(4, max(1, min(chunk, rows)), vocab, dtype=torch.float32, device=logits.device)
    offset = 0
    for block in _row_blocks(logits):
        for start in range(0, block.shape[0], chunk):
            zc = block[start : start + chunk]
            r = zc.shape[0]
            y = bufs[0, :r]
            sl = slice(offset + start, offset + start + r)
            if t_rows is not None:
                y.copy_(zc).div_(t_rows[sl].unsqueeze(-1))
            elif t == 1.0:
                y.copy_(zc)
            elif zc.dtype == torch.float32:
                torch.div(zc, t, out=y)
            else:
                y.copy_(zc).div_(t)
            if kernel is None:
                res = _rows_stats(y, ids[sl], bufs[1:, :r])
            else:
                _check_rows_finite(y.amax(-1))
                res = kernel(y, ids[sl])
            for o, v in zip(outs, res[:4]):
                o[sl] = v
        offset += block.shape[0]
    logp, ent, s_star, s_exp = (o.reshape(batch_shape) for o in outs)
    return TokenStats(entropy=ent, logp=logp, s_star=s_star, s_expected=s_exp, s_centered=s_star - s_exp)
