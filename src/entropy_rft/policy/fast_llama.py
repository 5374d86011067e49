"""Llama-family maths on the model's own weights, without transformers' per-call overhead.

``transformers``' forward costs a few milliseconds of Python per call (mask building, cache objects, output
capturing, kwargs plumbing). For small policies that dominates sampling (one call per generated token)
and is a large share of each training forward. This module runs the same maths with
``torch.nn.functional`` ops directly on the parameters:

    x = embed(ids)
    for each layer:  x += o_proj(attn(rope(q), rope(k), v))   q, k, v from rms_norm(x)
                     x += down(silu(gate(h)) * up(h))          h = rms_norm(x)
    hidden = rms_norm(x)

- :class:`StaticDecoder`: prefill, then one token at a time with every layer's K/V preallocated for
  prompt + max_new_tokens positions (the sampler's ``"static"`` backend). Each distinct prompt is prefilled
  once, and finished rows leave the cache;
- :func:`response_hidden`: the training forward with autograd (the policy forward's fast path). It computes
  only what a policy-gradient step reads: each distinct prompt once (a GRPO group shares it), then the real
  response positions, packed, with no padding after EOS;
- :func:`decoder_hidden`: the plain full-sequence forward with autograd (the fallback for masks that are not
  a prefix per row).

Skipping work never changes a number that is used: the tests compare values and every parameter's gradient
with transformers' own decoder on the full padded rows.

Position ids skip left padding as ``generate`` does; the rotary tables come from the model's own
``rotary_emb`` module. Values match the HF forward to float32 rounding and gradients match too (tested).

Supported: ``llama``, ``mistral`` and ``qwen2`` configs with SiLU MLPs and plain ``nn.Linear`` projections
(no adapters, no quantised layers), within the sliding window if any, with a length-independent RoPE; any
ratio of query to K/V heads (GQA), tied or untied embeddings. SmolLM2-135M (``--model smollm2-135m``: tied
49,152-row embedding, 9 query / 3 K/V heads, RoPE theta 100000) takes both the static decoder and the packed
forward; with tied embeddings the one weight's gradient is the sum of the LM head's (dense: every row gets
softmax mass) and the lookups'. :func:`unsupported_reason` says why a model is not, and callers fall back to
the HF modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the length


def unsupported_reason(model, total_len: int | None = None) -> str | None:
    """None when :func:`decode` can run ``model``; otherwise a short reason (for logs and errors)."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} is not 'silu'"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and total_len is not None and total_len > window:
        return f"sequence of {total_len} tokens exceeds the sliding window {window}"
    try:
        inner, head = model.model, model.lm_head
        layers = list(inner.layers)
        linears = [head] + [m for lay in layers for m in (lay.self_attn.q_proj, lay.self_attn.k_proj,
                                                         lay.self_attn.v_proj, lay.self_attn.o_proj,
                                                         lay.mlp.gate_proj, lay.mlp.up_proj, lay.mlp.down_proj)]
        norms = [inner.norm] + [n for lay in layers for n in (lay.input_layernorm, lay.post_attention_layernorm)]
        extra = [n for lay in layers for n in ("q_norm", "k_norm") if hasattr(lay.self_attn, n)]
    except AttributeError as e:
        return f"unexpected module layout ({e})"
    if any(type(m) is not nn.Linear for m in linears):
        return "a projection is not a plain nn.Linear (adapter or quantised layer)"
    if any(not hasattr(n, "variance_epsilon") for n in norms) or extra:
        return "unexpected normalisation layers"
    rope = str(getattr(getattr(inner, "rotary_emb", None), "rope_type", "default"))
    if rope not in STATIC_ROPE_TYPES:
        return f"rope_type {rope!r} depends on the sequence length (supported: {STATIC_ROPE_TYPES})"
    if type(inner.embed_tokens) is not nn.Embedding:
        return "the input embedding is not a plain nn.Embedding"
    return None


