"""The policy forward: response-token log-probs (with grad) and TokenStats (without) for a rollout batch.

Two paths give the same numbers:

- fused (default): decoder hidden states and the LM-head weight go to ``dynamics.fused_logp``, which
  works in token chunks and never materialises the [tokens, V] logits;
- materialised: the model's logits, then ``dynamics.token_stats`` and a log-softmax gather. Used for
  models whose logits are not a plain ``hidden @ W.T`` (soft-capping, logit scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from entropy_rft.dynamics import TokenStats, fused_logp, token_stats
from entropy_rft.rollout import RolloutBatch, position_ids

# Config attributes that make logits differ from hidden @ W.T; such models use the materialised path.
_NONPLAIN_LOGITS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


@dataclass
class PolicyOut:
    logp: Tensor  # [B, R] log-prob of each response token (grad when enabled)
    entropy: Tensor | None  # [B, R] entropy with grad, when requested (entropy bonus)
    stats: TokenStats  # [B, R] float32, no grad
    hidden: Tensor  # [B, R, D] hidden state that predicts each response token (for a value head)


def supports_fused(model) -> bool:
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, a, None) not in (None, 1.0) for a in _NONPLAIN_LOGITS):
        return False
    head = model.get_output_embeddings()
    return head is not None and isinstance(head, torch.nn.Linear)


def _decoder_hidden(model, batch: RolloutBatch) -> Tensor:
    ids, am = batch.input_ids, batch.attention_mask.long()
    out = model.get_decoder()(input_ids=ids, attention_mask=am, position_ids=position_ids(am))
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    return out.last_hidden_state[:, p - 1 : p + r - 1]


def policy_forward(model, batch: RolloutBatch, temperature: float, *, with_entropy: bool = False,
                   fused: bool = True) -> PolicyOut:
    """Log-probs of the sampled response tokens under ``model`` at ``temperature``, plus TokenStats."""
    if fused and supports_fused(model):
        hidden = _decoder_hidden(model, batch)
        head = model.get_output_embeddings()
        out = fused_logp(hidden, head.weight, batch.response_ids, temperature, bias=head.bias,
                         with_entropy=with_entropy)
        return PolicyOut(out.logp, out.entropy, out.stats, hidden)
    ids, am = batch.input_ids, batch.attention_mask.long()
    res = model(input_ids=ids, attention_mask=am, position_ids=position_ids(am), output_hidden_states=True)
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logits = res.logits[:, p - 1 : p + r - 1]
    hidden = res.hidden_states[-1][:, p - 1 : p + r - 1]
    stats = token_stats(logits.detach(), batch.response_ids, temperature)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1) if with_entropy else None
    return PolicyOut(logp, entropy, stats, hidden)
