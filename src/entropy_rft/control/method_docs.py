"""The lists of methods in docs/, written from the registry: a new method is its module, its registration line and
its tests, and every page that lists methods shows it (``tests/test_method_docs.py`` checks each section).

A page holds a section between ``<!-- methods:KIND:begin -->`` and ``<!-- methods:KIND:end -->``; ``SECTIONS`` maps
each KIND to the text the registry gives. ``python -m entropy_rft.control.method_docs [DOCS_DIR]`` rewrites every
section in place.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from entropy_rft.control.registry import Method, available_methods, get_method_class

BEGIN, END = "<!-- methods:{}:begin -->\n", "<!-- methods:{}:end -->"


def _names(keep: Callable[[type[Method]], bool]) -> list[str]:
    return [n for n in available_methods() if keep(get_method_class(n))]


def _code_list(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) + "\n"


def methods_table() -> str:
    """Every method: its summary, the engines whose loss path carries it, its paper."""
    rows = ["| method | what it does | engines | paper |", "|---|---|---|---|"]
    for n in available_methods():
        cls = get_method_class(n)
        summary = cls.summary.replace("|", "\\|")
        rows.append(f"| `{n}` | {summary} | {', '.join(cls.engines)} | {cls.paper or '–'} |")
    return "\n".join(rows) + "\n"


SECTIONS: dict[str, Callable[[], str]] = {
    "table": methods_table,
    "all": lambda: _code_list(available_methods()),
    "trl": lambda: _code_list(_names(lambda c: "trl" in c.engines)),
    "verl": lambda: _code_list(_names(lambda c: "verl" in c.engines)),
    "native-only": lambda: _code_list(_names(lambda c: tuple(c.engines) == ("native",))),
}


def sections_of(text: str) -> list[str]:
    """The KINDs of the method sections a page holds, in order."""
    return re.findall(r"<!-- methods:([\w-]+):begin -->", text)


def rewrite(text: str) -> str:
    """``text`` with every method section replaced by the registry's."""
    for kind in sections_of(text):
        if kind not in SECTIONS:
            raise ValueError(f"unknown method section {kind!r}; known: {', '.join(SECTIONS)}")
        begin, end = BEGIN.format(kind), END.format(kind)
        i, j = text.index(begin) + len(begin), text.index(end)
        text = text[:i] + SECTIONS[kind]() + text[j:]
    return text


def main(argv: list[str] | None = None) -> int:
    """Rewrite the method sections of every page under DOCS_DIR (default: ./docs) and README.md beside it."""
    argv = sys.argv[1:] if argv is None else argv
    docs = Path(argv[0] if argv else "docs")
    for page in [*sorted(docs.glob("*.md")), docs.parent / "README.md"]:
        if page.is_file() and sections_of(text := page.read_text()):
            new = rewrite(text)
            if new != text:
                page.write_text(new)
                print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
