"""The entropy autopilot: hold policy entropy at a target by moving a method's strength knob.

Every method that declares a knob in the registry (``Method.knob``, with ``knob_raises_entropy`` = +1 or
-1) can be steered: ClipB/ClipV ``mu``, Clip-Cov/KL-Cov ``ratio``, the entropy bonus ``coef``,
high_entropy ``top_q``, clip-higher ``eps_high``. Nothing here knows a method by name.

The controller (one call per training step, before the method's masks are built):

1. measure ``H`` = mean token entropy of the step's rollout batch (old policy, all response tokens) and
   smooth it, ``H_s <- ema * H + (1 - ema) * H_s`` (the first step takes ``H`` as is);
2. the relative error ``e = (H* - H_s) / H*``, with ``H*`` the target at this step (a number or a schedule);
3. position-form PI in log-knob space around the starting knob ``k0``:
   ``u = log k0 + d * (kp * e + ki * I)``, ``d`` = ``knob_raises_entropy``; ``I`` sums ``e`` only while
   ``|e| <= i_zone`` (integral separation: far from the target the approach speed is set by the policy,
   and integrating there only winds up) and never while the knob sits at a clamp and ``e`` pushes further
   (anti-windup);
4. ``u`` moves at most ``max_step`` per step and stays in ``[log knob_min, log knob_max]``; the default range
   is ``[k0 / span, k0 * span]``, cut to the values the method's own validation accepts (found by bisection,
   so fractions such as ``ratio`` stay <= 1 without naming them); with ``edge_clamp`` (the default) the end
   toward lower entropy is also cut, each step, at the batch's *activity edge* (``activity_edge``): the knob
   value past which a masking method drops no token. Past it the knob changes nothing, so the controller
   treats it as a clamp (no integral behind it), and when entropy falls the method acts from the next step
   instead of after the steps of ``max_step`` it takes to climb out of that dead zone;
5. the method's knob becomes ``exp(u)``.

Logged each step: ``control/knob``, ``control/entropy_error`` (``H* - H_s``, nats), ``control/entropy_target``,
``control/entropy_smoothed``, ``control/integral``, ``control/knob_edge`` and ``control/saturated`` (+1 / -1:
the knob pushes entropy up / down as hard as it can, at an end of its range or moving by the whole
``max_step``; ``saturation``). ``state_dict``/``load_state_dict`` go into checkpoints.

What it promises, and what no controller of one knob can: ``tracking`` reads the smoothed entropy after it
first reaches the target; a step outside ±15% counts against the controller (``out_with_room``) only when the
knob still had room toward the correction. A method such as ClipV can only raise entropy (at its edge the run
is plain GRPO) and only by so much (its push saturates when it drops every token it may), so where the policy's
own swings outrun that, the entropy leaves the band with the knob at its limit.

Targets: a number (nats); ``"0.6x"`` (0.6 times the entropy of the first training batch, i.e. the base
policy); ``"linear:H0:H1[:N]"`` or ``"cosine:H0:H1[:N]"`` (from H0 at step 1 to H1 at step N, default the
run's last step, then held); or a mapping ``{kind: linear, start: H0, end: H1, steps: N}`` /
``{kind: constant, value: H}``. H0, H1 may be relative (``"0.9x"``) too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from entropy_rft.common.errors import UserError

KINDS = ("constant", "linear", "cosine")


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Level:
    """An entropy level: ``value`` nats, or ``value`` × the base entropy when ``relative``."""

    value: float
    relative: bool = False

    def resolve(self, base: float | None) -> float:
        if not self.relative:
            return self.value
        if base is None:
            raise ValueError("a relative entropy target needs the base entropy (measured on the first step)")
        return self.value * base

    def __str__(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g}"


@dataclass(frozen=True)
class TargetSchedule:
    """Entropy target per training step (steps count from 1)."""

    kind: str
    start: Level
    end: Level
    steps: int | None = None  # the step at which ``end`` is reached; None = the run's max_steps

    @property
    def relative(self) -> bool:
        return self.start.relative or self.end.relative

    def at(self, step: int, max_steps: int, base: float | None = None) -> float:
        h0, h1 = self.start.resolve(base), self.end.resolve(base)
        if self.kind == "constant":
            return h0
        n = self.steps if self.steps is not None else max_steps
        frac = 1.0 if n <= 1 else min(1.0, max(0.0, (step - 1) / (n - 1)))
        if self.kind == "cosine":
            frac = 0.5 * (1.0 - math.cos(math.pi * frac))
        return h0 + (h1 - h0) * frac

    def __str__(self) -> str:
        if self.kind == "constant":
            return str(self.start)
        tail = "" if self.steps is None else f":{self.steps}"
        return f"{self.kind}:{self.start}:{self.end}{tail}"


def _level(raw: Any, field: str) -> Level:
    rel = False
    val = raw
    if isinstance(raw, str):
        s = raw.strip().lower()
        if s.endswith("x"):
            rel, s = True, s[:-1]
        try:
            val = float(s)
        except ValueError:
            raise UserError(f"config field '{field}': {raw!r} is not an entropy level (a number of nats such as "
                            "0.43, or a multiple of the base entropy such as 0.6x)") from None
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
        raise UserError(f"config field '{field}': entropy level must be a finite number > 0, got {raw!r}")
    return Level(float(val), rel)


def _steps(raw: Any, field: str) -> int | None:
    if raw is None:
        return None
    try:
        n = int(raw) if not isinstance(raw, bool) and float(raw) == int(float(raw)) else None
    except (TypeError, ValueError):
        n = None
    if n is None or n < 1:
        raise UserError(f"config field '{field}': schedule length must be an integer >= 1, got {raw!r}")
    return n


def parse_target(spec: Any, field: str = "method.entropy_target") -> TargetSchedule | None:
    """Parse an entropy target: number, ``"0.6x"``, ``"linear:H0:H1[:N]"``, ``"cosine:..."`` or a mapping.

    None means no autopilot. Bad specs raise UserError naming ``field``.
    """
    if spec is None:
        return None
    if isinstance(spec, dict):
        kind = str(spec.get("kind", "linear" if "start" in spec else "constant"))
        known = {"kind", "value", "start", "end", "steps"}
        extra = set(spec) - known
        if extra:
            raise UserError(f"config field '{field}': unknown key(s) {sorted(extra)}; use kind, value, start, "
                            "end, steps")
        if kind not in KINDS:
            raise UserError(f"config field '{field}': kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == "constant":
            if "value" not in spec:
                raise UserError(f"config field '{field}': a constant target needs 'value'")
            lv = _level(spec["value"], field)
            return TargetSchedule("constant", lv, lv)
        if "start" not in spec or "end" not in spec:
            raise UserError(f"config field '{field}': a {kind} schedule needs 'start' and 'end'")
        return TargetSchedule(kind, _level(spec["start"], field), _level(spec["end"], field),
                              _steps(spec.get("steps"), field))
    if isinstance(spec, str) and ":" in spec:
        parts = [p.strip() for p in spec.split(":")]
        kind = parts[0].lower()
        if kind not in ("linear", "cosine") or len(parts) not in (3, 4):
            raise UserError(f"config field '{field}': schedule {spec!r} must look like linear:H0:H1 or "
                            "linear:H0:H1:STEPS (or cosine:...)")
        return TargetSchedule(kind, _level(parts[1], field), _level(parts[2], field),
                              _steps(parts[3], field) if len(parts) == 4 else None)
    lv = _level(spec, field)
    return TargetSchedule("constant", lv, lv)


# ----------------------------------------------------------------------------- the controller


def methods_with_knobs() -> list[str]:
    from entropy_rft.control.registry import available_methods, method_info

    return [f"{n} ({method_info(n)['knob']})" for n in available_methods()
            if method_info(n)["knob"]]


def check_steerable(method, field: str = "method.entropy_target") -> float:
    """The method's starting knob value; UserError when it has no knob or the knob cannot be steered."""
    if method.knob is None:
        raise UserError(f"config field '{field}': method {method.name!r} has no strength knob, so it cannot "
                        f"follow an entropy target; methods with one: {', '.join(methods_with_knobs())}")
    try:
        k0 = method.get_knob()
    except ValueError as err:
        raise UserError(f"config field '{field}': {err}") from None
    if not (math.isfinite(k0) and k0 > 0):
        raise UserError(f"config field '{field}': the autopilot moves {method.name}'s knob {method.knob!r} in log "
                        f"space, so its starting value must be > 0 (got {k0}); set method.params.{method.knob}")
    return k0


