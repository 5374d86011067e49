"""The method registry: names -> configured entropy-control methods (verl-style, errors list the names).

A method contributes to the loss only through ``Masks`` and ``loss_overrides`` (a typed ``LossOverrides``). The
trainer calls ``rollout_masks`` once per rollout batch (old-policy ``TokenStats`` of the whole batch) and
``minibatch_masks`` once per optimizer minibatch (current log-probs, detached), as DESIGN.md fixes.

A method that is itself an entropy controller (the TRL-style adaptive coefficient, EntroPIC) keeps its own
control law in ``observe``: the native trainer calls it once per rollout batch, before the masks, when no
autopilot drives the method; with ``method.entropy_target`` set the autopilot owns the knob and ``observe`` is
not called (one controller per knob). ``engines`` names the engines whose loss path carries the method's terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

from torch import Tensor

from entropy_rft.common.constraints import rule_words, type_hints, typed_problem
from entropy_rft.control.carriage import carriage_problem
from entropy_rft.control.exchange import exchange_problem
from entropy_rft.core.loss_types import LossOverrides, Masks

if TYPE_CHECKING:
    import torch

    from entropy_rft.core.dynamics import TokenStats

__all__ = [
    "LossOverrides",
    "Masks",
    "Method",
    "Resample",
    "param",
    "register_method",
    "on_register",
    "build_method",
    "available_methods",
    "method_info",
    "get_method_class",
]


@dataclass(frozen=True)
class Resample:
    """Extra rollouts a method asks for in a step (AEPO): the first ``prompt_frac`` of the step's prompts, rolled
    out again (a group each) at ``temperature``; ``Method.splice_rows`` then picks those that replace the batch's
    first rollouts."""

    temperature: float
    prompt_frac: float


def param(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
          lt: float | None = None, choices: tuple | None = None, note: str = "", rule: str = "") -> Any:
    """A method parameter: a dataclass field carrying its help text and its constraints, declared as a config
    field's (``config.fields.setting``; words and tests in :mod:`entropy_rft.common.constraints`):

    - its type: a parameter typed ``float`` needs a finite number (not a bool), ``int`` an integer, ``bool`` a bool;
      one typed ``X | None`` also accepts None;
    - ``ge`` / ``gt`` / ``le`` / ``lt``: its range; ``choices``: its accepted values; ``note``: words after the range;
    - ``rule``: the words of what ``Method.validate`` checks beyond these (a rule joining parameters, an entropy
      level); a number with no range says here why (``any finite number``).

    ``Method.check_params`` checks all of them; ``erft methods`` shows them next to the help."""
    meta: dict[str, Any] = {"help": help}
    given = dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, note=note or None, rule=rule or None)
    meta.update({k: v for k, v in given.items() if v is not None})
    return field(default=default, metadata=meta)


class Method:
    """Base class of entropy-control methods. Concrete methods are ``@dataclass``es of typed params.

    Subclasses set the class variables, declare each parameter's type, range and choices on its ``param`` (checked
    by ``check_params``), implement ``validate`` for the rules no range says (raise ``ValueError`` naming the
    param), and override the hooks they need; the defaults contribute nothing.
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    stage: ClassVar[str] = "static"  # "rollout", "minibatch" or "static": when the method selects tokens
    knob: ClassVar[str | None] = None
    knob_raises_entropy: ClassVar[int] = 0
    # What the method does to each lens quadrant (control.lens.QUADRANTS): "drops", "zeroes", "reweights",
    # "adds gradient", "changes the clip", ... with a few words; a quadrant not named is untouched.
    # "all" stands for every quadrant.
    quadrants: ClassVar[dict[str, str]] = {}
    engines: ClassVar[tuple[str, ...]] = ("native", "trl", "verl")
    algorithms: ClassVar[tuple[str, ...]] = ("grpo", "dr_grpo", "ppo")  # algo.algorithm values the rule fits
    # False: the rule reads all-correct and all-wrong groups, so algo.drop_uniform_groups would change it
    allows_group_filter: ClassVar[bool] = True
    # What the selection (stage rollout or minibatch) exchanges across ranks, one of control.exchange.EXCHANGES:
    # "local" (a per-token rule), "tokens" (gather them), or a statistic integrations.dist_select computes.
    # Inherited; build_method refuses a selecting method on TRL or verl that declares none (exchange_problem).
    exchange: ClassVar[str | None] = None
    # The Masks fields its selection hook (by its stage) sets, and the TokenStats fields its rollout hooks read
    # (None: not said, so it runs only where every statistic is measured). build_method refuses a method an engine
    # it names would not carry or measure (control.carriage); the hooks are held to ``masks`` while they run.
    masks: ClassVar[tuple[str, ...]] = ()
    reads: ClassVar[tuple[str, ...] | None] = None

    def __post_init__(self) -> None:
        self.check_params()
        self.validate()

    def check_params(self) -> None:
        """Check every parameter declared with ``param`` against its type, range and choices, in declaration order;
        the first violation raises ValueError ``NAME must be ..., got VALUE``."""
        if not dataclasses.is_dataclass(self):
            return
        hints = type_hints(type(self))
        for f in dataclasses.fields(self):
            if "help" not in f.metadata:  # a field not declared with ``param`` declares nothing
                continue
            msg = typed_problem(getattr(self, f.name), f.metadata, hints.get(f.name, Any))
            if msg is not None:
                raise ValueError(f"{f.name} {msg}")

    def validate(self) -> None:
        """Check what the parameters' declarations cannot say (rules that join parameters); raise ValueError
        naming the bad one. Called after ``check_params``."""

    def loss_overrides(self) -> LossOverrides:
        """The method's own loss settings at its current parameters (its clip, KL-Cov's or the entropy bonus's
        coefficient, CE-GPPO's β, EntroPIC's α), each by the name of the ``LossSettings`` field it replaces; an
        engine applies them to its settings (``LossOverrides.apply``). The default sets none."""
        return LossOverrides()

    def loss_kwargs(self) -> dict[str, Any]:
        """The fields ``loss_overrides`` sets, by name (to read; a method overrides ``loss_overrides``)."""
        return self.loss_overrides().kwargs()

    def needs_entropy_grad(self) -> bool:
        """Whether ``policy_loss`` needs ``entropy`` with its gradient (entropy bonus)."""
        return False

    def rollout_masks(self, stats: TokenStats, advantages: Tensor, mask: Tensor) -> Masks:
        """Masks from the old-policy statistics of the whole rollout batch (once per rollout batch)."""
        return Masks()

    def resample_plan(self) -> Resample | None:
        """Extra rollouts for this step (AEPO: a temperature-adjusted second rollout of some prompts), asked once
        per step after the batch is scored; None (the default): none."""
        return None

    def splice_rows(self, advantages: Tensor) -> tuple[Tensor, float]:
        """Given the extra rollouts' sequence advantages [N] (group-normalised among themselves), the indices of
        those that replace the batch's first rollouts, in order, and the advantage they train with."""
        raise NotImplementedError(f"method {self.name!r} asks for no extra rollouts")

    def observe_update(self, logp: Tensor, mask: Tensor) -> None:
        """Called for every micro-batch of every optimizer update with its detached log-probs of the sampled
        tokens [b, T] under the policy being updated and its training mask (AEPO reads the released
        ``actor/entropy_loss`` from them); the default reads nothing."""

    def rollout_advantages(self, rewards: Tensor, advantages: Tensor, mask: Tensor) -> Tensor | None:
        """A method that is its own advantage estimator for this rollout batch (Entrocraft switches to RAFT++ or
        NSR) returns the per-token advantages [B, T] from the rollouts' ``rewards`` [B]; None (the default) keeps
        the engine's ``advantages``. Called once per rollout batch, after ``observe`` and before
        ``rollout_masks``, which then sees these advantages."""
        return None

    def observe(self, stats: TokenStats, mask: Tensor, agg: str) -> dict[str, Any]:
        """A controller method's own control law: read this rollout batch's old-policy statistics over the
        tokens that train (``mask``; ``agg`` the loss's aggregation), update the method's state for this
        step's update, return ``control/`` metrics. Not called while the autopilot drives the method."""
        return {}

    def set_horizon(self, total_steps: int) -> None:
        """The run's length in steps, told once before training: a method whose rule moves over training
        (Entrocraft's band, FEC's schedule) has a ``total_steps`` parameter, and its 0 becomes the run's length."""
        if getattr(self, "total_steps", None) == 0:
            self.total_steps = int(total_steps)

    def state_dict(self) -> dict[str, Any]:
        """The own controller's state beyond the knob (checkpoints); empty for methods without one."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``."""

    def minibatch_masks(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        clipped: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Masks:
        """Masks from the current (detached) log-probs of one optimizer minibatch."""
        return Masks()

    def params(self) -> dict[str, Any]:
        """The current parameter values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def get_knob(self) -> float:
        """The current value of the strength knob."""
        if self.knob is None:
            raise ValueError(f"method {self.name!r} has no knob")
        return float(getattr(self, self.knob))

    def _apply_knob(self, value: float) -> None:
        setattr(self, self.knob, value)  # type: ignore[arg-type]

    def set_knob(self, value: float) -> None:
        """Set the strength knob (validated; the old value is restored if the new one is rejected)."""
        if self.knob is None:
            raise ValueError(f"method {self.name!r} has no knob")
        old = self.params()
        self._apply_knob(value)
        try:
            self.check_params()
            self.validate()
        except ValueError:
            for k, v in old.items():
                setattr(self, k, v)
            raise


_REGISTRY: dict[str, type[Method]] = {}
_ON_REGISTER: list[Callable[[type[Method]], None]] = []


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: register a ``Method`` dataclass under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, Method) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_method needs a Method dataclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a method named {cls.name!r} is already registered")
    if cls.knob_raises_entropy not in (-1, 0, 1) or (cls.knob is None) != (cls.knob_raises_entropy == 0):
        raise ValueError(f"{cls.name}: knob_raises_entropy must be ±1 with a knob and 0 without one")
    from entropy_rft.control.lens import quadrant_effects

    quadrant_effects(cls.quadrants)  # unknown quadrant names fail at registration
    if not set(cls.engines) <= {"native", "trl", "verl"} or "native" not in cls.engines:
        raise ValueError(f"{cls.name}: engines must include 'native' and name only native, trl, verl")
    new = cls.name not in _REGISTRY
    _REGISTRY[cls.name] = cls
    for fn in _ON_REGISTER if new else ():
        fn(cls)
    return cls


def on_register(fn: Callable[[type[Method]], None]) -> None:
    """Call ``fn`` with every registered method class, in name order, and with each one registered later: an
    engine that keeps its own table of the methods (verl's policy losses) holds every method, whatever the
    order in which the modules that register them are imported."""
    _ON_REGISTER.append(fn)
    for name in available_methods():
        fn(_REGISTRY[name])


def available_methods() -> list[str]:
    """Registered method names, sorted."""
    return sorted(_REGISTRY)


def get_method_class(name: str) -> type[Method]:
    """The class registered under ``name``; ValueError listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(available_methods())
        raise ValueError(f"unknown method {name!r}; known methods: {known}") from None


def _fields(cls: type[Method]) -> tuple[dataclasses.Field[Any], ...]:
    """The dataclass fields of a registered method class (``register_method`` takes dataclasses only; ``Method``
    itself is no dataclass, so its type says nothing of them)."""
    return dataclasses.fields(cast("type[Any]", cls))


def build_method(name: str, **params: Any) -> Method:
    """Build a configured method. Unknown names and parameters, bad values, and a selection that declares no
    ``exchange`` across ranks (``control.exchange.exchange_problem``), and one that sets or reads what an engine it
    names does not carry (``control.carriage.carriage_problem``) raise ValueError."""
    cls = get_method_class(name)
    if (problem := exchange_problem(cls) or carriage_problem(cls)) is not None:
        raise ValueError(problem)
    accepted = [f.name for f in _fields(cls)]
    for p in params:
        if p not in accepted:
            raise ValueError(
                f"method {name!r}: unknown parameter {p!r}; accepted: {', '.join(accepted) or '(none)'}"
            )
    return cls(**params)


def method_info(name: str) -> dict[str, Any]:
    """Description of a method: params (default, type, help, choices, rule: their constraints in words), knob,
    direction, paper, doc."""
    cls = get_method_class(name)
    params, hints = [], type_hints(cls)
    for f in _fields(cls):
        params.append({
            "name": f.name,
            "type": str(f.type),
            "default": f.default,
            "help": f.metadata.get("help", ""),
            "choices": list(f.metadata["choices"]) if f.metadata.get("choices") else None,
            "rule": rule_words(f.metadata, hints.get(f.name, Any), null="None"),
        })
    direction = {1: "raises", -1: "lowers", 0: None}[cls.knob_raises_entropy]
    from entropy_rft.control.lens import quadrant_effects

    return {
        "name": cls.name,
        "summary": cls.summary,
        "paper": cls.paper,
        "stage": cls.stage,
        "knob": cls.knob,
        "knob_raises_entropy": cls.knob_raises_entropy,
        "direction": None if direction is None else f"increasing {cls.knob} {direction} entropy",
        "params": params,
        "quadrants": quadrant_effects(cls.quadrants),
        "engines": list(cls.engines),
        "algorithms": list(cls.algorithms),
        "allows_group_filter": cls.allows_group_filter,
        "exchange": cls.exchange,
        "masks": list(cls.masks),
        "reads": None if cls.reads is None else list(cls.reads),
        "doc": (cls.__doc__ or "").strip(),
    }
