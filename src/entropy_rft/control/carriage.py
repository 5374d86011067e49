"""What each engine carries of a method's selection, and the one-line refusal of a method an engine would run
as GRPO (issue 78, item 1).

A method's selection hook (``rollout_masks`` at stage ``rollout``, ``minibatch_masks`` at stage ``minibatch``)
returns a ``Masks``; each engine takes only some of its fields to the loss, and its rollout statistics are not all
measured everywhere (verl's rollout rules get ``logp = 0``). A method therefore declares, on its class as it
declares its ``exchange``:

- ``masks``: the ``Masks`` fields its selection hook sets (``("keep",)`` for ClipB, ``("zeroed",)`` for Clip-Cov);
- ``reads``: the ``TokenStats`` fields its rollout hooks (``rollout_masks``, ``observe``) read, or None when it
  did not say (then it runs only where every statistic is measured).

``carriage_problem`` checks the declarations against :data:`CARRIED` and :data:`STATS_CARRIED` for every engine
the method names, and ``control.build_method`` raises it; ``checked_masks`` holds a hook to its declaration
while it runs (a field set that was not declared is an error naming it, never a silent drop). The tables state
what each engine's loss path applies and is tested to apply (tests/test_carriage.py); an engine that takes a
field further is added here with its test.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from entropy_rft.control.exchange import rule_hook
from entropy_rft.core.dynamics import TokenStats
from entropy_rft.core.loss_types import MASK_FIELDS, Masks

__all__ = ["CARRIED", "STATS_CARRIED", "STATS_FIELDS", "carriage_problem", "checked_masks"]

STATS_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TokenStats))

# engine -> stage -> the Masks fields its loss applies: native keeps the rollout stage's keep, advantage shift and
# weight selection for every micro-batch (training.stages) and the minibatch stage's masks and clip widths;
# TRL (integrations.window) and verl (integrations.verl) keep the rollout keep and the minibatch's keep, zeroed
# and KL-Cov selection.
_DISTRIBUTED = {"rollout": frozenset({"keep"}), "minibatch": frozenset({"keep", "zeroed", "kl_cov_select"})}
CARRIED: dict[str, dict[str, frozenset[str]]] = {
    "native": {"rollout": frozenset({"keep", "adv_shift", "weight_select"}),
               "minibatch": frozenset({"keep", "zeroed", "kl_cov_select", "eps_low", "eps_high"})},
    "trl": _DISTRIBUTED,
    "verl": _DISTRIBUTED,
}
# engine -> the TokenStats fields measured for its rollout rules (verl's stats pass measures no log p of the
# sampled token: integrations.verl_stats passes zeros)
STATS_CARRIED: dict[str, frozenset[str]] = {
    "native": frozenset(STATS_FIELDS),
    "trl": frozenset(STATS_FIELDS),
    "verl": frozenset(STATS_FIELDS) - {"logp"},
}

def _overrides(cls: type[Any], hook: str) -> bool:
    """Whether ``cls`` has a ``hook`` of its own: the class that defines it nearest ``cls`` is not the one that
    first defined it (the base ``Method``, whose hooks select nothing)."""
    owners = [c for c in cls.__mro__ if hook in vars(c)]
    return len(owners) > 1 and owners[0] is not owners[-1]


def _names(value: Any) -> tuple[str, ...] | None:
    return tuple(value) if isinstance(value, (tuple, list, frozenset, set)) else None


def carriage_problem(cls: type[Any]) -> str | None:
    """Why ``cls`` (a ``Method`` class) cannot run as it says on the engines it names, in one line; None when it
    can: its ``masks`` are ``Masks`` fields, declared when its stage's hook is its own and carried at its stage by
    every engine it names; its ``reads`` are ``TokenStats`` fields, measured by every engine it names (undeclared
    ``reads`` only where all are)."""
    who = f"method {cls.name!r}"
    masks, reads = _names(cls.masks), cls.reads if cls.reads is None else _names(cls.reads)
    if masks is None:
        return f"{who}: masks must be a tuple of Masks fields ({', '.join(MASK_FIELDS)}), got {cls.masks!r}"
    if cls.reads is not None and reads is None:
        return f"{who}: reads must be None or a tuple of TokenStats fields ({', '.join(STATS_FIELDS)}), " \
               f"got {cls.reads!r}"
    if bad := [m for m in masks if m not in MASK_FIELDS]:
        return f"{who}: masks names {', '.join(map(repr, bad))}, not a Masks field; Masks has {', '.join(MASK_FIELDS)}"
    if reads is not None and (bad := [r for r in reads if r not in STATS_FIELDS]):
        return (f"{who}: reads names {', '.join(map(repr, bad))}, not a TokenStats field; TokenStats has "
                f"{', '.join(STATS_FIELDS)}")
    hook = rule_hook(cls.stage)
    if hook is None and masks:
        return f"{who} is static (no selection hook runs) but declares masks {', '.join(masks)}: set masks = ()"
    if hook is not None and _overrides(cls, hook) and not masks:
        return (f"{who} selects tokens in {hook} but declares no masks: set masks = (...) on its class to the Masks "
                f"fields it sets ({', '.join(MASK_FIELDS)})")
    for engine in cls.engines:
        carried = CARRIED.get(engine, {}).get(cls.stage, frozenset())
        if lost := [m for m in masks if m not in carried]:
            return (f"{who} sets {', '.join(lost)} at its {cls.stage} stage, which the {engine} engine does not "
                    f"carry (it carries {', '.join(sorted(carried)) or 'nothing'} there), so it would train as GRPO "
                    f"on {engine}: leave {engine!r} out of its engines")
        measured = STATS_CARRIED.get(engine, frozenset())
        if cls.stage == "rollout" and reads is None and measured != frozenset(STATS_FIELDS):
            return (f"{who} runs on {engine}, which measures {', '.join(sorted(measured))} of the rollout "
                    f"statistics, and does not say which it reads: set reads = (...) on its class")
        if reads is not None and (missing := [r for r in reads if r not in measured]):
            return (f"{who} reads {', '.join(missing)}, which the {engine} engine does not measure for its rules: "
                    f"leave {engine!r} out of its engines")
    return None


def checked_masks(method: Any, masks: Masks) -> Masks:
    """``masks`` as ``method``'s selection hook returned them, after checking that it set only the fields its class
    declares (``masks``); RuntimeError naming the field otherwise (an engine would drop it without a word)."""
    extra = [m for m in masks.set_fields() if m not in method.masks]
    if extra:
        raise RuntimeError(f"method {method.name!r} set {', '.join(extra)} in its {method.stage} selection, which its "
                           f"class does not declare (masks = {tuple(method.masks)!r}): add it to masks")
    return masks