def _accepts(method, value: float) -> bool:
    old = method.get_knob()
    try:
        method.set_knob(value)
    except ValueError:
        return False
    method.set_knob(old)
    return True


def _valid_toward(method, k0: float, want: float) -> float:
    """``want`` if the method accepts it, else the accepted value closest to it between k0 and want."""
    if _accepts(method, want):
        return want
    good, _ = _log_bisect(lambda v: _accepts(method, v), k0, want, 60)
    return math.exp(good)


def _log_bisect(holds: Callable[[float], bool], inside: float, outside: float, halvings: int) -> tuple[float, float]:
    """Bisection in log-knob space between ``inside`` (``holds`` is true there) and ``outside`` (false there):
    the last bracketing pair, as logs, after ``halvings`` halvings."""
    a, b = math.log(inside), math.log(outside)
    for _ in range(halvings):
        mid = 0.5 * (a + b)
        if holds(math.exp(mid)):
            a = mid
        else:
            b = mid
    return a, b


def activity_edge(method, acts: Callable[[], bool], lo: float, hi: float, direction: int) -> float | None:
    """The knob value in ``[lo, hi]`` at which ``method`` stops acting on this batch, toward lower entropy.

    ``acts()`` says whether the method, with its knob as now set, acts on the batch (a masking method: drops at
    least one valid token). A knob that lowers entropy when it moves (``direction`` = ``knob_raises_entropy``)
    weakens the method; past the edge it does nothing at all, a dead zone in which a controller only winds up.
    Returns None when the method does not act even at the end of the range that makes it strongest (no edge to
    find: a method that drops nothing, or a batch it leaves alone); ``hi`` (or ``lo``) when it still acts at the
    weak end. The edge is found by bisection in log space (40 halvings); the knob is restored."""
    strong, weak = (hi, lo) if direction > 0 else (lo, hi)
    old = method.get_knob()
    try:
        method.set_knob(strong)
        if not acts():
            return None
        method.set_knob(weak)
        if acts():
            return weak
        def acts_at(value: float) -> bool:
            method.set_knob(value)
            return acts()

        _, b = _log_bisect(acts_at, strong, weak, 40)  # acts at the strong end, not at the weak one
        return math.exp(b)
    finally:
        method.set_knob(old)


