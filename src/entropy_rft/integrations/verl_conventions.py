"""verl's loss conventions in entropy-rft's terms (verl-free, used by :mod:`entropy_rft.integrations.verl`):
verl's actor config read into the loss's ``LossSettings`` (ratio clip, dual clip, aggregation), the
parameters of the methods verl ships itself read from verl's own keys, and verl's global-batch normalisation
(``config.global_batch_info``) as one factor on the loss's micro-batch aggregate.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import Tensor

from entropy_rft.control.registry import Method
from entropy_rft.control.selection import microbatch_loss_scale
from entropy_rft.core.loss import AGG_MODES, aggregation_weights
from entropy_rft.core.loss_types import Agg, LossOverrides, LossSettings


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` of a verl config (OmegaConf/dict ``get``, or an attribute), ``default`` when absent."""
    if config is None:
        return default
    getter = getattr(config, "get", None)
    return getter(key, default) if getter is not None else getattr(config, key, default)


# The methods verl ships as its own losses (``core_algos.compute_policy_loss_clip_cov`` / ``_kl_cov``, adapted from
# Paper B's code): ``erft_<name>`` reads their parameters from the same ``policy_loss`` keys, so that switching
# ``loss_mode`` between verl's and ours changes nothing else, and applies no dual clip (neither of verl's does).
VERL_KEYS: dict[str, dict[str, str]] = {
    "clip_cov": {"clip_cov_ratio": "ratio", "clip_cov_lb": "lb", "clip_cov_ub": "ub"},
    "kl_cov": {"kl_cov_ratio": "ratio", "ppo_kl_coef": "coef"},
}


def params_from_verl_keys(config: Any, method: str) -> dict[str, float]:
    """The parameters of ``method`` (a key of ``VERL_KEYS``) from verl's ``config.policy_loss``; keys it lacks
    keep the method's defaults."""
    pl = config_value(config, "policy_loss", None)
    out = {}
    for key, param in VERL_KEYS[method].items():
        value = config_value(pl, key)
        if value is not None:
            out[param] = float(value)
    return out


def settings_from_config(config: Any, method: Method, agg: str) -> LossSettings:
    """The loss's settings from verl's actor config: the ratio clip (``clip_ratio`` with ``clip_ratio_low``/
    ``clip_ratio_high``), the dual clip ``clip_ratio_c`` (verl's vanilla loss applies it always, default 3.0) and the
    aggregation ``agg`` (verl's ``loss_agg_mode``); the method's own (``Method.loss_overrides``: clip-higher, KL-Cov,
    entropy bonus) win. Clip-Cov and KL-Cov have no dual clip, as verl's own ``clip_cov`` and ``kl_cov``. Read at
    every loss call (verl passes the config there), built and validated once per distinct configuration."""
    if agg not in AGG_MODES:
        raise ValueError(f"entropy-rft losses support loss_agg_mode in {list(AGG_MODES)}, got {agg!r}")
    eps = config_value(config, "clip_ratio", 0.2)
    lo, hi = config_value(config, "clip_ratio_low"), config_value(config, "clip_ratio_high")
    return _settings(float(eps if lo is None else lo), float(eps if hi is None else hi),
                     float(config_value(config, "clip_ratio_c", 3.0)), agg, method.name in VERL_KEYS,
                     method.loss_overrides())


@functools.lru_cache(maxsize=64)
def _settings(eps_low: float, eps_high: float, clip_c: float, agg: str, verl_own: bool,
              own: LossOverrides) -> LossSettings:
    """``settings_from_config``'s settings from the values it read (``verl_own``: a method verl ships itself), by
    field name: verl's clip, then the method's own over it, then the dual clip unless that leaves no clip."""
    named: dict[str, Any] = {"eps_low": eps_low, "eps_high": eps_high, **own.kwargs()}
    no_clip = named["eps_low"] is None and named["eps_high"] is None
    dual = None if verl_own or no_clip else clip_c  # verl's clip_cov: max(pg1, pg2) only; kl_cov: plain -A·r
    return LossSettings(**named, dual_clip=dual, agg=cast(Agg, agg))


def global_scale(counted: Tensor, agg: str, info: dict[str, Any] | None) -> float:
    """Factor that turns ``policy_loss``'s aggregate over this micro-batch's counted tokens into verl's
    contribution to the global mini-batch loss (``core_algos.agg_loss`` with ``config.global_batch_info``).

    verl gathers no masks: its global counts give this micro-batch's rows of the mini-batch-level weights
    (token-mean: 1/batch_num_tokens per token; seq-mean-token-mean: 1/(global_batch_size · the row's tokens);
    seq-mean-token-sum-norm: 1/(global_batch_size · (loss_scale_factor or T))), and the factor is
    ``control.microbatch_loss_scale`` of those times dp_size (verl averages over data-parallel ranks).
    Without global information (single micro-batch, one rank) verl aggregates locally: factor 1 (and
    T / loss_scale_factor for the sum-norm mode).
    """
    info = info or {}
    width = counted.shape[-1]
    lsf = info.get("loss_scale_factor")
    norm = float(lsf if lsf is not None else width)  # verl's constant of the sum-norm mode
    total = info.get("batch_num_tokens" if agg == "token-mean" else "global_batch_size")
    if total is None:
        return width / norm if agg == "seq-mean-token-sum-norm" else 1.0
    if not total:
        return 0.0
    weights = aggregation_weights(counted.to(torch.float64), agg, tokens=float(total), sequences=float(total),
                                  width=norm)
    return microbatch_loss_scale(weights, counted, agg) * int(info.get("dp_size") or 1)
