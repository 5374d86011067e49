"""Entropy dynamics of softmax policies, as code (Paper A, Wang et al. 2026; Paper B, Cui et al. 2025).

This docstring is the one place where the formulas stand, by the paper's result numbers (Paper A numbers its
results, not its equations; docs/theory.md explains them in words). Every other module cites them from here.

For one position: logits z over the vocabulary, p = softmax(z / T), entropy H = -sum_i p_i log p_i, and the
sampled token k. Everything here is a pure tensor function that knows nothing about models or training.

- Entropy discriminator (Lemma 3.1, Thm 3.2):       S_i = p_i (H + log p_i)
- Its on-policy expectation (Thm 3.3):              E_{i~p}[S_i] = H sum_i p_i^2 + sum_i p_i^2 log p_i
- Centered discriminator (Thm 3.3):                 S_c = S_k - E_p[S]
- Single-logit update z -> z + eps e_k (Thm 3.2):   dH = -eps S_k + O(eps^2)
- GRPO logit step z -> z + alpha (e_k - p) (3.3):   dH = -alpha S_c + O(alpha^2), alpha = lr r A
- Off-policy (importance ratio r):                  factor r S_c
- Thm 3.3 per token of a batch step:                dH_t = -w_t A_t r_t S_c,t (lr dropped), w_t the loss's
                                                    aggregation weight (0 for a token without gradient)
- Thm 3.3 batch form:                               sum_t dH_t (weighted); unweighted, the mean over
                                                    valid tokens of -A_t S_c,t
- Corollary 3.4:                                    E_{k~p}[S_c] = 0 exactly
- Corollary 3.5:                                    batch mean of S_c ~ 0 on-policy

Where they are computed: S, E_p[S], S_c in ``token_stats`` (``TokenStats``); Thm 3.2 in
``single_logit_entropy_change``; Thm 3.3, per token and per batch, in ``first_order_entropy_change``, the
single implementation of its prediction: ``predicted_entropy_change``, ``batch_predicted_entropy_change``,
``probe.tabular_prediction``, ``control.lens_attribution`` and ``metrics.stats_metrics`` all call it;
the exact float64 check of both theorems in ``exact_entropy_change``.

All statistics are float32 whatever the input dtype, with the temperature applied as sampling applies it
(``z / T``). Statistics that need the whole vocabulary are computed in one pass over chunks of rows; the
full ``[tokens, V]`` float32 softmax is never materialised. ``entropy_rft.fused.fused_logp`` goes one step
further and never materialises the logits at all: it works from the hidden states and the LM-head weight
(re-exported here as ``dynamics.fused_logp`` and ``dynamics.FusedOut``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "BACKENDS",
    "FirstOrderChange",
    "TokenStats",
    "batch_predicted_entropy_change",
    "cov_advantage_s_centered",
    "cov_logp_advantage",
    "default_chunk_rows",
    "exact_entropy_change",
    "first_order_entropy_change",
    "masked_cov",
    "off_policy_factor",
    "predicted_entropy_change",
    "single_logit_entropy_change",
    "token_stats",
]

# Per-chunk working set, in elements, for the row-chunked passes. On CPU a chunk of about 2 MiB of float32
# per temporary stays in cache, which makes the chunked pass faster than torch.logsumexp (which allocates a
# full-size temporary). On an accelerator, larger chunks amortise kernel launches.
_CPU_CHUNK_ELEMS = 1 << 19
_GPU_CHUNK_ELEMS = 1 << 24
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


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def _check_logits_ids(logits: Tensor, token_ids: Tensor, name: str = "logits", check_range: bool = True) -> None:
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
        _check_ids_range(token_ids, logits.shape[-1])


def _check_ids_range(token_ids: Tensor, vocab: int) -> None:
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        lo, hi = int(token_ids.min()), int(token_ids.max())
        raise ValueError(f"token_ids must lie in [0, {vocab - 1}] (V={vocab}), got values in [{lo}, {hi}]")


def default_chunk_rows(rows: int, vocab: int, device: torch.device | str = "cpu") -> int:
    """Rows per chunk for ``token_stats``: a cache-sized working set (CPU) or launch-amortising one (GPU),
    and, for logits over 64 MiB, temporaries of at most ~5% of the logits' size."""
    dev = torch.device(device)
    budget = _GPU_CHUNK_ELEMS if dev.type != "cpu" else _CPU_CHUNK_ELEMS
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
        return _check_temperature(temperature)
    if not temperature.is_floating_point() or tuple(temperature.shape) != tuple(batch_shape):
        raise ValueError(f"a per-row temperature must be a float tensor of shape {tuple(batch_shape)} (the "
                         f"logits without V), got {temperature.dtype} {tuple(temperature.shape)}")
    return temperature.to(device=device, dtype=torch.float32)