class _Weights(NamedTuple):
    """One decoder layer's parameters, with q/k/v and gate/up concatenated (one matmul each)."""

    norm1: Tensor
    eps1: float
    qkv_w: Tensor
    qkv_b: Tensor | None
    splits: tuple[int, int, int]
    o_w: Tensor
    o_b: Tensor | None
    norm2: Tensor
    eps2: float
    gu_w: Tensor
    gu_b: Tensor | None
    down_w: Tensor
    down_b: Tensor | None
    scale: float


def _cat_bias(*lins: nn.Linear) -> Tensor | None:
    if all(lin.bias is None for lin in lins):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in lins])


def _layer_weights(layer: nn.Module) -> _Weights:
    a, m = layer.self_attn, layer.mlp
    return _Weights(
        layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
        torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), _cat_bias(a.q_proj, a.k_proj, a.v_proj),
        (a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features),
        a.o_proj.weight, a.o_proj.bias,
        layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
        torch.cat([m.gate_proj.weight, m.up_proj.weight]), _cat_bias(m.gate_proj, m.up_proj),
        m.down_proj.weight, m.down_proj.bias, float(a.scaling))


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Llama computes it: statistics in float32, weight applied in the input dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


#: Query x key positions up to which attention runs as plain matmuls on CPU (above it, and on GPUs, SDPA's
#: fused kernels, which never hold the [T, L] scores of every head at once).
SMALL_ATTENTION = 64 * 64


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q·kᵀ·scale, masked)·v (differentiable).

    q [B, H, T, D]; k/v [B, Hkv, L, D]; mask [B, 1, T, L], boolean (True = visible) or additive (0 / -inf).
    For one query position, or short sequences on CPU (T·L <= :data:`SMALL_ATTENTION`, a rollout batch's
    usual case), plain matmuls and a float32 softmax: there they beat SDPA's CPU kernel (without gradients by
    1.4-2.6x, with them by up to 1.1x: its per-call cost dominates). Otherwise SDPA. The choice depends on
    shapes and device only, never on whether gradients flow, so the no-grad old-policy pass and the
    differentiated forward of the same batch stay bit-identical."""
    b, h, t, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    if t > 1 and (q.device.type != "cpu" or t * n_k > SMALL_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h)
    s = torch.matmul(q.reshape(b, hkv, (h // hkv) * t, d), k.transpose(-1, -2)).mul_(scale)
    s = s.view(b, hkv, h // hkv, t, -1)
    m = mask[:, :, None]
    s = s.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else s.add_(m)
    w = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype).view(b, hkv, (h // hkv) * t, -1)
    return torch.matmul(w, v).view(b, h, t, d)


def _heads(t: Tensor, hd: int) -> Tensor:
    """[B, T, H*D] -> [B, H, T, D]."""
    return t.view(t.shape[0], t.shape[1], -1, hd).transpose(1, 2)


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return t * cos + _rotate_half(t) * sin


def _qkv(w: _Weights, x: Tensor) -> Tensor:
    """The fused q/k/v projection of rms_norm(x), on any leading shape."""
    return F.linear(_rms_norm(x, w.norm1, w.eps1), w.qkv_w, w.qkv_b)


def _finish(w: _Weights, x: Tensor, o: Tensor) -> Tensor:
    """The rest of a layer after attention: x + o_proj(o), then the SiLU MLP's residual (any leading shape)."""
    x = x + F.linear(o, w.o_w, w.o_b)
    gate, up = F.linear(_rms_norm(x, w.norm2, w.eps2), w.gu_w, w.gu_b).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.down_w, w.down_b)


