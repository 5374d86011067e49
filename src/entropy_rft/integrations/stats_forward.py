"""Our statistics from an engine's policy forward, on a Hugging Face causal LM fed the ids-and-mask inputs an
engine's trainer hands the model (TRL's ``GRPOTrainer``) rather than the native trainer's ``RolloutBatch``
(``entropy_rft.policy.forward``); the maths is the same (``fused.fused_logp``).

- ``captured_hidden`` + ``stats_from_hidden``: TokenStats from the backbone pass the engine runs anyway (TRL's
  own forward keeps its log-probs and precision; the statistics cost one more LM-head pass without grad).
- ``fused_policy_out`` / ``chunked_policy_out``: a forward of our own (log-probs and entropy with grad,
  TokenStats without), for models whose logits are not ``hidden @ W.T`` and for benchmarks.
- ``map_stats``: field-by-field operations on TokenStats (concatenating chunks, gathering over ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from entropy_rft.core import dynamics, fused
from entropy_rft.core.dynamics import TokenStats
from entropy_rft.policy.forward import supports_fused

__all__ = ["backbone_of", "captured_hidden", "chunked_policy_out", "fused_policy_out", "map_stats",
           "stats_from_hidden"]


def map_stats(fn: Callable[..., Tensor], *stats: TokenStats) -> TokenStats:
    """``fn`` applied field by field to one or more TokenStats (``map_stats(lambda *x: torch.cat(x), *parts)``
    concatenates them)."""
    return TokenStats(**{f.name: fn(*(getattr(s, f.name) for s in stats)) for f in dataclasses.fields(TokenStats)})


def fused_policy_out(model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, temperature: float,
                     with_entropy: bool = False) -> fused.FusedOut:
    """Log-probs (grad), optional entropy (grad) and TokenStats of the last ``logits_to_keep`` tokens.

    The backbone runs exactly as TRL's fused head runs it (input ids and attention mask, no position ids),
    then ``fused.fused_logp`` works in token chunks from the hidden states and the LM-head weight, never
    materialising the ``[tokens, V]`` logits. Models whose logits are not ``hidden @ W.T`` (soft-capping,
    logit scales) take the materialised path.
    """
    targets = input_ids[:, -logits_to_keep:]
    if supports_fused(model):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state[:, -logits_to_keep - 1 : -1]
        head = model.get_output_embeddings()
        return fused.fused_logp(hidden, head.weight, targets, temperature, bias=head.bias,
                                   with_entropy=with_entropy)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1 : -1]
    stats = dynamics.token_stats(logits.detach(), targets, temperature)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1) if with_entropy else None
    return fused.FusedOut(logp, entropy, stats)


def backbone_of(model):
    """The module whose ``last_hidden_state`` feeds the LM head: ``model.base_model`` of a Hugging Face causal
    LM, looked up through a PEFT wrapper (``get_base_model``) as TRL's fused head looks it up."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    return core.base_model


@contextlib.contextmanager
def captured_hidden(model) -> Iterator[list[Tensor]]:
    """Inside the block, every forward of ``model``'s backbone (``backbone_of``) appends its
    ``last_hidden_state`` (detached) to the yielded list; the hook is removed on exit.

    Lets an engine run its own forward (TRL's fused head, at TRL's precision) and compute our statistics from
    the same backbone pass, with no second forward."""
    seen: list[Tensor] = []

    def hook(_module, _args, output) -> None:
        seen.append(output.last_hidden_state.detach())

    handle = backbone_of(model).register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def stats_from_hidden(model, hidden: Tensor, input_ids: Tensor, logits_to_keep: int,
                      temperature: float) -> TokenStats:
    """TokenStats (no grad) of the last ``logits_to_keep`` tokens of ``input_ids`` [B, L], from the backbone's
    hidden states [B, L, D] (``captured_hidden``) and ``model``'s LM head (``fused.fused_logp``, the head
    in the weight's dtype; ``forward.supports_fused(model)`` must hold)."""
    head = model.get_output_embeddings()
    h = hidden[:, -logits_to_keep - 1 : -1].to(head.weight.dtype)
    with torch.no_grad():
        return fused.fused_logp(h, head.weight, input_ids[:, -logits_to_keep:], temperature,
                                   bias=head.bias).stats


def chunked_policy_out(model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, temperature: float,
                       with_entropy: bool = False, batch_size: int | None = None,
                       autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> fused.FusedOut:
    """``fused_policy_out`` in row chunks of ``batch_size``, each under ``autocast()``, concatenated."""
    bs = batch_size or input_ids.shape[0]
    outs = []
    for i in range(0, input_ids.shape[0], bs):
        with autocast():
            outs.append(fused_policy_out(model, input_ids[i : i + bs], attention_mask[i : i + bs], logits_to_keep,
                                         temperature, with_entropy))
    stats = map_stats(lambda *x: torch.cat(x), *(o.stats for o in outs))
    entropy = torch.cat([o.entropy for o in outs]) if with_entropy else None
    return fused.FusedOut(torch.cat([o.logp for o in outs]), entropy, stats)
