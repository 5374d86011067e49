"""Sampling backends behind one small interface.

``sample(model, tokenizer, prompts, ...)`` returns a :class:`RolloutBatch`: left-padded prompts and
right-padded responses with their mask (the EOS token counts as a response token; padding never does).

Backends:

- ``"kv"``: our loop over a KV cache. One model call per generated token, sampling from
  softmax(z / T) with an explicit ``torch.Generator`` (seeded, checkpointable), no logits processors.
- ``"hf"``: ``transformers``' ``generate`` (uses the global torch RNG).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` computes them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def tokenize_prompts(tokenizer, prompts: list[str], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Tokenise and left-pad prompts. Returns (ids [B, P], mask [B, P] bool).

    A ``prompts.ChatPrompt`` is rendered with the tokenizer's chat template when it has one."""
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    from entropy_rft.prompts import encode_prompt  # chat prompts get the tokenizer's chat template

    enc = [encode_prompt(tokenizer, p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), pad, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.bool)
    for i, e in enumerate(enc):
        if e:
            ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
            mask[i, width - len(e):] = True
    return ids.to(device), mask.to(device)


def _top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero the tail outside the smallest set whose mass reaches top_p (nucleus sampling)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    drop = (cum - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


@torch.no_grad()
def sample_kv(model, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, temperature: float,
              top_p: float, eos_id: int, pad_id: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample responses with a KV cache: one forward per new token. Returns (ids [B, R], mask [B, R]).

    ``temperature == 0`` decodes greedily.
    """
    b = prompt_ids.shape[0]
    attn = prompt_mask.long()
    pos = position_ids(attn)
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    logits = out.logits[:, -1, :]
    next_pos = pos[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool, device=prompt_ids.device)
    toks, valid = [], []
    for t in range(max_new_tokens):
        if temperature == 0:  # greedy
            tok = logits.float().argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            if top_p < 1.0:
                probs = _top_p_filter(probs, top_p)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        toks.append(tok)
        valid.append(~done)
        done = done | (tok == eos_id)
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype, device=attn.device)], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos, past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return torch.stack(toks, dim=1), torch.stack(valid, dim=1)


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
    return [
        tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
        for ids, m in zip(response_ids.cpu(), response_mask.cpu())
    ]


def sample(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, backend: str = "kv", generator: torch.Generator | None = None) -> RolloutBatch:
    """Sample one response per prompt (repeat prompts for groups)."""
    device = next(model.parameters()).device
    ids, mask = tokenize_prompts(tokenizer, prompts, device)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer: has no eos_token_id; set one so responses can end")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    was_training = model.training
    model.eval()
    try:
        if backend == "kv":
            r_ids, r_mask = sample_kv(model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, eos_id=eos, pad_id=pad, generator=generator)
        elif backend == "hf":
            r_ids, r_mask = sample_hf(model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, eos_id=eos, pad_id=pad)
        else:
            raise ValueError(f"backend: unknown sampler {backend!r}; valid: 'kv', 'hf'")
    finally:
        model.train(was_training)
    return RolloutBatch(ids, mask, r_ids, r_mask, decode_responses(tokenizer, r_ids, r_mask))
