"""A method declares what its selection sets and reads, and an engine that would drop it refuses the method
(issue 78, item 1: ``control.carriage``).

The declarations of the built-in methods are checked against what their hooks do (every field they set is
declared and every declared one is set; poisoning the statistics they do not declare changes nothing), and
``build_method`` refuses, in one line, a method that sets a field an engine it names does not carry or reads a
statistic that engine does not measure; a hook that sets an undeclared field is an error where it runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch

from entropy_rft import control
from entropy_rft.control import registry
from entropy_rft.control.carriage import CARRIED, STATS_CARRIED, STATS_FIELDS, carriage_problem, checked_masks
from entropy_rft.control.selection import select_minibatch
from entropy_rft.core.dynamics import TokenStats, token_stats
from entropy_rft.core.loss_types import MASK_FIELDS, Masks


def _batch(seed: int = 0):
    """Old-policy statistics of a small batch from random logits, per-sequence advantages of both signs (group
    normalised), a ragged response mask."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 12, 20, generator=g) * 2
    ids = torch.randint(0, 20, (8, 12), generator=g)
    stats = token_stats(logits, ids)
    adv = torch.tensor([1.2, -0.8, 0.5, -1.1, 0.9, -0.3, 1.5, -1.9])
    mask = torch.ones(8, 12, dtype=torch.bool)
    mask[1, 9:] = False
    mask[5, 4:] = False
    logp = stats.logp + 0.05 * torch.randn(8, 12, generator=g)
    return stats, adv, mask, logp


# Parameters at which each selecting built-in acts on this small batch (the defaults of a few are tuned for
# ~10^5 tokens and would select nothing here).
ACTING = {"clip_b": {"mu": 0.2}, "clip_v": {"mu": 0.5, "max_frac": None}, "clip_cov": {"ratio": 0.05},
          "kl_cov": {"ratio": 0.05}}


def _select(method, stats, adv, mask, logp) -> Masks:
    if method.stage == "rollout":
        return method.rollout_masks(stats, adv, mask)
    clipped = torch.zeros_like(mask)
    return method.minibatch_masks(logp, stats.logp, adv, mask, clipped=clipped, generator=torch.Generator())


def _selecting() -> list[str]:
    return [n for n in control.available_methods() if control.get_method_class(n).stage != "static"]


@pytest.mark.parametrize("name", _selecting())
def test_each_builtin_sets_exactly_the_masks_it_declares(name):
    stats, adv, mask, logp = _batch()
    method = control.build_method(name, **ACTING.get(name, {}))
    cls = type(method)
    if cls.stage == "rollout" and cls.rollout_masks is control.Method.rollout_masks:
        assert cls.masks == (), name  # a controller at the rollout stage that selects nothing (AEPO, Entrocraft)
        return
    got = _select(method, stats, adv, mask, logp)
    assert got.set_fields() == tuple(f for f in MASK_FIELDS if f in cls.masks), name
    assert checked_masks(method, got) is got


@pytest.mark.parametrize("name", [n for n in _selecting() if control.get_method_class(n).stage == "rollout"]
                         + ["adaptive_entropy", "fec"])
def test_each_builtin_reads_only_the_statistics_it_declares(name):
    """Its rollout hooks (rollout_masks, observe) on statistics whose undeclared fields are NaN give what they
    give on the real ones: the masks, the control metrics and the method's state after observing."""
    stats, adv, mask, _ = _batch(1)
    cls = control.get_method_class(name)
    assert cls.reads is not None, f"{name} declares what it reads"
    poisoned = TokenStats(**{f: getattr(stats, f) if f in cls.reads else torch.full_like(stats.entropy, float("nan"))
                             for f in STATS_FIELDS})
    outs = []
    for st in (stats, poisoned):
        method = control.build_method(name, **ACTING.get(name, {}))
        observed = method.observe(st, mask, "token-mean")
        masks = method.rollout_masks(st, adv, mask) if cls.stage == "rollout" else Masks()
        outs.append((observed, masks, method.params(), method.state_dict()))
    (o1, m1, p1, s1), (o2, m2, p2, s2) = outs
    assert o1 == o2 and p1 == p2 and s1 == s2, name
    for f in MASK_FIELDS:
        a, b = getattr(m1, f), getattr(m2, f)
        assert (a is None) == (b is None), (name, f)
        if a is not None:
            assert torch.equal(a, b), (name, f)


def test_every_builtin_passes_its_engines_carriage():
    for name in control.available_methods():
        cls = control.get_method_class(name)
        assert carriage_problem(cls) is None, name
        for engine in cls.engines:
            assert set(cls.masks) <= CARRIED[engine][cls.stage] if cls.stage != "static" else not cls.masks
    # the tables as the engines' code paths are: verl's rollout rules get no log p (integrations.verl_stats)
    assert STATS_CARRIED["verl"] == set(STATS_FIELDS) - {"logp"}
    assert CARRIED["trl"]["rollout"] == CARRIED["verl"]["rollout"] == {"keep"}
    assert control.method_info("clip_cov")["masks"] == ["zeroed"] and control.method_info("clip_v")["reads"] == [
        "s_centered"]


