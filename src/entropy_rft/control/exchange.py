"""What a method's token selection exchanges across ranks: ``Method.exchange``, which the engines' distributed
selections (``integrations.dist_select``) read, as they read ``Method.stage`` for when it selects.

A method that selects tokens (stage ``rollout`` or ``minibatch``) on an engine that runs on several ranks (TRL,
verl) declares one of ``EXCHANGES`` on its class; a subclass inherits it. ``exchange_problem`` is the one line
that refuses a class whose declaration is missing, unknown, of the other stage, or inherited by a class that
redefines the rule the declaration describes; ``control.build_method`` raises it.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["EXCHANGES", "STATISTICS", "exchange_problem", "rule_hook"]

# name -> (the stages it fits, what travels between ranks and whose rule it is). The statistics' reductions over
# every rank are ``integrations.dist_select.GLOBAL``; the rules are ``control.masks``'s.
EXCHANGES: dict[str, tuple[tuple[str, ...], str]] = {
    "local": (("rollout", "minibatch"), "nothing: the rule reads each token alone and draws no random numbers, "
                                        "so every rank runs it on its own rows"),
    "tokens": (("rollout", "minibatch"), "every rank's tokens, all-gathered: the rule runs on the concatenation "
                                         "(always right, O(N) bytes per rank; 80/20's quantile)"),
    "s_star_mean_std": (("rollout",), "float64 sums for the mean and std of S: ClipB's rule "
                                      "(``control.masks.clip_b_mask``)"),
    "s_centered_std_top_k": (("rollout",), "float64 sums for the std of S_c, and the cap's top-k candidates: "
                                           "ClipV's rule (``control.masks.clip_v_mask``)"),
    "covariance_random_pick": (("minibatch",), "float64 sums for the covariance's means, and the candidate counts: "
                                               "Clip-Cov's rule (``control.masks.clip_cov_mask``)"),
    "covariance_top_k": (("minibatch",), "float64 sums for the covariance's means, and the top-k candidates: "
                                         "KL-Cov's rule (``control.masks.kl_cov_select``)"),
}
# The exchanges of batch statistics: the method's own hook runs on each rank's rows with the ranks' reductions,
# ``hook(..., reduce=integrations.dist_select.GLOBAL)`` (``control.reductions``), so its hook takes ``reduce``.
STATISTICS = tuple(n for n in EXCHANGES if n not in ("local", "tokens"))

_DISTRIBUTED = ("trl", "verl")


def rule_hook(stage: str) -> str | None:
    """The ``Method`` hook that selects at ``stage`` (None for a static method)."""
    return {"rollout": "rollout_masks", "minibatch": "minibatch_masks"}.get(stage)


def _declared_by(cls: type, attr: str) -> type | None:
    """The class of ``cls``'s MRO whose own body sets ``attr``."""
    return next((c for c in cls.__mro__ if attr in vars(c)), None)


def exchange_problem(cls: type[Any], on_ranks: bool = False) -> str | None:
    """Why ``cls`` (a ``Method`` class) cannot run its selection on several ranks, in one line; None when it can or
    need not (a static method; one that runs on the native engine only, unless ``on_ranks``: it is running on
    several ranks now)."""
    hook, how = rule_hook(cls.stage), cls.exchange
    if hook is None or not (on_ranks or set(cls.engines) & set(_DISTRIBUTED)):
        return None
    fits = [n for n, (stages, _) in EXCHANGES.items() if cls.stage in stages]
    stats = ", ".join(n for n in fits if n not in ("local", "tokens"))
    choices = (f'"local" (a rule that reads each token alone), "tokens" (gather every rank\'s tokens) or a '
               f"statistic of integrations.dist_select ({stats})")
    where = f"method {cls.name!r} selects tokens at its {cls.stage} stage and runs on {', '.join(cls.engines)}"
    if how is None:
        return f"{where}, but declares no exchange across ranks: set exchange = {choices} on its class"
    if how not in fits:
        return f"{where}: exchange {how!r} is not one of its stage's; set exchange = {choices}"
    declarer, rule = _declared_by(cls, "exchange"), _declared_by(cls, hook)
    if how != "tokens" and declarer is not None and rule is not None and rule is not declarer \
            and issubclass(rule, declarer):
        return (f"{where}: {rule.__name__} redefines {hook} below {declarer.__name__}, whose exchange {how!r} "
                f"describes the rule it replaces; set exchange = {choices} on {rule.__name__}")
    if how in STATISTICS and "reduce" not in inspect.signature(getattr(cls, hook)).parameters:
        return (f"{where}: exchange {how!r} runs {hook} with every rank's reductions, but its {hook} takes no "
                f"reduce=: pass it to the control.masks rule (as ClipB does), or set exchange = \"tokens\"")
    return None
