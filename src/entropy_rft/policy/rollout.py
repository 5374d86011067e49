"""Sampling backends behind one small interface.

``sample(model, tokenizer, prompts, ...)`` returns a :class:`RolloutBatch`: left-padded prompts and
right-padded responses with their mask (the EOS token counts as a response token; padding never does).

Backends:

- ``"static"``: the Llama-family decode loop of :mod:`entropy_rft.policy.fast_llama` (the model's weights, a static
  KV cache, no transformers call per token), sampling from softmax(z / T) with an explicit
  ``torch.Generator`` (seeded, checkpointable), no logits processors; its loop is
  :mod:`entropy_rft.policy.graph_decode` (graph-ready; ``cuda_graphs=True`` replays each step as a CUDA graph).
- ``"kv"``: the same loop over the HF model's own KV cache, one HF forward per token: any causal LM.
- ``"auto"``: ``"static"`` when the model supports it, else ``"kv"``.
- ``"hf"``: ``transformers``' ``generate`` (uses the global torch RNG).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from entropy_rft.common.options import ROLLOUT_BACKENDS as BACKENDS
from entropy_rft.policy.fast_llama import StaticDecoder, position_ids, unsupported_reason
from entropy_rft.policy.graph_decode import decode as decode_static
from entropy_rft.policy.graph_decode import top_p_filter


@dataclass
class RolloutBatch:
    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] bool
    response_ids: Tensor  # [B, R] right-padded
    response_mask: Tensor  # [B, R] bool: generated tokens up to and including EOS
    responses: list[str]  # decoded responses, special tokens removed

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def select(self, idx: Tensor | list[int]) -> RolloutBatch:
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        return RolloutBatch(self.prompt_ids[idx_t], self.prompt_mask[idx_t], self.response_ids[idx_t],
                            self.response_mask[idx_t], [self.responses[i] for i in idx_t.tolist()])


def pad_token(tokenizer) -> int:
    """The id padding takes: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def pad_columns(t: Tensor, width: int, value: int | bool, left: bool = False) -> Tensor:
    """``t`` [B, W] widened to ``width`` columns of ``value``, on the left (prompts) or the right (responses)."""
    pad = t.new_full((t.shape[0], width - t.shape[1]), value)
    return torch.cat([pad, t] if left else [t, pad], 1)


def concat_batches(first: RolloutBatch, second: RolloutBatch, pad_id: int) -> RolloutBatch:
    """``first``'s rows then ``second``'s, prompts left-padded and responses right-padded with ``pad_id`` (masked
    out) to the wider of the two."""
    p = max(first.prompt_ids.shape[1], second.prompt_ids.shape[1])
    r = max(first.response_ids.shape[1], second.response_ids.shape[1])

    def both(name: str, width: int, value: int | bool, left: bool) -> Tensor:
        return torch.cat([pad_columns(getattr(b, name), width, value, left) for b in (first, second)])

    return RolloutBatch(both("prompt_ids", p, pad_id, True), both("prompt_mask", p, False, True),
                        both("response_ids", r, pad_id, False), both("response_mask", r, False, False),
                        first.responses + second.responses)


def tokenize_prompts(tokenizer, prompts: list[str], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Tokenise and left-pad prompts. Returns (ids [B, P], mask [B, P] bool).

    A ``prompts.ChatPrompt`` is rendered with the tokenizer's chat template when it has one."""
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    from entropy_rft.tasks.prompts import encode_prompt  # chat prompts get the tokenizer's chat template

    memo: dict[tuple, list[int]] = {}  # a group repeats each prompt G times: encode it once
    enc = []
    for p in prompts:
        key = (type(p), str(p), getattr(p, "system", None))
        if key not in memo:
            memo[key] = encode_prompt(tokenizer, p)
        enc.append(memo[key])
    pad = pad_token(tokenizer)
    width = max(len(e) for e in enc)
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc], dtype=torch.long)
    mask = torch.tensor([[False] * (width - len(e)) + [True] * len(e) for e in enc], dtype=torch.bool)
    return ids.to(device), mask.to(device)


