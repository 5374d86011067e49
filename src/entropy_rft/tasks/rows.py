"""Question/answer rows of a dataset: reading them from a local ``.parquet``/``.jsonl``/``.json`` file or a
Hugging Face hub id (:func:`load_rows`), picking the two fields by a dotted column path (:func:`get_path`), and
validating them with a count of the bad ones (:func:`rows_to_pairs`, :class:`BadRows`; :func:`load_pairs` does
both).

A local UTF-8 JSONL file is read line by line and never held whole (:class:`JsonlPairs`): one pass parses and
checks each row and keeps only the byte offset and row index of each usable one, and the rows a split needs are
read again from those offsets when it asks for them (a file changed in between is refused). :class:`LazyList`
holds a split's examples until they are first read.

Bad rows (missing or empty answer, empty prompt, wrong types) are counted, and the count with the first row
index is reported on stderr; ``on_bad_rows="skip"`` drops them, ``"error"`` refuses the dataset with a
:class:`~entropy_rft.common.errors.UserError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar, overload

from entropy_rft.common.errors import UserError
from entropy_rft.common.paths import expand_user
from entropy_rft.common.streams import open_regular, parse_json, regular_problem

BAD_ROW_POLICIES = ("skip", "error")
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".json")

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
               "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


_BOMS = ((b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))
_UTF8_BOM = _BOMS[0][0]


def _encoding(head: bytes) -> str:
    """The encoding a file's first bytes name by their byte-order mark; UTF-8 without one."""
    return next((enc for bom, enc in _BOMS if head.startswith(bom)), "utf-8")


def _not_text(path: Path, encoding: str, byte: int, offset: int) -> UserError:
    return UserError(f"dataset file '{path}' is not {encoding.upper().replace('-SIG', '')} text (byte "
                     f"0x{byte:02x} at offset {offset}); save it as UTF-8, e.g. `iconv -f LATIN1 "
                     f"-t UTF-8 {path} > fixed{path.suffix}`")


def _decode_text(path: Path) -> str:
    """A JSON/JSONL dataset file as text: UTF-8, or the UTF-8/16/32 its byte-order mark names (editors on
    Windows write one; JSON itself may be UTF-16 or 32). Anything else is refused in one line naming the file,
    the first bad byte and the fix."""
    data = path.read_bytes()
    encoding = _encoding(data)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        at = e.start + (len(_UTF8_BOM) if encoding == "utf-8-sig" else 0)  # utf-8-sig counts after its mark
        raise _not_text(path, encoding, data[at], at) from None


def _is_utf8(path: Path) -> bool:
    """Whether a file is UTF-8 by its first bytes (a UTF-8 byte-order mark or none): such a JSONL file is read
    line by line; a UTF-16/32 one is decoded whole."""
    with open_regular(path, "dataset file") as f:
        return _encoding(f.read(4)) in ("utf-8", "utf-8-sig")


def _jsonl_lines(f: IO[bytes], path: Path) -> Iterator[tuple[int, str]]:
    """(byte offset, text) of each non-blank line of a UTF-8 JSONL file, one line in memory at a time, as
    ``text.split("\\n")`` of the whole decoded file gives them: lines end at ``"\\n"`` only (a ``"\\r"`` before
    it is whitespace to JSON, and U+2028, U+0085 and the like may stand raw inside a JSON string), an unfinished
    last line counts, and a leading byte-order mark is dropped. A byte that is not UTF-8 is refused as
    :func:`_decode_text` refuses it (a UTF-8 sequence never holds the byte ``"\\n"``, so line by line finds the same
    first bad byte)."""
    offset = 0
    while True:
        raw = f.readline()
        if not raw:
            return
        start, offset = offset, offset + len(raw)
        if start == 0 and raw.startswith(_UTF8_BOM):
            raw, start = raw[len(_UTF8_BOM):], len(_UTF8_BOM)
        body = raw[:-1] if raw.endswith(b"\n") else raw
        try:
            line = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _not_text(path, "utf-8", body[e.start], start + e.start) from None
        if line.strip():
            yield start, line


def _jsonl_row(line: str) -> Any:
    try:
        return parse_json(line)
    except ValueError:  # not JSON, or nested too deep
        return _BadJson(line[:80])


def _read_local(path: Path) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - any pyarrow failure is a bad file
            raise UserError(f"dataset file '{path}' is not a readable parquet file ({type(e).__name__}); "
                            "rewrite it as parquet, JSONL or JSON") from None
    if suffix == ".jsonl" and _is_utf8(path):
        with open_regular(path, "dataset file") as f:
            return [_jsonl_row(line) for _, line in _jsonl_lines(f, path)]
    text = _decode_text(path)
    if suffix == ".jsonl":
        # Lines end at "\n" only (a "\r" before it is whitespace to JSON): str.splitlines would also cut at
        # U+2028, U+0085 and the like, which JSON text may hold raw inside a string.
        return [_jsonl_row(line) for line in text.split("\n") if line.strip()]
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