# ----------------------------------------------------------------------------- refusals


@dataclass
class _Shift(control.Method):
    """A rollout rule that shifts the advantage of high-entropy tokens (the shape of a new method)."""

    name: ClassVar[str] = "test_shift"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "local"
    masks: ClassVar[tuple[str, ...]] = ("adv_shift",)
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)
    engines: ClassVar[tuple[str, ...]] = ("native", "trl")

    def rollout_masks(self, stats, advantages, mask):
        return Masks(adv_shift=torch.where(mask & (stats.entropy > 1.0), 0.1, 0.0))


def _built(cls, **changes):
    """``build_method`` on ``cls`` registered with ``changes`` to its class variables (unregistered after)."""
    new = type(cls.__name__, (cls,), dict(changes))
    new = dataclass(new)
    control.register_method(new)
    try:
        return control.build_method(new.name)
    finally:
        registry._REGISTRY.pop(new.name, None)


def test_a_method_that_sets_a_field_an_engine_does_not_carry_is_refused_on_that_engine():
    with pytest.raises(ValueError) as e:
        _built(_Shift)
    msg = str(e.value)
    assert "\n" not in msg and "'test_shift' sets adv_shift at its rollout stage" in msg
    assert "the trl engine does not carry (it carries keep there)" in msg and "would train as GRPO on trl" in msg
    assert "leave 'trl' out of its engines" in msg
    assert _built(_Shift, engines=("native",)).name == "test_shift"  # the native engine carries it
    with pytest.raises(ValueError, match="sets zeroed at its rollout stage, which the native engine does not"):
        _built(_Shift, masks=("zeroed",), engines=("native",))


def test_a_built_method_handed_to_trls_trainer_is_held_to_the_same_carriage():
    """A Method built by hand skips build_method; the TRL trainer's own refusal (method_refusal, run before any
    weight is read) says the same line."""
    from entropy_rft.integrations.trl_support import method_refusal

    msg = method_refusal(_Shift())
    assert msg is not None and "would train as GRPO on trl" in msg
    assert method_refusal(control.build_method("clip_v")) is None


def test_a_method_that_reads_what_an_engine_does_not_measure_is_refused():
    with pytest.raises(ValueError, match=r"'test_shift' reads logp, which the verl engine does not measure"):
        _built(_Shift, masks=("keep",), reads=("entropy", "logp"), engines=("native", "verl"))
    with pytest.raises(ValueError, match="runs on verl, which measures entropy, s_centered, s_expected, s_star of "
                                         "the rollout statistics, and does not say which it reads"):
        _built(_Shift, masks=("keep",), reads=None, engines=("native", "verl"))
    # undeclared reads run where every statistic is measured
    assert _built(_Shift, masks=("keep",), reads=None, engines=("native", "trl")).name == "test_shift"


def test_declarations_must_name_fields_and_fit_the_stage():
    with pytest.raises(ValueError, match=r"masks names 'kept', not a Masks field; Masks has keep, zeroed"):
        _built(_Shift, masks=("kept",))
    with pytest.raises(ValueError, match=r"reads names 'H', not a TokenStats field"):
        _built(_Shift, reads=("H",))
    with pytest.raises(ValueError, match="selects tokens in rollout_masks but declares no masks"):
        _built(_Shift, masks=())
    with pytest.raises(ValueError, match="is static .* but declares masks keep"):
        _built(_Shift, stage="static", exchange=None, masks=("keep",))
    with pytest.raises(ValueError, match="masks must be a tuple of Masks fields"):
        _built(_Shift, masks="keep")


def test_a_hook_that_sets_an_undeclared_field_is_an_error_where_it_runs():
    stats, adv, mask, logp = _batch()
    method = control.build_method("clip_cov", ratio=0.05)
    lying = copy.copy(method)
    lying.minibatch_masks = lambda *a, **k: Masks(zeroed=mask.clone(), keep=mask.clone())
    with pytest.raises(RuntimeError, match=r"'clip_cov' set keep in its minibatch selection, which its class does "
                                           r"not declare \(masks = \('zeroed',\)\): add it to masks"):
        select_minibatch(logp, stats.logp, adv, mask, None, lying, 0.2, 0.2, torch.Generator())
    assert select_minibatch(logp, stats.logp, adv, mask, None, method, 0.2, 0.2, torch.Generator()).masks.zeroed \
        is not None


def test_masks_map_applies_to_the_set_fields_only():
    keep = torch.tensor([[True, False, True], [False, True, True]])
    shift = torch.tensor([[0.5, 0.0, -1.0], [2.0, 0.0, 0.0]])
    m = Masks(keep=keep, adv_shift=shift)
    rows = m.map(lambda x: x[1:])
    assert rows.set_fields() == ("keep", "adv_shift")
    assert rows.keep.tolist() == [[False, True, True]] and rows.adv_shift.tolist() == [[2.0, 0.0, 0.0]]
    assert Masks().map(lambda x: 1 / 0).set_fields() == ()
    assert replace(m, keep=None).set_fields() == ("adv_shift",)
