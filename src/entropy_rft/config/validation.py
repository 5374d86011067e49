"""Validating a run configuration: every field against the constraints declared on it, in one loop
(``config.fields.check_fields``), then the few rules that join fields, then the method.

Each problem is one :class:`~entropy_rft.common.errors.UserError` line naming the field. Everything but the
method is checked without importing torch; :func:`validate_method` builds the method (the registry imports
torch) and returns it, so that a command builds its method once and hands that instance to the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from entropy_rft.common.errors import UserError
from entropy_rft.config.fields import check_fields
from entropy_rft.config.schema import Config

if TYPE_CHECKING:
    from entropy_rft.control.registry import Method


def _check(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise UserError(f"config field '{field_name}' {msg}")


def validate(cfg: Config, *, check_method: bool = True) -> None:
    """Reject invalid values and combinations with a one-line message naming the field.

    Every field is checked against its own constraints first (declared next to its help text in
    ``config.schema``), then the rules between fields below, then (``check_method``) the method and its
    parameters (:func:`validate_method`, which imports torch)."""
    check_fields(cfg)
    r, a, e, ap = cfg.rollout, cfg.algo, cfg.eval, cfg.autopilot
    if a.algorithm in ("grpo", "dr_grpo"):
        _check(r.group_size >= 2, "rollout.group_size", f"must be >= 2 for {a.algorithm} (group baseline)")
    n_seq = r.prompts_per_step * r.group_size
    _check(a.minibatches <= n_seq, "algo.minibatches",
           f"({a.minibatches}) must not exceed the rollout batch ({n_seq} sequences)")
    per_minibatch = n_seq // a.minibatches
    _check(a.grad_accum <= per_minibatch, "algo.grad_accum",
           f"({a.grad_accum}) must not exceed a minibatch's {per_minibatch} sequences (the rollout batch's {n_seq} / "
           f"algo.minibatches {a.minibatches}): a micro-batch holds at least one sequence")
    _check(e.batch_size >= e.samples, "eval.batch_size", f"must be >= eval.samples ({e.samples}), got {e.batch_size}")
    _check(e.extra_temperature != e.temperature, "eval.extra_temperature",
           f"({e.extra_temperature:g}) must differ from eval.temperature ({e.temperature:g}): the main evaluation "
           "samples at that temperature already; give another temperature, or 0 (off)")
    if ap.knob_min is not None and ap.knob_max is not None:
        _check(ap.knob_min < ap.knob_max, "autopilot.knob_min", f"({ap.knob_min}) must be < autopilot.knob_max "
               f"({ap.knob_max})")
    if cfg.method.entropy_target is not None:
        from entropy_rft.control import autopilot

        autopilot.parse_target(cfg.method.entropy_target)
        _check(cfg.engine == "native", "method.entropy_target", f"needs engine 'native' (got {cfg.engine!r}); "
               "the TRL engine has no autopilot")
    if check_method:
        validate_method(cfg)


def _build(where: str, name: str, params: dict[str, Any]) -> Method:
    from entropy_rft.control.registry import build_method

    try:
        return build_method(name, **params)
    except (ValueError, TypeError, KeyError) as err:
        raise UserError(f"config field '{where}' invalid: {err}") from None


def validate_method(cfg: Config) -> Method:
    """The method name and its parameters, by the registry (imports torch), and the autopilot on that method.
    Returns the selected method, built once: the run uses this instance (``launch``, ``training.trainer``).

    Every preset is checked, not only the selected method's: each other preset is built to check it, and the
    selected one through the method itself (its preset with ``method.params`` on top; the preset alone is
    built only to name it when that fails). The errors come in the order of the presets, as they did."""
    selected, failure = cfg.method.name, None
    method = None
    for name, preset in cfg.method.presets.items():
        if name != selected:
            _build(f"method.presets.{name}", name, preset)
            continue
        try:
            method = _build("method", selected, cfg.method_params())
        except UserError as err:
            _build(f"method.presets.{name}", name, preset)  # raises when the preset alone is wrong
            failure = err  # the preset is good: method.params is not; later presets are checked first
    if failure is not None:
        raise failure
    if method is None:
        method = _build("method", selected, cfg.method_params())
    if cfg.engine not in method.engines:
        raise UserError(f"config field 'method.name': method {method.name!r} runs on engine "
                        f"{' or '.join(map(repr, method.engines))} only (its terms are not in engine {cfg.engine!r}'s "
                        "loss path); use --engine native or another method (`erft methods` lists the engines)")
    if cfg.algo.algorithm not in method.algorithms:
        raise UserError(f"config field 'algo.algorithm': method {method.name!r} needs "
                        f"{' or '.join(map(repr, method.algorithms))} (its rule reads group advantages), got "
                        f"{cfg.algo.algorithm!r}; set algo.algorithm or use another method")
    if cfg.algo.drop_uniform_groups and not method.allows_group_filter:
        raise UserError(f"config field 'algo.drop_uniform_groups': method {method.name!r} reads the all-correct and "
                        "all-wrong groups the filter drops (its released rule trains on them), so the two together "
                        "are not the released method; set algo.drop_uniform_groups=false or use another method")
    if cfg.method.entropy_target is not None:
        from entropy_rft.control import autopilot

        target = autopilot.parse_target(cfg.method.entropy_target)
        assert target is not None  # None only for a None spec
        autopilot.Autopilot(method, target, cfg.autopilot, cfg.train.max_steps)
    return method