def _local_file(source: str) -> Path | None:
    """The local dataset file ``source`` names (checked: a regular file of a known type), or None for a hub id."""
    p = expand_user(str(source), "task.params.source")
    if not (p.suffix.lower() in LOCAL_SUFFIXES or p.exists()):
        return None
    if p.is_dir():
        raise UserError(f"dataset file '{p}' is a folder; set task.params.source to a .parquet/.jsonl/.json "
                        "file in it, or a hub id")
    problem = regular_problem(p)
    if problem is not None:  # "not a regular file (a device)" for /dev/zero, a FIFO: never opened
        raise UserError(f"dataset file '{p}': {problem}; set task.params.source to an existing "
                        ".parquet/.jsonl/.json file or a hub id")
    if p.suffix.lower() not in LOCAL_SUFFIXES:
        raise UserError(f"dataset file '{p}' has an unknown type; use .parquet, .jsonl or .json")
    return p


def load_rows(source: str, *, split: str = "train", config: str | None = None) -> list[Any]:
    """Rows (dicts) from a local parquet/JSONL/JSON file or a Hugging Face hub id."""
    p = _local_file(source)
    if p is not None:
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


Pair = tuple[str, str, int]  # (question, answer, row index)


def _settle(report: BadRows, usable: int, *, source: str, prompt_key: str, answer_key: str, on_bad_rows: str,
            quiet: bool) -> None:
    """Report the bad rows (one warning line on stderr, or a UserError with ``on_bad_rows="error"``) and refuse a
    dataset with no usable row."""
    if report.n_bad:
        if on_bad_rows == "error":
            raise UserError(report.message() + "; fix those rows or set task.params.on_bad_rows=skip")
        if not quiet:
            from entropy_rft.common.text import visible

            print(f"warning: {visible(report.message())}; skipped them (task.params.on_bad_rows=skip)",
                  file=sys.stderr)
    if not usable:
        raise UserError(f"dataset '{source}' has no usable rows (of {report.total}); check "
                        f"task.params.prompt_key='{prompt_key}' and answer_key='{answer_key}'")


def _check_policy(on_bad_rows: str) -> None:
    if on_bad_rows not in BAD_ROW_POLICIES:
        raise UserError(f"task param 'on_bad_rows' must be one of {BAD_ROW_POLICIES}, got {on_bad_rows!r}")