def _raise_flags(flags: list[int], token_ids: Tensor, vocab: int) -> None:
    """The Triton kernel's counts of bad ids, temperatures and rows, raised as the torch path raises them."""
    bad_rows, bad_ids, bad_t = flags[0], flags[1], flags[2]
    if bad_ids:
        _check_ids_range(token_ids, vocab)
    if bad_t:
        raise ValueError(f"temperature must be finite and > 0 on every row; {bad_t} row(s) are not")
    if bad_rows:
        raise NonFiniteLogits(
            "logits must have at least one finite entry per row and no NaN or +inf; "
            f"{bad_rows} row(s) violate this"
        )


def _token_stats_triton(logits: Tensor, token_ids: Tensor, temperature: float | Tensor) -> TokenStats:
    """``token_stats`` through ``kernels.stats.row_stats``: one read of the logits, one host sync."""
    from entropy_rft.kernels.stats import row_stats

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
    _check_logits_ids(logits, token_ids, check_range=path == "torch")
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


# ------------------------------------------------------------------------------------- first-order theory


@dataclass(frozen=True)
class FirstOrderChange:
    """What ``first_order_entropy_change`` returns (Thm 3.3, up to the learning-rate factor).

    per_token: dH_t = -(w_t A_t r_t) S_c,t, the inputs' broadcast shape and promoted dtype; 0 off ``mask`` and
               on ``clipped`` tokens (no gradient, no first-order change) when those are given.
    mask:      the valid tokens (None: all), already checked against ``S_c``'s shape.
    weighted:  whether aggregation weights were given (this picks the batch form).
    """

    per_token: Tensor
    mask: Tensor | None
    weighted: bool

    @property
    def batch(self) -> float | None:
        """The batch's first-order dH in float64: sum_t dH_t when weighted (the weights carry the loss's
        normalisation), else the mean of dH_t over the valid tokens. None when no token is valid (a metric
        written as JSON null, never NaN)."""
        valid = torch.ones_like(self.per_token, dtype=torch.bool) if self.mask is None else self.mask
        n = int(valid.sum())
        if n == 0:
            return None
        dh = torch.broadcast_to(self.per_token.to(torch.float64), valid.shape)
        if self.weighted:
            return float(dh.sum())
        return float(dh[valid].sum() / n)


def first_order_entropy_change(
    s_centered: Tensor,
    advantages: Tensor | float,
    *,
    weights: Tensor | float | None = None,
    ratio: Tensor | float | None = None,
    mask: Tensor | None = None,
    clipped: Tensor | None = None,
) -> FirstOrderChange:
    """First-order entropy change of one policy-gradient step, per token and per batch (Paper A, Thm 3.3).

    The surrogate r A log p_k moves token t's logits by alpha_t (e_k - p) with alpha_t = lr w_t r_t A_t, so
    dH_t = -alpha_t S_c,t + O(alpha^2), S_c = S_k - E_p[S] (see the module docstring). The lr factor is left
    out: fold it into ``advantages`` (or pass a whole step size alpha there) to get absolute units.

    s_centered: S_c per token (``TokenStats.s_centered``).
    advantages: A_t (or alpha_t), broadcastable to ``s_centered``.
    weights:    the loss aggregation weights w_t (``loss.agg_weights``); None: unweighted, and the batch form
                is the mean over valid tokens.
    ratio:      the importance ratio r_t (the off-policy factor); None: on-policy, r = 1.
    mask:       valid tokens, shaped like ``s_centered``; None: all. Invalid tokens carry 0 in ``per_token``.
    clipped:    tokens whose gradient is clipped away (e.g. ``loss.ppo_clipped_mask``); they carry 0.

    The arithmetic is dH_t = -(((w_t A_t) r_t) S_c,t) in the inputs' promoted dtype, with no cast: a caller
    that wants float64 passes float64 (or casts ``s_centered``), so each caller keeps its precision.
    """
    alpha = advantages if weights is None else weights * advantages
    if ratio is not None:
        alpha = alpha * ratio
    per_token = -(alpha * s_centered)
    valid = None if mask is None else _valid(mask, s_centered)
    keep = valid
    if clipped is not None:
        unclipped = ~_valid(clipped, s_centered)
        keep = unclipped if keep is None else keep & unclipped
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros_like(per_token))
    return FirstOrderChange(per_token=per_token, mask=valid, weighted=weights is not None)


def predicted_entropy_change(stats: TokenStats, alpha: Tensor | float) -> Tensor:
    """First-order entropy change of a GRPO logit step z -> z + alpha (e_k - p): -alpha S_c (Thm 3.3).

    alpha = lr * r * A per token (broadcast against the stats' shape). ``first_order_entropy_change``.
    """
    return first_order_entropy_change(stats.s_centered, alpha).per_token


def single_logit_entropy_change(stats: TokenStats, eps: Tensor | float) -> Tensor:
    """First-order entropy change of a single-logit update z -> z + eps e_k: -eps S_k (Thm 3.2)."""
    return -eps * stats.s_star