def _layer(w: _Weights, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
           cache: tuple[Tensor, Tensor] | None = None, start: int | Tensor = 0) -> Tensor:
    """One decoder layer on T positions.

    With ``cache`` (static K/V buffers [B, Hkv, L, D]) the new K/V are written at ``start`` (an int, or a
    long tensor of the T slots, for a step whose position lives on the device) and attention
    runs over the whole buffer; without it, over the T positions themselves. ``mask`` is boolean
    [B, 1, T, L] (prefill, full sequence) or, for a single cached position, an additive bias [B, 1, 1, L]."""
    b, t, _ = x.shape
    hd = cos.shape[-1]
    q, k, v = (_heads(z, hd) for z in _qkv(w, x).split(w.splits, dim=-1))
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if cache is not None:
        if isinstance(start, Tensor):  # a position held on the device: no host value, capturable in a graph
            cache[0].index_copy_(2, start, k)
            cache[1].index_copy_(2, start, v)
        else:
            cache[0][:, :, start:start + t] = k
            cache[1][:, :, start:start + t] = v
        k, v = cache
    o = _attend(q, k, v, mask, w.scale)
    return _finish(w, x, o.transpose(1, 2).reshape(b, t, -1))


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _cache_keys(prompt_mask: Tensor, total: int) -> Tensor:
    """Keys a query may see in a cache of ``total`` positions: the prompt's real tokens and every response
    position (causality hides the future)."""
    keys = torch.ones(prompt_mask.shape[0], total, dtype=torch.bool, device=prompt_mask.device)
    keys[:, :prompt_mask.shape[1]] = prompt_mask
    return keys


def _padded_causal_mask(key_ok: Tensor, n_query: int) -> Tensor:
    """Boolean [B, 1, T, L]: query i (the first T positions) sees keys j <= i that are real tokens.

    A left-padding query sees no real key; it may see itself, so its (unused) row stays finite."""
    dev = key_ok.device
    q_idx = torch.arange(n_query, device=dev)[:, None]
    k_idx = torch.arange(key_ok.shape[1], device=dev)[None, :]
    mask = ((k_idx <= q_idx)[None] & key_ok[:, None, :]) | (k_idx == q_idx)[None]
    return mask[:, None]


def _autocast_dtype(model, device: torch.device) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return model.model.embed_tokens.weight.dtype


def _embed(model, ids: Tensor, dtype: torch.dtype) -> Tensor:
    emb = model.model.embed_tokens  # padding_idx: that row gets no gradient from lookups, as nn.Embedding does
    return F.embedding(ids, emb.weight, padding_idx=emb.padding_idx).to(dtype)