def saturation(u: float, u_prev: float, lo: float, hi: float, max_step: float, direction: int) -> int:
    """Whether the knob, set to ``exp(u)`` this step (from ``exp(u_prev)``), pushes as hard as it can: +1 toward
    higher entropy (at that end of ``[lo, hi]`` or moved by the full ``max_step`` that way), -1 toward lower
    entropy (likewise; the activity edge is that end when it binds), 0 otherwise. All in log-knob space;
    ``direction`` = ``knob_raises_entropy``."""
    tol = 1e-9
    raise_end, lower_end = (hi, lo) if direction > 0 else (lo, hi)
    moved = direction * (u - u_prev)  # > 0: toward higher entropy
    if abs(u - raise_end) <= tol or moved >= max_step - tol:
        return 1
    if abs(u - lower_end) <= tol or moved <= -max_step + tol:
        return -1
    return 0


class Autopilot:
    """PI controller on measured entropy that sets ``method``'s knob each step (see the module docstring).

    ``gains``: the ``autopilot.*`` settings (``config.schema.AutopilotConfig``: kp, ki, ema, max_step, i_zone,
    span, knob_min, knob_max)."""

    def __init__(self, method, target: TargetSchedule, gains: Any, max_steps: int):
        self.method, self.target, self.g, self.max_steps = method, target, gains, max_steps
        self.direction = int(method.knob_raises_entropy)
        self.k0 = check_steerable(method)
        lo = gains.knob_min if gains.knob_min is not None else self.k0 / gains.span
        hi = gains.knob_max if gains.knob_max is not None else self.k0 * gains.span
        if not 0 < lo <= self.k0 <= hi:
            raise UserError(f"config field 'autopilot.knob_min': need 0 < knob_min <= starting {method.knob} "
                            f"({self.k0:g}) <= knob_max, got [{lo:g}, {hi:g}]")
        self.lo, self.hi = _valid_toward(method, self.k0, lo), _valid_toward(method, self.k0, hi)
        self.integral = 0.0
        self.u = math.log(self.k0)
        self.smoothed: float | None = None
        self.base: float | None = None

    def edge(self, acts: Callable[[], bool]) -> float | None:
        """This batch's activity edge (``activity_edge``) within the knob's range, or None when
        ``autopilot.edge_clamp`` is off."""
        if not self.g.edge_clamp:
            return None
        return activity_edge(self.method, acts, self.lo, self.hi, self.direction)

    def target_at(self, step: int) -> float:
        return self.target.at(step, self.max_steps, self.base)

    def update(self, step: int, measured: float | None, edge: float | None = None) -> dict[str, float | None]:
        """Read this step's measured entropy, set the knob for this step's update, return the metrics.

        ``edge``: the knob value at which the method stops acting on this batch (``activity_edge``), or None.
        Past it, toward lower entropy, the knob changes nothing, so it is a clamp like the range's own."""
        g = self.g
        if measured is None or not math.isfinite(measured):  # nothing measured: hold the knob
            return {"control/knob": math.exp(self.u), "control/entropy_error": None,
                    "control/entropy_target": None if self.base is None and self.target.relative
                    else self.target_at(step), "control/entropy_smoothed": self.smoothed,
                    "control/integral": self.integral, "control/knob_edge": edge, "control/saturated": None}
        if self.base is None:
            self.base = float(measured)
        self.smoothed = measured if self.smoothed is None else g.ema * measured + (1 - g.ema) * self.smoothed
        target = self.target_at(step)
        e = (target - self.smoothed) / target
        u0, lo, hi = math.log(self.k0), math.log(self.lo), math.log(self.hi)
        if edge is not None and edge > 0:
            if self.direction < 0:
                hi = max(lo, min(hi, math.log(edge)))
            else:
                lo = min(hi, max(lo, math.log(edge)))
        integral = self.integral + e if abs(e) <= g.i_zone else self.integral
        u_want = u0 + self.direction * (g.kp * e + g.ki * integral)
        pushing_out = (u_want > hi and self.direction * e > 0) or (u_want < lo and self.direction * e < 0)
        if pushing_out:  # anti-windup: the clamp holds, the integral does not grow behind it
            integral = self.integral
            u_want = u0 + self.direction * (g.kp * e + g.ki * integral)
        self.integral = integral
        u = min(max(u_want, self.u - g.max_step), self.u + g.max_step)
        u_prev, self.u = self.u, min(max(u, lo), hi)
        self.method.set_knob(math.exp(self.u))
        return {"control/knob": self.method.get_knob(), "control/entropy_error": target - self.smoothed,
                "control/entropy_target": target, "control/entropy_smoothed": self.smoothed,
                "control/integral": self.integral, "control/knob_edge": edge,
                "control/saturated": saturation(self.u, u_prev, lo, hi, g.max_step, self.direction)}

    def state_dict(self) -> dict[str, Any]:
        return {"integral": self.integral, "u": self.u, "smoothed": self.smoothed, "base": self.base}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.integral, self.u = float(st["integral"]), float(st["u"])
        self.smoothed, self.base = st["smoothed"], st["base"]
        self.method.set_knob(math.exp(self.u))