def rows_to_pairs(rows: list[Any], *, source: str, prompt_key: str = "prompt", answer_key: str = "answer",
                  clean: str | None = None, on_bad_rows: str = "skip", dedupe: bool = True,
                  quiet: bool = False) -> tuple[list[Pair], BadRows]:
    """Validate rows; returns ([(question, answer, row index)], report). Duplicated questions keep the first.

    ``on_bad_rows="error"`` raises a UserError naming the source, the count and the first bad row.
    """
    _check_policy(on_bad_rows)
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
    _settle(report, len(out), source=source, prompt_key=prompt_key, answer_key=answer_key,
            on_bad_rows=on_bad_rows, quiet=quiet)
    return out, report


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class JsonlPairs(Sequence[Pair]):
    """The usable rows of a UTF-8 JSONL file as (question, answer, row index), read from the file when asked
    for: what it holds is each row's byte offset and row index (16 bytes a row), never the rows.

    Built by :func:`jsonl_pairs` in one pass that parses and checks every line; :meth:`take` reads back only the
    rows it names (in file order, one line at a time). A file that changed since that pass (another size,
    modification time or inode) is refused in one line: its offsets would name other rows."""

    def __init__(self, path: Path, offsets: array, rows: array, stamp: tuple[int, ...], *, prompt_key: str,
                 answer_key: str, clean: str | None) -> None:
        self.path, self.offsets, self.rows, self.stamp = path, offsets, rows, stamp
        self.prompt_key, self.answer_key, self.clean = prompt_key, answer_key, clean

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> Pair: ...

    @overload
    def __getitem__(self, i: slice) -> list[Pair]: ...

    def __getitem__(self, i: int | slice) -> Pair | list[Pair]:
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        return self.take([range(len(self))[i]])[0]  # range's IndexError for an index out of range

    def __iter__(self) -> Iterator[Pair]:
        return self._read(range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # a sequence compared by its items, as a list

    def __repr__(self) -> str:
        return f"JsonlPairs('{self.path}', {len(self)} rows)"

    def take(self, indices: Iterable[int]) -> list[Pair]:
        """The pairs at ``indices`` (in that order), each line read once."""
        indices = [range(len(self))[i] for i in indices]
        got = dict(zip(sorted(set(indices)), self._read(sorted(set(indices)))))
        return [got[i] for i in indices]

    def _changed(self, why: str) -> UserError:
        return UserError(f"dataset file '{self.path}' changed while erft was using it ({why}); its rows are read "
                         "again when a split needs them: leave the file as it is during a command, and run again")

    def _read(self, ordered: Iterable[int]) -> Iterator[Pair]:
        """The pairs at increasing ``ordered`` indices, from one open file."""
        with open_regular(self.path, "dataset file") as f:
            if _stamp(os.fstat(f.fileno())) != self.stamp:
                raise self._changed("its size, time or inode differ")
            for k in ordered:
                f.seek(self.offsets[k])
                raw = f.readline()
                try:  # as the first pass read it: the line decoded as UTF-8, then parsed
                    row: Any = parse_json((raw[:-1] if raw.endswith(b"\n") else raw).decode("utf-8"))
                except ValueError:  # UnicodeDecodeError included
                    row = _BadJson("")
                res = _check_row(row, self.prompt_key, self.answer_key, self.clean)
                if isinstance(res, str):
                    raise self._changed(f"row {self.rows[k]}: {res}")
                yield res[0], res[1], self.rows[k]


def _digest(text: str) -> bytes:
    """A question's 16-byte fingerprint: duplicates are found by it without holding the questions."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def jsonl_pairs(path: Path, *, source: str, prompt_key: str = "prompt", answer_key: str = "answer",
                clean: str | None = None, on_bad_rows: str = "skip", dedupe: bool = True,
                quiet: bool = False) -> tuple[JsonlPairs, BadRows]:
    """:func:`rows_to_pairs` of a UTF-8 JSONL file's rows, the same pairs, report and messages, read in one pass
    that holds one line at a time (and a fingerprint of each kept question when ``dedupe``)."""
    _check_policy(on_bad_rows)
    report = BadRows(source=source)
    offsets, rows, seen = array("q"), array("q"), set()
    with open_regular(path, "dataset file") as f:
        stamp = _stamp(os.fstat(f.fileno()))
        for i, (offset, line) in enumerate(_jsonl_lines(f, path)):
            report.total = i + 1
            res = _check_row(_jsonl_row(line), prompt_key, answer_key, clean)
            if isinstance(res, str):
                report.add(i, res)
                continue
            if dedupe:
                key = _digest(res[0])
                if key in seen:
                    continue
                seen.add(key)
            offsets.append(offset)
            rows.append(i)
    _settle(report, len(offsets), source=source, prompt_key=prompt_key, answer_key=answer_key,
            on_bad_rows=on_bad_rows, quiet=quiet)
    return JsonlPairs(path, offsets, rows, stamp, prompt_key=prompt_key, answer_key=answer_key, clean=clean), report


def load_pairs(source: str, *, split: str = "train", config: str | None = None, prompt_key: str = "prompt",
               answer_key: str = "answer", clean: str | None = None, on_bad_rows: str = "skip",
               dedupe: bool = True) -> tuple[Sequence[Pair], BadRows]:
    """:func:`rows_to_pairs` of :func:`load_rows`: a local UTF-8 JSONL file through :func:`jsonl_pairs` (bounded
    memory, the same pairs), any other source read whole."""
    p = _local_file(source)
    if p is not None and p.suffix.lower() == ".jsonl" and _is_utf8(p):
        return jsonl_pairs(p, source=str(source), prompt_key=prompt_key, answer_key=answer_key, clean=clean,
                           on_bad_rows=on_bad_rows, dedupe=dedupe)
    return rows_to_pairs(load_rows(source, split=split, config=config), source=str(source), prompt_key=prompt_key,
                         answer_key=answer_key, clean=clean, on_bad_rows=on_bad_rows, dedupe=dedupe)


T = TypeVar("T")


class LazyList(Sequence[T]):
    """``n`` items that ``build()`` makes on the first read of any of them, then kept as a list: its length alone
    builds nothing (``erft eval`` never reads the training examples of the task it evaluates). Compares equal
    to a list of the same items, and pickles as one."""

    def __init__(self, n: int, build: Callable[[], list[T]]) -> None:
        self._n, self._build = n, build
        self._items: list[T] | None = None

    def _all(self) -> list[T]:
        if self._items is None:
            items = self._build()
            if len(items) != self._n:
                raise RuntimeError(f"LazyList: built {len(items)} items, expected {self._n}")
            self._items = items
        return self._items

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> list[T]: ...

    def __getitem__(self, i: int | slice) -> T | list[T]:
        return self._all()[i]

    def __iter__(self) -> Iterator[T]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Iterable[T]) -> list[T]:
        return [*self, *other]

    def __radd__(self, other: Iterable[T]) -> list[T]:
        return [*other, *self]

    def __repr__(self) -> str:
        return repr(self._items) if self._items is not None else f"LazyList({self._n} items, not read yet)"

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (self._all(),)
