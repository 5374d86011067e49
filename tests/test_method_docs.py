"""Issue 39, item 5: every list of methods in docs/ is the registry's (``control.method_docs``), so a new method
is its module, its registration line and its tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from entropy_rft import control
from entropy_rft.control import method_docs
from entropy_rft.control.registry import _REGISTRY, Method, register_method

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"cli.md": {"table"}, "trl.md": {"trl", "native-only"}, "verl.md": {"verl", "native-only"}}


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_method_list_in_the_docs_is_the_registrys(page):
    text = (ROOT / "docs" / page).read_text()
    assert set(method_docs.sections_of(text)) == PAGES[page]
    assert method_docs.rewrite(text) == text, (
        f"docs/{page}: a method list differs from the registry; run python -m entropy_rft.control.method_docs")


def test_no_other_page_lists_every_method_by_hand():
    names = control.available_methods()
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for kind in method_docs.sections_of(text):  # the generated sections themselves may list them
            b, e = method_docs.BEGIN.format(kind), method_docs.END.format(kind)
            text = text[: text.index(b)] + text[text.index(e):]
        for line in text.splitlines():
            listed = [n for n in names if f"`{n}`" in line]
            assert len(listed) < 8 or line.startswith("|"), f"{page.name}: a hand-written method list: {line[:120]}"


def test_a_new_method_appears_in_every_list_it_belongs_to():
    @register_method
    @dataclass
    class DocsProbe(Method):
        name: ClassVar[str] = "docs_probe"
        paper: ClassVar[str] = "Nobody 2026"
        summary: ClassVar[str] = "a | pipe in its summary"
        engines: ClassVar[tuple[str, ...]] = ("native",)

    try:
        text = "x\n<!-- methods:table:begin -->\n<!-- methods:table:end -->\n" \
               "<!-- methods:native-only:begin -->\nSTALE-LIST\n<!-- methods:native-only:end -->\n"
        out = method_docs.rewrite(text)
        assert "| `docs_probe` | a \\| pipe in its summary | native | Nobody 2026 |" in out
        assert "`docs_probe`" in out.split("methods:native-only:begin")[1] and "STALE-LIST" not in out
        with pytest.raises(ValueError, match="unknown method section 'nope'"):
            method_docs.rewrite("<!-- methods:nope:begin -->\n<!-- methods:nope:end -->")
    finally:
        _REGISTRY.pop("docs_probe")
