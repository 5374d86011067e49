"""The network's exact first-order entropy prediction: a forward-mode JVP along the actual update.

For parameters θ and an update Δθ, the first-order change of token t's entropy is ∇θH_t · Δθ. One
forward pass with forward-mode AD (``torch.func.jvp``) gives it for every token of a batch at once, with no
backward pass and no per-token gradients. The tabular formula of Theorem 3.3 ignores that logits share
parameters; this one does not, so what separates it from the actual change is second order in Δθ.

Forward-mode AD has no rule for PyTorch's fused SDPA attention on CPU (torch 2.13), so the model runs with
eager attention inside :func:`eager_attention` and is switched back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor
from torch.func import functional_call, jvp

from entropy_rft.policy.forward import forward_plan
from entropy_rft.policy.rollout import RolloutBatch, position_ids

CHUNK = 4096  # token rows per logits chunk: the [tokens, V] logits are never all materialised at once


@contextlib.contextmanager
def eager_attention(model):
    """Run ``model`` with eager attention inside the block (forward-mode AD needs it), then restore."""
    cfg = getattr(model, "config", None)
    old = getattr(cfg, "_attn_implementation", None)
    if old in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield model
        return
    model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        model.set_attn_implementation(old)


def _module_name(root: torch.nn.Module, sub: torch.nn.Module) -> str:
    return next(n for n, m in root.named_modules() if m is sub)


def _param_name(root: torch.nn.Module, param: Tensor | None) -> str | None:
    if param is None:
        return None
    return next((n for n, p in root.named_parameters() if p is param), None)


def _chunked_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """Entropy of softmax((hidden @ W.T + b) / T) per row of ``hidden`` [N, D], in chunks of rows."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    out = []
    for h in hidden.split(CHUNK):
        z = h.to(dtype) @ weight.to(dtype).T
        if bias is not None:
            z = z + bias.to(dtype)
        logp = torch.log_softmax(z / temperature, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=dtype)


def entropy_function(model, batch: RolloutBatch, temperature: float) -> Callable[[dict[str, Tensor]], Tensor]:
    """``f(params) -> [B, R]`` entropy of the next-token distribution at each response position of ``batch``
    (at ``temperature``, float32 or wider), with ``params`` a ``named_parameters``-style dict of ``model``."""
    ids, am = batch.input_ids, batch.attention_mask.long()
    pos = position_ids(am)
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    if forward_plan(model).fused:
        dec = model.get_decoder()
        prefix = _module_name(model, dec) + "."
        head = model.get_output_embeddings()
        w_name, b_name = _param_name(model, head.weight), _param_name(model, head.bias)

        def f(params: dict[str, Tensor]) -> Tensor:
            dec_params = {n[len(prefix):]: v for n, v in params.items() if n.startswith(prefix)}
            hidden = functional_call(dec, dec_params, (), {"input_ids": ids, "attention_mask": am,
                                                           "position_ids": pos}).last_hidden_state
            h = hidden[:, p - 1 : p + r - 1]
            weight = params[w_name] if w_name else head.weight
            bias = params[b_name] if b_name else head.bias
            ent = _chunked_entropy(h.reshape(-1, h.shape[-1]), weight, bias, temperature)
            return ent.view(h.shape[0], h.shape[1])

        return f

    def f_logits(params: dict[str, Tensor]) -> Tensor:  # soft-capped or scaled logits: the model's own head
        logits = functional_call(model, params, (), {"input_ids": ids, "attention_mask": am,
                                                     "position_ids": pos}).logits[:, p - 1 : p + r - 1]
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
        return -(logp.exp() * logp).sum(-1)

    return f_logits


def entropy_jvp(model, batch: RolloutBatch, temperature: float, params: dict[str, Tensor],
                tangent: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(H, ∇θH·Δθ) per response position [B, R] at ``params`` along ``tangent`` (same keys), by forward-mode AD.

    ``params`` need not be the model's current parameters; the model's own tensors are not modified.
    """
    f = entropy_function(model, batch, temperature)
    primals = {n: v.detach() for n, v in params.items()}
    tangents = {n: tangent[n].detach().to(v.dtype) for n, v in primals.items()}
    with eager_attention(model), torch.no_grad():
        h, dh = jvp(f, (primals,), (tangents,))
    return h, dh
