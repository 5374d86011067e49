"""The policy forward: response-token log-probs (with grad) and TokenStats (without) for a rollout batch.

Two paths give the same numbers (and for Llama-family decoders the hidden states come from
:mod:`entropy_rft.policy.fast_llama`, the same maths without transformers' per-call overhead):

- fused (default): decoder hidden states and the LM-head weight go to ``fused.fused_logp``, which
  works in token chunks and never materialises the [tokens, V] logits;
- materialised: the model's logits, then ``dynamics.token_stats`` and a log-softmax gather. Used for
  models whose logits are not a plain ``hidden @ W.T`` (soft-capping, logit scales).

Which path a model takes is decided once per model instance (:func:`forward_plan`, from its structure); each
call then reads only what can change between calls: the caller's ``fused``/``fast`` flags, the model's mode
(training with dropout, gradient checkpointing) and whether the batch's response masks are prefixes.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from entropy_rft.core.dynamics import TokenStats, token_stats
from entropy_rft.core.fused import fused_logp
from entropy_rft.policy.fast_llama import decoder_hidden, is_prefix_mask, response_hidden, unsupported_reason
from entropy_rft.policy.rollout import RolloutBatch, position_ids

# Config attributes that make logits differ from hidden @ W.T; such models use the materialised path.
_NONPLAIN_LOGITS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


@dataclass
class PolicyOut:
    logp: Tensor  # [B, R] log-prob of each response token (grad when enabled)
    entropy: Tensor | None  # [B, R] entropy with grad, when requested (entropy bonus)
    stats: TokenStats  # [B, R] float32, no grad
    hidden: Tensor  # [B, R, D] hidden state that predicts each response token (for a value head)

    def rows(self, idx: Tensor) -> PolicyOut:
        """The same outputs for the rows ``idx`` (graphs kept)."""
        st = TokenStats(*(getattr(self.stats, f.name)[idx] for f in dataclasses.fields(TokenStats)))
        return PolicyOut(self.logp[idx], None if self.entropy is None else self.entropy[idx], st, self.hidden[idx])


def supports_fused(model) -> bool:
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, a, None) not in (None, 1.0) for a in _NONPLAIN_LOGITS):
        return False
    head = model.get_output_embeddings()
    return head is not None and isinstance(head, torch.nn.Linear)


@dataclass(frozen=True)
class ForwardPlan:
    """How :func:`policy_forward` runs one model, decided from its structure (config and module types).

    ``fused``: :func:`supports_fused` (its logits are ``hidden @ W.T`` of a plain linear head);
    ``fast_reason``: :func:`entropy_rft.policy.fast_llama.unsupported_reason` without a length, None when the
    raw-weights Llama forward can run it (a walk over every layer's modules, the costly part)."""

    fused: bool
    fast_reason: str | None


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forward_plan(model) -> ForwardPlan:
    """The :class:`ForwardPlan` of ``model``, made at its first forward and kept for the model's lifetime (held
    weakly: it goes with the model). A model's structure is fixed once it trains; its mode is not, and
    :func:`fast_path_ok` reads that on every call."""
    plan = _PLANS.get(model)
    if plan is None:
        plan = _PLANS[model] = ForwardPlan(supports_fused(model), unsupported_reason(model))
    return plan


def fast_path_ok(model) -> bool:
    """Whether the raw-weights Llama forward (:func:`entropy_rft.policy.fast_llama.decoder_hidden`) computes what the
    model's own modules would: a supported architecture (:func:`forward_plan`), no gradient checkpointing, no
    active dropout."""
    if forward_plan(model).fast_reason is not None:
        return False
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5 renamed it
        if hasattr(type(model), attr):
            if getattr(model, attr):
                return False
            break
    return not (model.training and float(getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0)


def _decoder_hidden(model, batch: RolloutBatch, fast: bool) -> Tensor:
    """Hidden states [B, R, D] predicting each response position; ``fast``: the caller checked fast_path_ok."""
    ids, am = batch.input_ids, batch.attention_mask.long()
    if fast:
        hidden = decoder_hidden(model, ids, am, check=False)
    else:
        hidden = model.get_decoder()(input_ids=ids, attention_mask=am, position_ids=position_ids(am)).last_hidden_state
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    return hidden[:, p - 1 : p + r - 1]


def _place(x: Tensor, rows: Tensor, cols: Tensor, shape: tuple[int, int]) -> Tensor:
    """Packed per-token values [N, ...] back to [B, R, ...], zero where no token is (differentiable)."""
    return x.new_zeros(shape + tuple(x.shape[1:])).index_put((rows, cols), x)


def _packed_forward(model, batch: RolloutBatch, temperature: float, with_entropy: bool) -> PolicyOut:
    """The fused path on :func:`entropy_rft.policy.fast_llama.response_hidden`: valid tokens only, one pass per
    prompt."""
    ph = response_hidden(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask,
                         check=False)
    head = model.get_output_embeddings()
    out = fused_logp(ph.hidden, head.weight, batch.response_ids[ph.rows, ph.cols], temperature, bias=head.bias,
                     with_entropy=with_entropy)
    shape = tuple(batch.response_ids.shape)
    place = lambda x: _place(x, ph.rows, ph.cols, shape)  # noqa: E731
    stats = TokenStats(*(place(getattr(out.stats, f.name)) for f in dataclasses.fields(TokenStats)))
    return PolicyOut(place(out.logp), None if out.entropy is None else place(out.entropy), stats, place(ph.hidden))


def policy_forward(model, batch: RolloutBatch, temperature: float, *, with_entropy: bool = False,
                   fused: bool = True, fast: bool = True) -> PolicyOut:
    """Log-probs of the sampled response tokens under ``model`` at ``temperature``, plus TokenStats.

    ``fast`` runs Llama-family decoders on their raw weights (:mod:`entropy_rft.policy.fast_llama`) when
    :func:`fast_path_ok`; the result equals the HF modules' to float rounding. There, for responses masked up
    to EOS, each distinct prompt runs once and padding is never computed (:func:`response_hidden`); outputs at
    positions outside ``response_mask`` are then 0 (every consumer masks them)."""
    if fused and forward_plan(model).fused:
        fast = fast and fast_path_ok(model)
        if fast and is_prefix_mask(batch.response_mask):
            return _packed_forward(model, batch, temperature, with_entropy)
        hidden = _decoder_hidden(model, batch, fast)
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