# ----------------------------------------------------------------------------- how well a run tracked


def tracking(steps: list[int], entropy: list[float], target: list[float], band: float = 0.15,
             saturated: list[int | None] | None = None) -> dict[str, Any]:
    """How a run followed its target: the first step at which the measured entropy reaches the target (crosses
    it from where it started), then over the rest of the run the largest relative deviation, the fraction of
    steps within ±band, ``out_of_band`` (the number of steps outside it) and ``length_ratio`` = last step /
    reach step (the acceptance asks for >= 3).

    With ``saturated`` (``control/saturated`` per step), ``out_with_room`` counts the steps outside the band at
    which the knob still had room toward the correction (below the band and not +1, above it and not -1): the
    excursions the controller could have fought harder. The others happened with the method pushing as hard as
    its knob allows (at the end of its range, at the activity edge, or moving at ``max_step``)."""
    out: dict[str, Any] = {"reach_step": None, "max_rel_dev_after": None, "in_band_frac_after": None,
                           "out_of_band": None, "out_with_room": None, "length_ratio": None,
                           "last_step": steps[-1] if steps else None}
    if not steps:
        return out
    side = math.copysign(1.0, entropy[0] - target[0]) if entropy[0] != target[0] else 0.0
    reach = next((i for i, (h, t) in enumerate(zip(entropy, target)) if side == 0.0 or (h - t) * side <= 0), None)
    if reach is None:
        return out
    rel = [(h - t) / t for h, t in zip(entropy[reach:], target[reach:])]
    outside = [i for i, d in enumerate(rel) if abs(d) > band]
    out.update(reach_step=steps[reach], max_rel_dev_after=max(abs(d) for d in rel),
               in_band_frac_after=sum(abs(d) <= band for d in rel) / len(rel), out_of_band=len(outside),
               length_ratio=steps[-1] / steps[reach])
    if saturated is not None:
        sat = saturated[reach:]
        out["out_with_room"] = sum(sat[i] != (1 if rel[i] < 0 else -1) for i in outside)
    return out
