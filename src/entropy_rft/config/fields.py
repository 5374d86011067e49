"""Config fields: each field's help text and constraints declared together, and the one loop that checks them.

``setting(default, help, ge=1)`` declares a dataclass field whose ``metadata`` holds its help text (shown by
``erft train --help-config``) and its constraints:

- ``ge`` / ``gt`` / ``le`` / ``lt``: a numeric range (a field typed ``X | None`` also accepts null);
- ``choices``: the accepted values;
- ``pattern`` with ``shown``: a regular expression the whole value must match, and how to say it;
- ``empty``: the value must not be blank; the text is the fix to show;
- ``names``: a mapping whose keys must be parameter names (identifiers);
- ``check``: a function ``(value, field name) -> value`` for a rule none of these says (it raises the
  :class:`~entropy_rft.common.errors.UserError` itself and may normalise the value);
- ``note``: words added after the rule (``(0: automatic)``).

:func:`check_fields` walks a dataclass (nested sections included) and raises the first violation as one line
``config field 'section.name' must be >= 1, got 0``. Types are checked earlier, when a mapping becomes the
dataclass (``config.loading``). The words and tests of the constraints are :mod:`entropy_rft.common.constraints`,
shared with the methods' parameters (``control.registry.param``). Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

from entropy_rft.common.constraints import problem, type_hints
from entropy_rft.common.errors import UserError


def setting(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, choices: tuple | None = None, pattern: re.Pattern | None = None,
            shown: str | None = None, empty: str | None = None, names: bool = False,
            check: Callable[[Any, str], Any] | None = None, note: str = "") -> Any:
    """A dataclass field with its help text and constraints (see the module docstring)."""
    meta: dict[str, Any] = {"help": help}
    given = dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, pattern=pattern, shown=shown, empty=empty,
                 names=names or None, check=check, note=note or None)
    meta.update({k: v for k, v in given.items() if v is not None})
    if isinstance(default, (dict, list)):
        return field(default_factory=functools.partial(type(default), default), metadata=meta)  # a fresh copy
    return field(default=default, metadata=meta)


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, for an error line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check every field of the dataclass ``obj`` (and of its nested sections) against its constraints, in the
    order they are declared; a field's ``check`` function may replace its value (``optim.betas`` become floats).
    Raises the first violation as a one-line :class:`UserError` naming the field."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            check_fields(value, f"{name}.")
            continue
        msg = problem(value, f.metadata, hints[f.name])
        if msg is not None:
            raise UserError(f"config field '{name}' {msg}")
        if "check" in f.metadata:
            setattr(obj, f.name, f.metadata["check"](value, name))