def next_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    """One token per row from softmax(z / T) (nucleus-filtered when top_p < 1); greedy at T = 0."""
    if temperature == 0:
        return logits.float().argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _decode(first_logits: Tensor, extend, *, max_new_tokens: int, temperature: float, top_p: float, eos_id: int,
            pad_id: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """The sampling loop shared by the KV backends: ``extend(tokens, done)`` returns the next position's logits
    (a backend may skip the rows in ``done``: whatever it returns there is overwritten).

    Rows that emitted EOS keep receiving ``pad_id`` (masked out); the loop stops when every row is done. Each
    draw takes the same random numbers for every row whatever its logits, so skipping rows changes no token."""
    logits = first_logits
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    toks, valid = [], []
    for t in range(max_new_tokens):
        tok = next_token(logits, temperature, top_p, generator)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        toks.append(tok)
        valid.append(~done)
        done = done | (tok == eos_id)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        logits = extend(tok, done)
    return torch.stack(toks, dim=1), torch.stack(valid, dim=1)


@torch.no_grad()
def sample_kv(model, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, temperature: float,
              top_p: float, eos_id: int, pad_id: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample responses with the model's own KV cache: one HF forward per new token.

    Returns (ids [B, R], mask [B, R]); ``temperature == 0`` decodes greedily. Works for any causal LM.
    """
    b = prompt_ids.shape[0]
    attn = prompt_mask.long()
    pos = position_ids(attn)
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    state = {"past": out.past_key_values, "attn": attn, "pos": pos[:, -1:]}

    def extend(tok: Tensor, _done: Tensor) -> Tensor:
        state["attn"] = torch.cat([state["attn"], state["attn"].new_ones((b, 1))], dim=1)
        state["pos"] = state["pos"] + 1
        o = model(input_ids=tok[:, None], attention_mask=state["attn"], position_ids=state["pos"],
                  past_key_values=state["past"], use_cache=True)
        state["past"] = o.past_key_values
        return o.logits[:, -1, :]

    return _decode(out.logits[:, -1, :], extend, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, eos_id=eos_id, pad_id=pad_id, generator=generator)


@torch.no_grad()
def sample_static(model, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, temperature: float,
                  top_p: float, eos_id: int, pad_id: int, generator: torch.Generator | None,
                  cuda_graphs: bool = False, check_every: int = 8) -> tuple[Tensor, Tensor]:
    """Sample with :class:`entropy_rft.policy.fast_llama.StaticDecoder` (Llama family) through
    :func:`entropy_rft.policy.graph_decode.decode`: the same tokens and RNG use as :func:`sample_kv`, without
    transformers' per-call overhead.

    ``cuda_graphs``: the GPU loop (:mod:`entropy_rft.policy.graph_decode`): ``done`` read every ``check_every``
    steps, finished rows dropped at power-of-two batch sizes, each step a CUDA-graph replay on CUDA (on any
    other device the same loop runs eagerly)."""
    dec = StaticDecoder(model, prompt_ids, prompt_mask, max_new_tokens)
    graphs = cuda_graphs and prompt_ids.device.type == "cuda"
    return decode_static(dec, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos_id=eos_id,
                         pad_id=pad_id, generator=generator, check_every=check_every if cuda_graphs else 1,
                         buckets=cuda_graphs, cuda_graph=graphs)


@torch.no_grad()
def sample_hf(model, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, temperature: float,
              top_p: float, eos_id: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Sample with ``model.generate`` (global torch RNG). Returns (ids [B, R], mask [B, R])."""
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), do_sample=True,
                         temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
                         eos_token_id=eos_id, pad_token_id=pad_id)
    resp = out[:, prompt_ids.shape[1]:]
    is_eos = resp == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return resp, ~after_eos


def decode_responses(tokenizer, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    rows = [[t for t, keep in zip(ids, m) if keep] for ids, m in zip(response_ids.tolist(), response_mask.tolist())]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def sample(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, backend: str = "auto", generator: torch.Generator | None = None,
           cuda_graphs: bool = False, check_every: int = 8) -> RolloutBatch:
    """Sample one response per prompt (repeat prompts for groups). ``cuda_graphs`` and ``check_every``: the
    static backend's GPU loop (:func:`sample_static`); the other backends ignore them."""
    device = next(model.parameters()).device
    ids, mask = tokenize_prompts(tokenizer, prompts, device)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer: has no eos_token_id; set one so responses can end")
    pad = pad_token(tokenizer)
    was_training = model.training
    model.eval()
    try:
        if backend == "auto":
            backend = "static" if unsupported_reason(model, ids.shape[1] + max_new_tokens) is None else "kv"
        if backend == "static":
            r_ids, r_mask = sample_static(model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_p=top_p, eos_id=eos, pad_id=pad, generator=generator,
                                          cuda_graphs=cuda_graphs, check_every=check_every)
        elif backend == "kv":
            r_ids, r_mask = sample_kv(model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, eos_id=eos, pad_id=pad, generator=generator)
        elif backend == "hf":
            r_ids, r_mask = sample_hf(model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, eos_id=eos, pad_id=pad)
        else:
            raise ValueError(f"backend: unknown sampler {backend!r}; valid: {', '.join(map(repr, BACKENDS))}")
    finally:
        model.train(was_training)
    return RolloutBatch(ids, mask, r_ids, r_mask, decode_responses(tokenizer, r_ids, r_mask))