def off_policy_factor(stats: TokenStats, ratio: Tensor | float) -> Tensor:
    """Off-policy discriminator r S_c (Paper A, off-policy form of Thm 3.3; r the importance ratio)."""
    return ratio * stats.s_centered


def _valid(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if tuple(mask.shape) != tuple(like.shape):
        raise ValueError(f"mask must have shape {tuple(like.shape)}, got {tuple(mask.shape)}")
    return mask.to(torch.bool)


def batch_predicted_entropy_change(
    stats: TokenStats, alpha: Tensor | float, mask: Tensor | None = None
) -> float | None:
    """Batch-level first-order change: mean over valid tokens of -alpha_t S_c,t (Thm 3.3, averaged).

    Returns a Python float, or None when there is no valid token (a metric written as JSON null, never NaN).
    ``first_order_entropy_change(...).batch``.
    """
    return first_order_entropy_change(stats.s_centered, alpha, mask=mask).batch


def masked_cov(x: Tensor, y: Tensor, mask: Tensor | None = None) -> float | None:
    """Population covariance (divide by n) of x and y over valid tokens, in float64; None if none valid."""
    if tuple(x.shape) != tuple(y.shape):
        raise ValueError(f"y must have the shape of x, {tuple(x.shape)}, got {tuple(y.shape)}")
    valid = _valid(mask, x)
    n = int(valid.sum())
    if n == 0:
        return None
    xv = x.detach()[valid].to(torch.float64)
    yv = y.detach()[valid].to(torch.float64)
    return float(((xv - xv.mean()) * (yv - yv.mean())).mean())


def cov_logp_advantage(logp: Tensor, advantages: Tensor, mask: Tensor | None = None) -> float | None:
    """Cov(log pi, A) over valid tokens (Paper B: dH ~ -eta Cov(log pi, A) under natural PG)."""
    return masked_cov(logp, advantages, mask)


def cov_advantage_s_centered(advantages: Tensor, s_centered: Tensor, mask: Tensor | None = None) -> float | None:
    """Cov(A, S_c) over valid tokens: with alpha_t = lr A_t, the batch change -lr mean(A S_c) (Thm 3.3) is
    -lr (Cov(A, S_c) + mean(A) mean(S_c)), and mean(S_c) ~ 0 on-policy (Cor. 3.5)."""
    return masked_cov(advantages, s_centered, mask)


# ------------------------------------------------------------------------------------------ exact checker


def _entropy64(z: Tensor) -> tuple[Tensor, Tensor]:
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    return -plogp.sum(-1), p


def exact_entropy_change(
    logits: Tensor,
    k: Tensor | int,
    eps: Tensor | float,
    kind: Literal["single", "grpo"] = "single",
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Apply a logit update to the explicit distribution in float64; return (actual dH, predicted dH).

    With z = logits / temperature and p = softmax(z):
      kind="single": z -> z + eps e_k,        predicted -eps S_k          (Thm 3.2)
      kind="grpo":   z -> z + eps (e_k - p),  predicted -eps (S_k - E_p[S]) (Thm 3.3; eps plays alpha)
    logits [..., V]; k int or [...]; eps float or [...]. Both outputs are float64 with shape [...].
    The actual change minus the prediction is O(eps^2).
    """
    if kind not in ("single", "grpo"):
        raise ValueError(f"kind must be 'single' or 'grpo', got {kind!r}")
    t = _check_temperature(temperature)
    k_t = torch.as_tensor(k, device=logits.device)
    if k_t.dim() == 0:
        k_t = k_t.expand(logits.shape[:-1])
    _check_logits_ids(logits, k_t)
    z = logits.to(torch.float64) / t
    eps_t = torch.as_tensor(eps, dtype=torch.float64, device=z.device)
    h0, p = _entropy64(z)
    onehot = torch.zeros_like(z).scatter_(-1, k_t.long().unsqueeze(-1), 1.0)
    logp = torch.log_softmax(z, dim=-1)
    s_all = torch.where(p > 0, p * (h0.unsqueeze(-1) + logp), torch.zeros_like(p))
    s_k = (s_all * onehot).sum(-1)
    step = onehot if kind == "single" else onehot - p
    z1 = torch.where(torch.isfinite(z), z + eps_t.unsqueeze(-1) * step, z)
    h1, _ = _entropy64(z1)
    pred = -eps_t * s_k if kind == "single" else -eps_t * (s_k - (p * s_all).sum(-1))
    return h1 - h0, pred


def __getattr__(name: str):
    """``dynamics.fused_logp`` and ``dynamics.FusedOut`` live in ``entropy_rft.fused`` (imported lazily: it
    imports this module)."""
    if name in ("fused_logp", "FusedOut"):
        from entropy_rft import fused

        return getattr(fused, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
