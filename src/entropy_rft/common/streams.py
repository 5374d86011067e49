"""Reading a file someone else wrote, with bounds: the one shared reader of foreign and user files.

- :func:`open_regular` opens only a regular file: a FIFO (which would block), a device (``/dev/zero`` never
  ends), a socket or a link to one of them is one :class:`~entropy_rft.common.errors.UserError` line, at once;
- :func:`lines` reads it line by line in bounded memory: a line over ``max_line`` bytes is skipped (and counted)
  without being held, and an unfinished last line (no newline: a writer still at work, or a kill mid-write) is
  left out and counted, never read as a value cut short;
- :func:`parse_json` is ``json.loads`` with a document nested too deep for Python's parser (``RecursionError``)
  raised as the ``ValueError`` of any other malformed JSON, so every caller's ``except ValueError`` holds.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from entropy_rft.common.errors import UserError

__all__ = ["LineCounts", "MAX_LINE_BYTES", "lines", "open_regular", "parse_json", "regular_problem", "text_lines"]

MAX_LINE_BYTES = 16 << 20  # a longer line is no log line: skipped, never held whole
_CHUNK = 1 << 20


def parse_json(text: str | bytes) -> Any:
    """``json.loads(text)``; a document nested too deep (``RecursionError``) raises ``ValueError`` as any other
    malformed JSON does."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None


def _kind(mode: int) -> str:
    return ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a file")


def regular_problem(path: str | os.PathLike) -> str | None:
    """None for an existing regular file (a link to one counts); else what it is, in a few words ("not a regular
    file: a device"), without opening it (``stat`` never blocks on a FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "not found"
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    return None if stat.S_ISREG(mode) else f"not a regular file ({_kind(mode)})"


def open_regular(path: str | os.PathLike, what: str = "") -> IO[bytes]:
    """``path`` opened for binary reading when it is a regular file; else one ``UserError`` line naming it
    (``what``: how the command calls the file, e.g. "dataset file"). Opened without blocking (a FIFO
    swapped in after the check is still refused), then checked on the open descriptor."""
    name = f"{what} '{path}'" if what else str(path)
    problem = regular_problem(path)
    if problem is not None:
        raise UserError(f"{name}: {problem}; give the file itself")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise UserError(f"{name}: cannot be read ({e.strerror or type(e).__name__})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UserError(f"{name}: not a regular file ({_kind(mode)}); give the file itself")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


@dataclass
class LineCounts:
    """What :func:`lines` left out: lines over the length bound, and an unfinished last line (0 or 1)."""

    too_long: int = 0
    unfinished: int = 0


def lines(f: IO[bytes], counts: LineCounts | None = None, *, max_line: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The complete lines of a binary file, without their newline, each at most ``max_line`` bytes: a longer line
    is skipped (``counts.too_long``) and an unfinished last line (no newline at the end) left out
    (``counts.unfinished``). Memory: one line (or ``max_line``) at a time."""
    counts = counts if counts is not None else LineCounts()
    while True:
        line = f.readline(max_line + 1)
        if not line:
            return
        if line.endswith(b"\n"):
            yield line[:-1]
            continue
        if len(line) <= max_line:  # the end of the file, with no newline: a line still being written
            counts.unfinished += 1
            return
        counts.too_long += 1  # skip the rest of this line in chunks
        while True:
            rest = f.readline(_CHUNK)
            if not rest:
                return
            if rest.endswith(b"\n"):
                break


def text_lines(path: Path, counts: LineCounts | None = None, what: str = "") -> Iterator[str]:
    """:func:`lines` of a regular file (``open_regular``), decoded as UTF-8 (a bad byte replaced)."""
    with open_regular(path, what) as f:
        for raw in lines(f, counts):
            yield raw.decode("utf-8", errors="replace")
