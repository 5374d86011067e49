"""Constraints declared on a field, one set of words and tests for config fields and method parameters. Torch-free.

A config field (``config.fields.setting``) and a method parameter (``control.registry.param``) carry their
constraints in the dataclass field's ``metadata``:

- ``ge`` / ``gt`` / ``le`` / ``lt``: a numeric range (a field typed ``X | None`` also accepts null / None);
- ``choices``: the accepted values (``shown``: how to say them);
- ``pattern`` with ``shown``, ``empty``, ``names``: the config's text rules (see ``config.fields``);
- ``note``: words added after the rule (``(0: automatic)``);
- ``rule``: the words of a rule no range says, checked elsewhere (a method's ``validate``): shown, not tested here.

:func:`problem` says what is wrong with a value under them, in the words after the field's name (``must be >= 1,
got 0``); :func:`typed_problem` first checks the value's kind from the field's type, for values no loader has
typed (a method's parameters); :func:`rule_words` says the constraints for a help text (``>= 0``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from entropy_rft.common.options import or_list

RANGE_KEYS = ("ge", "gt", "le", "lt")


def nullable(tp: Any) -> bool:
    """Whether the type ``tp`` is ``X | None``."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _base(tp: Any) -> Any:
    """``X`` of ``X | None`` (``tp`` itself otherwise)."""
    if nullable(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def range_rule(meta: Mapping[str, Any], integer: bool) -> str | None:
    """The words of a numeric range: ``>= 1``, ``> 0``, ``in (0, 1]``, ``in [0, 1]``, ``in 0..N`` (integers)."""
    lo, hi = meta.get("ge", meta.get("gt")), meta.get("le", meta.get("lt"))
    if lo is not None and hi is not None:
        if integer and "ge" in meta and "le" in meta:
            return f"in {lo}..{hi}"
        return f"in {'[' if 'ge' in meta else '('}{lo}, {hi}{']' if 'le' in meta else ')'}"
    if lo is not None:
        return f">= {lo}" if "ge" in meta else f"> {lo}"
    if hi is not None:
        return f"<= {hi}" if "le" in meta else f"< {hi}"
    return None


def in_range(value: Any, meta: Mapping[str, Any]) -> bool:
    """Whether ``value`` lies in the range ``meta`` declares (True with none)."""
    return (("ge" not in meta or value >= meta["ge"]) and ("gt" not in meta or value > meta["gt"])
            and ("le" not in meta or value <= meta["le"]) and ("lt" not in meta or value < meta["lt"]))


def problem(value: Any, meta: Mapping[str, Any], tp: Any, null: str = "null") -> str | None:
    """What is wrong with ``value`` under the constraints ``meta`` of a field typed ``tp`` (None: nothing), in the
    words that follow the field's name; ``null`` is the word for None (``null`` in a config, ``None`` in Python)."""
    if value is None:
        return None  # null passes the type check only where the field is typed ``X | None``
    if "empty" in meta and not value.strip():
        return f"is empty; {meta['empty']}"
    if meta.get("names"):
        bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            return f"has invalid parameter name(s) {bad}; use name: value pairs"
    if "pattern" in meta and not meta["pattern"].fullmatch(value):
        return f"must be {meta['shown']}, got {value!r}"
    if "choices" in meta and value not in meta["choices"]:
        return f"must be {_choice_words(meta)}, got {value!r}"
    rule = range_rule(meta, tp is int)
    if rule is not None and not in_range(value, meta):
        note = f" {meta['note']}" if "note" in meta else ""
        return f"must be {rule}{f' or {null}' if nullable(tp) else ''}{note}, got {value}"
    return None


def _choice_words(meta: Mapping[str, Any]) -> str:
    return meta.get("shown") or or_list(tuple(str(c) for c in meta["choices"]))


def _kind(tp: Any) -> str | None:
    """The kind of value a field typed ``tp`` (or ``tp | None``) holds: a bool, an integer, a finite number."""
    return {bool: "a bool", int: "an integer", float: "a finite number"}.get(_base(tp))


def _of_kind(value: Any, kind: str) -> bool:
    if kind == "a bool":
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "an integer":
        return isinstance(value, int)
    return not isinstance(value, float) or math.isfinite(value)


def typed_problem(value: Any, meta: Mapping[str, Any], tp: Any, null: str = "None") -> str | None:
    """:func:`problem` for a value no loader has typed: a field typed ``bool``, ``int`` or ``float`` (or one of them
    ``| None``) first needs a value of that kind (bools are no numbers; numbers finite; None only where
    nullable), said with the field's range: ``must be a finite number >= 0, got 'big'``; a choice is not None
    either unless typed so."""
    kind = _kind(tp)
    if value is None and kind is None and "choices" in meta and not nullable(tp):
        return f"must be {_choice_words(meta)}, got None"
    if kind is not None and not (value is None and nullable(tp)) and not _of_kind(value, kind):
        rule = range_rule(meta, _base(tp) is int)
        return f"must be {kind}{f' {rule}' if rule else ''}{f' or {null}' if nullable(tp) else ''}, got {value!r}"
    return problem(value, meta, tp, null)


def rule_words(meta: Mapping[str, Any], tp: Any, null: str = "null") -> str | None:
    """The constraints of a field in words, for a help text: its range (``in [0, 1] or None``, with its note), its
    choices (``exp or linear``) and its ``rule``, joined by ``; ``; None when it declares none."""
    parts = []
    rule = range_rule(meta, _base(tp) is int)
    if rule is not None:
        note = f" {meta['note']}" if "note" in meta else ""
        parts.append(f"{rule}{f' or {null}' if nullable(tp) else ''}{note}")
    if meta.get("choices"):
        parts.append(_choice_words(meta))
    if meta.get("rule"):
        parts.append(meta["rule"])
    return "; ".join(parts) or None


def type_hints(cls: type) -> dict[str, Any]:
    """The resolved types of a dataclass's fields (``typing.get_type_hints``); a class whose annotations do not
    resolve (a name only its defining function knew) gives each field's annotation as written. Cached per class."""
    # a plain function over the cached one: mypy takes a class object (``type[X]``) for no ``Hashable``, the
    # argument type of a ``functools.cache`` wrapper, so callers passing ``type(obj)`` would not type-check
    return _type_hints(cls)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {f.name: f.type for f in dataclasses.fields(cls)}
