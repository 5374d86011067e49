"""The one selection rule of an optimizer minibatch, and the loss scale of its micro-batches.

DESIGN.md, "Conventions", *When each method selects its tokens*: ClipB and ClipV select once per rollout
batch (the rollout-level keep mask); Clip-Cov and KL-Cov select per optimizer minibatch, from the current
log-probs, over the whole minibatch; no selection is ever taken per rank or per micro-batch. The native
trainer, TRL and verl all call these two functions; an engine only gathers its minibatch first (across
ranks, ``integrations.dist``) and scatters the result back to its micro-batches.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from entropy_rft.control.carriage import checked_masks
from entropy_rft.control.registry import Masks, Method
from entropy_rft.core.loss import agg_weights, ppo_clipped_mask

__all__ = ["MinibatchSelection", "combine_selection", "microbatch_loss_scale", "select_minibatch"]


class MinibatchSelection(NamedTuple):
    """What ``select_minibatch`` chose for one optimizer minibatch (all shaped like its response mask)."""

    masks: Masks  # keep = rollout keep ∧ the method's minibatch keep; zeroed; kl_cov_select; per-token eps
    counted: Tensor  # mask ∧ keep: the tokens the minibatch's loss aggregates over
    method: Masks  # the method's own minibatch masks, before the rollout keep (for records and inspection)


def select_minibatch(
    logp: Tensor | None,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    keep: Tensor | None,
    method: Method,
    eps_low: float | None,
    eps_high: float | None,
    generator: torch.Generator | None = None,
) -> MinibatchSelection:
    """Choose the kept tokens of one optimizer minibatch (DESIGN.md, "When each method selects its tokens").

    ``logp`` are the current (detached) log-probs of the *whole* minibatch, ``old_logp`` the old policy's,
    ``advantages`` per sequence or per token, ``mask`` the minibatch's response mask and ``keep`` its rows of
    the rollout-level keep mask (ClipB, ClipV, ...; None = every token). A minibatch-stage method (Clip-Cov,
    KL-Cov) selects here, over the whole minibatch, with the tokens PPO's ratio clip removes
    (``loss.ppo_clipped_mask`` with the loss's ``eps_low``/``eps_high``) and ``generator``; any other method
    selects nothing here and ``logp`` may be None. The returned keep is the rollout keep ∧ the method's
    minibatch keep (None when both are None); ``counted`` = ``mask`` ∧ keep.
    """
    selected = Masks()
    if method.stage == "minibatch":
        if logp is None:
            raise ValueError(f"method {method.name!r} selects per minibatch: pass the current log-probs")
        clipped = ppo_clipped_mask(logp, old_logp, advantages, mask, eps_low, eps_high)
        selected = checked_masks(method, method.minibatch_masks(logp, old_logp, advantages, mask, clipped=clipped,
                                                                generator=generator))
    return combine_selection(selected, mask, keep)


def combine_selection(selected: Masks, mask: Tensor, keep: Tensor | None) -> MinibatchSelection:
    """A minibatch's selection from the method's own minibatch masks ``selected`` and the rollout ``keep``
    (None = every token): keep = rollout keep ∧ the method's keep, counted = ``mask`` ∧ keep
    (``select_minibatch``'s last step, shared with the engines' distributed selections)."""
    kept = keep
    if selected.keep is not None:
        kept = selected.keep if kept is None else kept & selected.keep
    counted = mask if kept is None else mask & kept
    masks = replace(selected, keep=kept)
    return MinibatchSelection(masks, counted, selected)


def microbatch_loss_scale(weights: Tensor, counted: Tensor, agg: str) -> float:
    """The factor that turns a micro-batch's loss into its share of the minibatch's loss.

    ``policy_loss`` normalises a micro-batch over itself (``loss.agg_weights(counted, agg)``); ``weights`` are
    the micro-batch's tokens' rows of the *minibatch-level* aggregation weights. The factor is
    Σ ``weights`` / Σ (the micro-batch's own weights, in ``weights.dtype``), 0 when the micro-batch counts
    nothing, so the micro-batch losses times their factors sum to the minibatch's loss: gradient accumulation
    selects and normalises over the minibatch, never per micro-batch (DESIGN.md, "Conventions").
    """
    own = float(agg_weights(counted, agg, weights.dtype).sum())
    return float(weights.sum()) / own if own > 0 else 0.0
