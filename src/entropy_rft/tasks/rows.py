"""Question/answer rows of a dataset: reading them from a local ``.parquet``/``.jsonl``/``.json`` file or a
Hugging Face hub id (:func:`load_rows`), picking the two fields by a dotted column path (:func:`get_path`), and
validating them with a count of the bad ones (:func:`rows_to_pairs`, :class:`BadRows`).

Bad rows (missing or empty answer, empty prompt, wrong types) are counted, and the count with the first row
index is reported on stderr; ``on_bad_rows="skip"`` drops them, ``"error"`` refuses the dataset with a
:class:`~entropy_rft.common.errors.UserError`.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from entropy_rft.common.errors import UserError
from entropy_rft.common.streams import parse_json, regular_problem

BAD_ROW_POLICIES = ("skip", "error")
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".json")

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


_BOMS = ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))


def _decode_text(path: Path) -> str:
    """A JSON/JSONL dataset file as text: UTF-8, or the UTF-8/16/32 its byte-order mark names (editors on
    Windows write one; JSON itself may be UTF-16 or 32). Anything else is refused in one line naming the file,
    the first bad byte and the fix."""
    data = path.read_bytes()
    encoding = next((enc for bom, enc in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise UserError(f"dataset file '{path}' is not {encoding.upper().replace('-SIG', '')} text (byte "
                        f"0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8, e.g. `iconv -f LATIN1 "
                        f"-t UTF-8 {path} > fixed{path.suffix}`") from None


def _read_local(path: Path) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - any pyarrow failure is a bad file
            raise UserError(f"dataset file '{path}' is not a readable parquet file ({type(e).__name__}); "
                            "rewrite it as parquet, JSONL or JSON") from None
    text = _decode_text(path)
    if suffix == ".jsonl":
        rows: list[Any] = []
        # Lines end at "\n" only (a "\r" before it is whitespace to JSON): str.splitlines would also cut at
        # U+2028, U+0085 and the like, which JSON text may hold raw inside a string.
        for line in text.split("\n"):
            if not line.strip():
                continue
            try:
                rows.append(parse_json(line))
            except ValueError:  # not JSON, or nested too deep
                rows.append(_BadJson(line[:80]))
        return rows
    try:
        data = parse_json(text)
    except ValueError as e:
        where = f" (line {e.lineno})" if isinstance(e, json.JSONDecodeError) else f" ({e})"
        raise UserError(f"dataset file '{path}' is not valid JSON{where}; fix it or use JSONL") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:  # {"data": [...]}
            return lists[0]
        if all(isinstance(v, dict) for v in data.values()):  # {"id": {...}, ...}
            return list(data.values())
    if isinstance(data, list):
        return data
    raise UserError(f"dataset file '{path}' must hold a list of row objects (or {{'data': [...]}})")


class _BadJson(str):
    """A JSONL line that did not parse (kept so that the bad-row report can count it)."""


def load_rows(source: str, *, split: str = "train", config: str | None = None) -> list[Any]:
    """Rows (dicts) from a local parquet/JSONL/JSON file or a Hugging Face hub id."""
    p = Path(str(source)).expanduser()
    if p.suffix.lower() in LOCAL_SUFFIXES or p.exists():
        if p.is_dir():
            raise UserError(f"dataset file '{p}' is a folder; set task.params.source to a .parquet/.jsonl/.json "
                            "file in it, or a hub id")
        problem = regular_problem(p)
        if problem is not None:  # "not a regular file (a device)" for /dev/zero, a FIFO: never opened
            raise UserError(f"dataset file '{p}': {problem}; set task.params.source to an existing "
                            ".parquet/.jsonl/.json file or a hub id")
        if p.suffix.lower() not in LOCAL_SUFFIXES:
            raise UserError(f"dataset file '{p}' has an unknown type; use .parquet, .jsonl or .json")
        return _read_local(p)
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        raise UserError("reading a hub dataset needs the 'datasets' package; pip install datasets") from None
    try:
        ds = datasets.load_dataset(str(source), config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, bad split: one line for the user
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise UserError(f"cannot load hub dataset '{source}' (split '{split}'): {first}; without a network, "
                        "download it elsewhere and set task.params.source to a local parquet/JSONL/JSON file") from None
    return [dict(r) for r in ds]


_PATH_RE = re.compile(r"([^.\[\]]+)|\[(-?\d+)\]")
_MISSING = object()


def get_path(row: Any, path: str) -> Any:
    """``get_path(row, "prompt[0].content")``; a missing step gives an internal MISSING marker."""
    cur = row
    for m in _PATH_RE.finditer(path):
        key, idx = m.group(1), m.group(2)
        if key is not None:
            if not isinstance(cur, dict) or key not in cur:
                return _MISSING
            cur = cur[key]
        else:
            i = int(idx)
            if not isinstance(cur, (list, tuple)) or not -len(cur) <= i < len(cur):
                return _MISSING
            cur = cur[i]
    return cur


def clean_question(text: str, clean: str | None) -> str:
    if clean == "dapo":
        if text.startswith(DAPO_PREFIX):
            text = text[len(DAPO_PREFIX):]
        if text.endswith(DAPO_SUFFIX):
            text = text[: -len(DAPO_SUFFIX)]
    return text.strip()


@dataclass
class BadRows:
    """What was wrong with a dataset's rows: a count per reason and the first row index."""

    source: str
    total: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    first: int | None = None
    first_reason: str = ""

    def add(self, index: int, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if self.first is None:
            self.first, self.first_reason = index, reason

    @property
    def n_bad(self) -> int:
        return sum(self.counts.values())

    def message(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        return (f"dataset '{self.source}': {self.n_bad} of {self.total} rows are bad ({kinds}); "
                f"first bad row is index {self.first} ({self.first_reason})")


def _check_row(row: Any, prompt_key: str, answer_key: str, clean: str | None) -> tuple[str, str] | str:
    """(question, answer) or the reason the row is bad."""
    if isinstance(row, _BadJson):
        return "invalid JSON line"
    if not isinstance(row, dict):
        return "row is not an object"
    q = get_path(row, prompt_key)
    a = get_path(row, answer_key)
    if q is _MISSING or q is None:
        return f"missing prompt '{prompt_key}'"
    if not isinstance(q, str):
        return f"prompt '{prompt_key}' is {type(q).__name__}, not text"
    q = clean_question(q, clean)
    if not q:
        return "empty prompt"
    if a is _MISSING or a is None:
        return f"missing answer '{answer_key}'"
    if isinstance(a, bool) or not isinstance(a, (str, int, float)):
        return f"answer '{answer_key}' is {type(a).__name__}, not text or a number"
    if isinstance(a, float) and a != a:
        return "answer is NaN"
    a_s = str(a).strip() if not (isinstance(a, float) and a.is_integer()) else str(int(a))
    if not a_s:
        return "empty answer"
    return q, a_s


def rows_to_pairs(rows: list[Any], *, source: str, prompt_key: str = "prompt", answer_key: str = "answer",
                  clean: str | None = None, on_bad_rows: str = "skip", dedupe: bool = True,
                  quiet: bool = False) -> tuple[list[tuple[str, str, int]], BadRows]:
    """Validate rows; returns ([(question, answer, row index)], report). Duplicated questions keep the first.

    ``on_bad_rows="error"`` raises a UserError naming the source, the count and the first bad row.
    """
    if on_bad_rows not in BAD_ROW_POLICIES:
        raise UserError(f"task param 'on_bad_rows' must be one of {BAD_ROW_POLICIES}, got {on_bad_rows!r}")
    report = BadRows(source=source, total=len(rows))
    out, seen = [], set()
    for i, row in enumerate(rows):
        res = _check_row(row, prompt_key, answer_key, clean)
        if isinstance(res, str):
            report.add(i, res)
            continue
        if dedupe:
            if res[0] in seen:
                continue
            seen.add(res[0])
        out.append((res[0], res[1], i))
    if report.n_bad:
        if on_bad_rows == "error":
            raise UserError(report.message() + "; fix those rows or set task.params.on_bad_rows=skip")
        if not quiet:
            from entropy_rft.common.text import visible

            print(f"warning: {visible(report.message())}; skipped them (task.params.on_bad_rows=skip)",
                  file=sys.stderr)
    if not out:
        raise UserError(f"dataset '{source}' has no usable rows (of {len(rows)}); check "
                        f"task.params.prompt_key='{prompt_key}' and answer_key='{answer_key}'")
    return out, report
