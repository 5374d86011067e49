"""Foreign text shown, never obeyed: one function per place where text from a log, a run directory or a dataset
lands.

- the terminal: :func:`visible` writes every control character (C0 and C1 controls, DEL, the line and paragraph
  separators and the bidirectional overrides) as its escape, so an ESC or BEL from a metric key, a run name or a
  ``model.name`` cannot set a title, clear the screen, make a link or forge a line;
- matplotlib: :func:`mathtext_literal` escapes ``$`` (two of them start mathtext, and a bad formula fails the figure);
- a markdown table: :func:`table_cell` escapes ``|`` and makes line breaks visible, so a cell stays one cell.
"""

from __future__ import annotations

import re

__all__ = ["mathtext_literal", "table_cell", "visible"]

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    ch = m.group()
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def visible(text: object) -> str:
    """``text`` with every control character written as its escape (``\\x1b``, ``\\x07``, ``\\x0a``,
    ``\\u202e``), so printing it moves no cursor, rings no bell and starts no new line; other text unchanged."""
    return _CONTROL.sub(_escape, str(text))


def mathtext_literal(text: object) -> str:
    """``text`` as matplotlib draws it literally: each ``$`` escaped (``\\$``), so a name such as
    ``qwen_$lr_$bs`` is not read as a formula (apply it last: after any wrapping of the text)."""
    return str(text).replace("$", r"\$")


def table_cell(text: object) -> str:
    """``text`` as one cell of a markdown table: ``|`` escaped (``\\|``) and line breaks and other control
    characters written as their escapes."""
    return visible(text).replace("|", r"\|")


def table_row_cells(line: str) -> list[str]:
    """The cells of one markdown table row, split at the ``|`` that :func:`table_cell` left unescaped, each
    stripped and with ``\\|`` read back as ``|``."""
    return [c.strip().replace(r"\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
