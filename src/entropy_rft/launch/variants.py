"""The variants of a sweep (``erft compare --methods``): a method name, optionally with parameters and an
entropy target::

    none                      the vanilla baseline
    clip_v:mu=1.5             ClipV with mu fixed at 1.5 (any method parameter: name:key=value[:key=value])
    clip_v@target=0.43        ClipV steered by the autopilot to entropy 0.43 (also @0.6x, @linear:0.6:0.3)
    clip_v:mu=3@target=0.6x   the same, starting the controller from mu = 3

The entry is the variant's label in the run-directory name, the summary table and the report.
``expand_variants`` crosses the entries (``all``: every registered method) with ``--entropy-targets``.

Imports nothing heavy at load: the method registry, the autopilot's target parser and the comma-list check are
imported where they are used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from entropy_rft.common.errors import UserError


@dataclass
class Variant:
    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    target: Any = None

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=@+-]", "_", self.label)

    def method_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"name": self.name}
        if self.params:
            extra["params"] = self.params
        if self.target is not None:
            extra["entropy_target"] = self.target
        if self.params or self.target is not None:
            extra["label"] = self.label
        return extra


def parse_variant(spec: str) -> Variant:
    """``name[:key=value...][@[target=]TARGET]`` -> Variant; values are read as YAML (numbers, null)."""
    spec = spec.strip()
    head, at, target = spec.partition("@")
    parts = [p.strip() for p in head.split(":")]
    if not parts[0]:
        raise UserError(f"--methods entry {spec!r} has no method name; e.g. clip_v, clip_v:mu=1.5, clip_v@target=0.43")
    params: dict[str, Any] = {}
    for kv in parts[1:]:
        key, eq, raw = kv.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--methods entry {spec!r}: {kv!r} must look like param=value (e.g. clip_v:mu=1.5)")
        if key.strip() in params:
            raise UserError(f"--methods entry {spec!r} sets {key.strip()} twice; give it once")
        try:
            params[key.strip()] = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            params[key.strip()] = raw
    value = None
    if at:
        target = target.strip()
        if target.startswith("target="):
            target = target[len("target="):]
        if not target:
            raise UserError(f"--methods entry {spec!r}: empty entropy target after '@' (e.g. clip_v@target=0.43)")
        value = checked_target(target, f"--methods entry {spec!r}")
    return Variant(spec, parts[0], params, value)


def target_value(raw: str) -> float | str:
    """A number stays a number; anything else (0.6x, linear:0.6:0.3) is a schedule string for the config."""
    try:
        return float(raw)
    except ValueError:
        return raw.strip()


def checked_target(text: str, where: str) -> float | str:
    """An entropy target as the config takes it (:func:`target_value`), checked by the autopilot's parser; a bad
    one is refused naming ``where`` (the flag or entry it came from)."""
    from entropy_rft.control.autopilot import parse_target

    value = target_value(text)
    try:
        parse_target(value, field=where)
    except UserError as e:
        raise UserError(str(e).replace(f"config field '{where}'", where)) from None
    return value


PRESET = "preset"


def knob_of(name: str) -> str | None:
    """The method's strength knob (None: none, grad_mask); unknown names list the registered ones."""
    from entropy_rft.control.registry import get_method_class

    try:
        return get_method_class(name).knob
    except ValueError as e:
        raise UserError(f"--methods: {e}") from None


def expand_variants(methods: str, targets: str | None) -> list[Variant]:
    """The variants of ``--methods`` (``all``: every registered method) crossed with ``--entropy-targets``.

    Without targets each entry is one variant as written. With targets, every method that has a knob gets one
    ``name@T`` variant per setpoint ``T`` (``preset``: the method as configured), a method without a knob runs
    at its preset, and ``none`` is always there as the reference. Entries that already carry parameters or a
    target are kept as written.
    """
    from entropy_rft.common.comma_lists import comma_items
    from entropy_rft.control.registry import available_methods

    entries = comma_items(methods, "--methods", "none,clip_v")
    if "all" in entries:
        i = entries.index("all")
        named = set(entries)
        entries = entries[:i] + [m for m in available_methods() if m not in named] + entries[i + 1:]
    if targets is None:
        return [parse_variant(m) for m in entries]
    points = comma_items(targets, "--entropy-targets", "preset,0.5x,0.65x,0.8x")
    for t in points:
        if t != PRESET:
            checked_target(t, f"--entropy-targets {t!r}")
    steerable = [e for e in entries if ":" not in e and "@" not in e and knob_of(e) is not None]
    if not steerable:
        raise UserError(f"--entropy-targets: none of --methods {methods!r} has a knob the autopilot can steer; "
                        "add one such as clip_v (`erft methods` lists the knobs), or leave out --entropy-targets")
    out: list[Variant] = [] if "none" in entries else [parse_variant("none")]
    for entry in entries:
        if ":" in entry or "@" in entry or knob_of(entry) is None:
            out.append(parse_variant(entry))
            continue
        for t in points:
            out.append(parse_variant(entry if t == PRESET else f"{entry}@{t}"))
    return out
