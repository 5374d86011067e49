"""Test harness only: verl's own covariance losses beside the plug-in's, on every micro-batch of a real job.

Loaded after ``entropy_rft.integrations.verl`` through ``VERL_USE_EXTERNAL_MODULES`` when ``ERFT_CPU_PEER`` names a
folder. It wraps the registry entries ``erft_clip_cov`` and ``erft_kl_cov`` (verl's ``ppo_loss`` looks the loss up
by name at every call): each call first evaluates, on the very inputs and config verl passed, the pairs
(``clip_cov``, ``erft_clip_cov``) and (``kl_cov``, ``erft_kl_cov``), each loss with its gradient with respect to
``log_prob`` and its metrics, saves them (one file per call and rank), then returns the plug-in's own result,
which the job trains on. Clip-Cov's random pick is left to each side's generator: the test's keys make it pick
every candidate.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

import entropy_rft.integrations.verl  # noqa: F401  (registers erft_clip_cov, erft_kl_cov)

PAIRS = (("clip_cov", "erft_clip_cov"), ("kl_cov", "erft_kl_cov"))
_CALLS = itertools.count()
_LOSSES = {name: POLICY_LOSS_REGISTRY[name] for pair in PAIRS for name in pair}


def _evaluate(fn, kwargs: dict) -> dict:
    lp = kwargs["log_prob"].detach().clone().requires_grad_(True)
    loss, met = fn(**{**kwargs, "log_prob": lp})
    (grad,) = torch.autograd.grad(loss, lp)
    return {"loss": loss.detach().clone(), "grad": grad.detach().clone(),
            "metrics": {k: float(v) for k, v in met.items() if isinstance(v, (int, float))}}


def _recording(name: str):
    own = _LOSSES[name]

    def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
        kwargs = dict(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                      response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                      rollout_is_weights=rollout_is_weights)
        record = {"loss_mode": name, "loss_agg_mode": loss_agg_mode,
                  "response_mask": response_mask.detach().bool().clone(),
                  "ratio": torch.exp(log_prob.detach() - old_log_prob.detach()),
                  "advantages": advantages.detach().clone()}
        for pair in PAIRS:
            for n in pair:
                record[n] = _evaluate(_LOSSES[n], kwargs)
        folder = Path(os.environ["ERFT_CPU_PEER"])
        folder.mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        torch.save(record, folder / f"call{next(_CALLS)}_rank{rank}.pt")
        return own(**kwargs)

    return loss


if os.environ.get("ERFT_CPU_PEER"):
    for _name in ("erft_clip_cov", "erft_kl_cov"):
        POLICY_LOSS_REGISTRY[_name] = _recording(_name)
