"""Comma lists on a command line (``--methods none,clip_v``, ``--pass-k 1,4``): their items, refused in one line
naming the flag when an item is empty, repeated or (for integers) not a number. Torch-free; moved from
``training.preflight``, for the commands (``erft compare``, ``erft eval``, ``erft probe``).
"""

from __future__ import annotations

from entropy_rft.common.errors import UserError


def comma_items(text: str | None, flag: str, example: str) -> list[str]:
    """The items of a comma list (``--methods none,clip_v``), stripped, in the order given. Refused in one line
    naming ``flag`` when it is empty, has an empty item (``a,,b``, a comma at an end) or repeats an item;
    ``example`` is the fix shown."""
    text = "" if text is None else str(text)
    if not text.strip():
        raise UserError(f"{flag} is empty; give e.g. {example}")
    items = [item.strip() for item in text.split(",")]
    if "" in items:
        raise UserError(f"{flag} '{text}' has an empty item (two commas in a row, or one at an end); give e.g. "
                        f"{example}")
    dup = sorted({item for item in items if items.count(item) > 1})
    if dup:
        raise UserError(f"{flag} '{text}' gives {', '.join(dup)} twice; give each once, e.g. {example}")
    return items


def parse_int_list(text: str | None, flag: str, example: str) -> list[int]:
    """A comma list of integers (``--pass-k 1,4``), in the order given: :func:`comma_items`, each an integer,
    none repeated (``2,02``)."""
    values: list[int] = []
    for item in comma_items(text, flag, example):
        try:
            value = int(item)
        except ValueError:
            raise UserError(f"{flag} '{text}': {item!r} is not an integer; give a comma list of integers, e.g. "
                            f"{example}") from None
        if value in values:
            raise UserError(f"{flag} '{text}' gives {value} twice; give each value once, e.g. {example}")
        values.append(value)
    return values