def _rope_tables(model, n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [n, D] for positions 0..n-1, from the model's own rotary module."""
    probe = torch.zeros(1, 1, 1, dtype=dtype, device=device)
    cos, sin = model.model.rotary_emb(probe, torch.arange(n, device=device)[None])
    return cos[0], sin[0]


def decoder_hidden(model, input_ids: Tensor, attention_mask: Tensor, *, check: bool = True) -> Tensor:
    """The decoder's final hidden states [B, S, D] (after the last norm), differentiable in the parameters.

    Same result as ``model.get_decoder()(input_ids, attention_mask, position_ids)`` for left-padded rows
    (position ids skip the padding). Raises ValueError for an unsupported model; ``check=False`` skips that
    module walk for callers that have just made it (the policy forward, once per call)."""
    reason = unsupported_reason(model) if check else None
    if reason is not None:
        raise ValueError(f"fast llama: {reason}")
    key_ok = attention_mask.bool()
    pos = position_ids(key_ok)
    dtype = _autocast_dtype(model, input_ids.device)
    x = _embed(model, input_ids, dtype)
    cos, sin = _rope_tables(model, input_ids.shape[1], dtype, input_ids.device)
    cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    mask = _padded_causal_mask(key_ok, input_ids.shape[1])
    for layer in model.model.layers:
        x = _layer(_layer_weights(layer), x, cos, sin, mask)
    norm = model.model.norm
    return _rms_norm(x, norm.weight, norm.variance_epsilon)


def is_prefix_mask(mask: Tensor) -> bool:
    """Whether each row of a [B, R] boolean mask is True for a prefix and False after it (tokens up to EOS)."""
    n = mask.sum(-1, keepdim=True)
    return bool(torch.equal(mask.bool(), torch.arange(mask.shape[-1], device=mask.device) < n))


class PackedHidden(NamedTuple):
    """Final hidden states for the valid response tokens only, in row-major order."""

    hidden: Tensor  # [N, D]: the state that predicts response token (rows[i], cols[i])
    rows: Tensor  # [N] long
    cols: Tensor  # [N] long


def _group_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct prompts of a batch (a GRPO group repeats one G times): (ids [U, P], mask [U, P], inverse [B])."""
    key = prompt_ids.masked_fill(~prompt_mask, -1)
    _, inv = torch.unique(key, dim=0, return_inverse=True)
    n_u = int(inv.max()) + 1
    first = torch.full((n_u,), prompt_ids.shape[0], dtype=torch.long, device=inv.device)
    first = first.scatter_reduce(0, inv, torch.arange(inv.shape[0], device=inv.device), "amin")
    return prompt_ids[first], prompt_mask[first], inv


def _repeat_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[index]`` along dim 0 (a prompt's K/V repeated for each row of its GRPO group), with a gradient that
    does not depend on thread scheduling.

    The backward of a row gather sums the copies of each row, and that sum's order must be fixed for a seed
    to give the same numbers twice. Advanced indexing sums them with ``index_put_(accumulate=True)``; on CPU
    that runs in parallel (from 32768 elements on, at 2+ threads) with atomic adds, in whatever order the
    threads reach a row: two runs of one seed differ in the last bits at their first update, and then
    everywhere. ``index_select``'s backward (``index_add_``) sums them in a fixed order on CPU at any thread
    count (and is no slower); on CUDA it uses atomics while indexing's backward sorts, so there the indexing
    stays. The values are the same copies either way."""
    return x.index_select(0, index) if x.device.type == "cpu" else x[index]


def response_hidden(model, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                    *, check: bool = True) -> PackedHidden:
    """The hidden states that predict each valid response token, computing no position twice and no padding.

    The same numbers as :func:`decoder_hidden` on the concatenated rows (to float rounding; gradients too), but:

    - each distinct prompt runs once, however many rows repeat it (a GRPO group of G rows shares its
      prompt's K/V, and the prompt's gradient is the sum over the group, in a fixed order whatever the
      thread count: :func:`_repeat_rows`);
    - the position-wise work (norms, projections, MLP) runs on the real response positions only, packed as
      [N, D]; only attention sees them padded, as [B, R', ...], next to their prompt's K/V;
    - positions after a row's last needed one (EOS and the padding behind it) are never computed.

    ``response_mask`` must be a prefix mask per row (:func:`is_prefix_mask`); left-padded prompts. Raises
    ValueError otherwise, or for an unsupported model (``check=False`` skips that walk)."""
    reason = unsupported_reason(model) if check else None
    if reason is not None:
        raise ValueError(f"fast llama: {reason}")
    if not is_prefix_mask(response_mask):
        raise ValueError("fast llama: response_mask must be True for a prefix of each row (tokens up to EOS)")
    p_ids, p_mask, inv = _group_prompts(prompt_ids, prompt_mask.bool())
    n_u, p = p_ids.shape
    b = response_ids.shape[0]
    dev = prompt_ids.device
    dtype = _autocast_dtype(model, dev)
    # Response position j feeds the prediction of token j+1: needed while j+1 is a valid token.
    n_need = (response_mask.sum(-1) - 1).clamp(min=0)
    r = int(n_need.max())
    need = torch.arange(r, device=dev) < n_need[:, None]  # [B, R']
    flat = need.reshape(-1).nonzero().squeeze(-1)  # row-major, as the packed residual stream
    resp_in = response_ids[:, :r].reshape(-1)[flat]
    x = torch.cat([_embed(model, p_ids, dtype).reshape(n_u * p, -1), _embed(model, resp_in, dtype)])

    plen = p_mask.long().sum(-1)
    cos, sin = _rope_tables(model, p + r, dtype, dev)
    pos_p = position_ids(p_mask)
    pos_r = plen[inv][:, None] + torch.arange(r, device=dev)
    pos = torch.cat([pos_p.reshape(-1), pos_r.reshape(-1)[flat]])  # every packed row's position
    cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # [M, 1, D]
    mask_p = _padded_causal_mask(p_mask, p)
    causal = torch.ones(r, r, dtype=torch.bool, device=dev).tril()
    mask_r = torch.cat([p_mask[inv][:, None, :].expand(b, r, p), causal.expand(b, r, r)], -1)[:, None]
    hd = cos.shape[-1]
    n_p, m = n_u * p, x.shape[0]
    for layer in model.model.layers:
        w = _layer_weights(layer)
        nq, nk, _ = w.splits
        qkv = _qkv(w, x)
        qk = _rope(qkv[:, :nq + nk].view(m, -1, hd), cos, sin).view(m, nq + nk)  # q and k of every row at once
        v = qkv[:, nq + nk:]
        qp, kp = (_heads(z, hd) for z in qk[:n_p].view(n_u, p, -1).split((nq, nk), dim=-1))
        vp = _heads(v[:n_p].view(n_u, p, -1), hd)
        o = [_attend(qp, kp, vp, mask_p, w.scale).transpose(1, 2).reshape(n_p, -1)]
        if r:  # response rows, padded to [B, R'] for attention over their prompt's K/V and their own
            pad = lambda z: z.new_zeros(b * r, z.shape[-1]).index_copy(0, flat, z[n_p:]).view(b, r, -1)  # noqa: E731
            qr, kr = (_heads(z, hd) for z in pad(qk).split((nq, nk), dim=-1))
            vr = _heads(pad(v), hd)
            k_all = torch.cat([_repeat_rows(kp, inv), kr], dim=2)  # each row's copy of its prompt's K/V, then its own
            v_all = torch.cat([_repeat_rows(vp, inv), vr], dim=2)
            o_r = _attend(qr, k_all, v_all, mask_r, w.scale)
            o.append(o_r.transpose(1, 2).reshape(b * r, -1).index_select(0, flat))
        x = _finish(w, x, torch.cat(o))
    norm = model.model.norm
    x = _rms_norm(x, norm.weight, norm.variance_epsilon)
    rows, cols = response_mask.nonzero(as_tuple=True)
    src = inv[rows] * p + (p - 1)  # token 0 is predicted by its prompt's last position
    later = cols > 0
    src[later] = n_p + torch.arange(int(later.sum()), device=dev)  # token j > 0 by response position j - 1
    return PackedHidden(x.index_select(0, src), rows, cols)  # index_select: a fixed-order backward on CPU


class StaticDecoder:
    """Prefill a left-padded prompt batch, then extend it one token at a time, returning next-token logits.

    ``prefill()`` and each ``step(tokens)`` return logits ``[B, V]`` for the next position.

    Work is only spent where it changes a result: the prefill runs each distinct prompt once (a GRPO group
    repeats one G times) and copies its K/V to the group's rows; ``step(tokens, done)`` drops the rows that
    have finished from the cache once at most ``compact_below`` of the rows it holds are still going (their
    logits are then returned as 0, i.e. uniform: the sampler overwrites those rows' tokens anyway).

    The step itself is :meth:`extend`: every input is a tensor (the step number too), nothing is read back
    to the host and no shape depends on a value, so one step can be captured in a CUDA graph and replayed
    (:mod:`entropy_rft.policy.graph_decode`); :meth:`step` is the eager wrapper that keeps the position on the host.
    :meth:`keep` swaps in a subset of the rows (fresh tensors: a captured graph keeps reading the old ones).
    """

    def __init__(self, model, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int,
                 compact_below: float = 0.75):
        reason = unsupported_reason(model, prompt_ids.shape[1] + max_new_tokens)
        if reason is not None:
            raise ValueError(f"fast decode: {reason}; use the 'kv' sampler backend")
        self.model = model
        self.weights = [_layer_weights(lay) for lay in model.model.layers]
        b, p = prompt_ids.shape
        self.total = total = p + max_new_tokens
        dev = prompt_ids.device
        self.dtype = _autocast_dtype(model, dev)
        self.ids, self.mask, self.p = prompt_ids, prompt_mask.bool(), p
        self.key_ok = _cache_keys(self.mask, total)
        self.pos_last = position_ids(self.mask)[:, -1:]  # [B, 1]: the last prompt token's position
        self.slots = torch.arange(total, device=dev)
        self.cos, self.sin = _rope_tables(model, total, self.dtype, dev)
        self.rows = torch.arange(b, device=dev)  # the original rows the cache holds, in cache order
        self.compact_below = compact_below
        self.cache: list[tuple[Tensor, Tensor]] = []
        self.t = 0

    def _run(self, ids: Tensor, pos: Tensor, mask: Tensor, start: int | Tensor,
             cache: list[tuple[Tensor, Tensor]]) -> Tensor:
        x = _embed(self.model, ids, self.dtype)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        for w, kv in zip(self.weights, cache):
            x = _layer(w, x, cos, sin, mask, kv, start)
        norm, head = self.model.model.norm, self.model.lm_head
        return F.linear(_rms_norm(x[:, -1], norm.weight, norm.variance_epsilon), head.weight, head.bias)

    def prefill(self) -> Tensor:
        u_ids, u_mask, inv = _group_prompts(self.ids, self.mask)
        attn = self.model.model.layers[0].self_attn
        shape = (u_ids.shape[0], attn.k_proj.out_features // attn.head_dim, self.total, attn.head_dim)
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=u_ids.device),
                       torch.zeros(shape, dtype=self.dtype, device=u_ids.device)) for _ in self.weights]
        logits = self._run(u_ids, position_ids(u_mask), _padded_causal_mask(_cache_keys(u_mask, self.total), self.p),
                           0, self.cache)
        self.cache = [(k[inv], v[inv]) for k, v in self.cache]
        return logits[inv]

    def keep(self, slots: Tensor) -> None:
        """Hold only the cache slots ``slots`` (indices into the rows held now, in their new order)."""
        self.cache = [(k[slots], v[slots]) for k, v in self.cache]
        self.key_ok, self.pos_last, self.rows = self.key_ok[slots], self.pos_last[slots], self.rows[slots]

    def _compact(self, done: Tensor) -> None:
        going = ~done[self.rows]
        n = int(going.sum())
        if 0 < n <= self.compact_below * self.rows.shape[0]:
            self.keep(going.nonzero().squeeze(-1))

    def extend(self, tokens: Tensor, step: Tensor) -> Tensor:
        """Logits [b, V] of the held rows after appending their ``tokens`` [b] as response token ``step`` - 1
        (``step``: a long tensor [1], >= 1; the token goes to cache slot P + step - 1).

        Reads no value back to the host and allocates nothing whose shape depends on a value: capturable."""
        at = step + (self.p - 1)
        visible = self.slots <= at
        bias = torch.zeros(self.key_ok.shape, dtype=self.dtype, device=tokens.device)
        bias = bias.masked_fill(~(self.key_ok & visible), float("-inf"))[:, None, None, :]
        return self._run(tokens[:, None], self.pos_last + step, bias, at, self.cache)

    def step(self, tokens: Tensor, done: Tensor | None = None) -> Tensor:
        """Logits [B, V] after appending ``tokens`` [B]; ``done`` [B] marks rows whose logits are not needed."""
        at = self.p + self.t
        if at >= self.total:
            raise ValueError(f"fast decode: cache holds {self.total} positions; cannot extend past it")
        if done is not None:
            self._compact(done)
        self.t += 1
        full = self.rows.shape[0] == tokens.shape[0]
        step = torch.full((1,), self.t, dtype=torch.long, device=tokens.device)
        logits = self.extend(tokens if full else tokens[self.rows], step)
        if full:
            return logits
        return logits.new_zeros(tokens.shape[0], logits.shape[-1]).index_copy(0, self.rows, logits)
