"""The results side of a resumable sweep (the driver of ``make run-real-cpu`` and ``make run-gpu``,
benchmarks/gpu/realm.py; issue 73): committed runs are checked before anything trains, and finished runs are
exported into a results folder so that no copy is ever torn, nothing is written through a link, and a failed export
is one line. ``environment.json``, the driver's log of its calls, is written the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from entropy_rft.rundir.finished import SHIPPED, claims_finished, finished, missing


class Refused(Exception):
    """One line for the user, exit 2, nothing trained: the results or runs folder cannot be used as they are."""


def _say(text: str) -> str:
    """``text`` as shown on the terminal: a folder or file name from data is shown, never obeyed."""
    from entropy_rft.common.text import visible

    return visible(text)


def links_under(folder: Path) -> list[Path]:
    """Every symbolic link inside ``folder`` (not followed): the export writes through none of them."""
    found = []
    for root, dirs, files in os.walk(folder):
        found += [Path(root) / n for n in dirs + files if (Path(root) / n).is_symlink()]
    return sorted(found)


def check_results(results: Path, runs: Path) -> list[str]:
    """The committed runs under ``results`` before anything trains (issue 73): a link under ``results`` is refused
    (the export would write through it); a run whose ``run.json`` says finished but whose rows do not prove it
    (:func:`rundir.finished.missing`: a copy cut short, rows missing) is restored from a finished copy in ``runs`` when
    there is one, else refused. Returns the lines of what was restored; raises :class:`Refused`."""
    if not results.is_dir():
        return []
    links = links_under(results)
    if links:
        raise Refused(f"{_say(str(links[0]))} is a symbolic link; the export writes through no link: replace it by "
                      f"the file itself or remove it ({len(links)} link(s) under {_say(str(results))})")
    said = []
    for src in sorted(p for p in results.iterdir() if p.is_dir() and claims_finished(p)):
        why = missing(src)
        if why is None:
            continue
        copy = runs / src.name
        if finished(copy):
            _export_run(copy, src)
            said.append(f"{_say(str(src))}: {_say(why)}; restored from the finished run in {_say(str(copy))}")
            continue
        raise Refused(f"{_say(str(src))}/{_say(why)}, though its run.json says finished: restore it (git checkout -- "
                      f"{_say(str(src))}) or remove {_say(str(src))} to train it again")
    return said


def restore(results: Path, runs: Path) -> list[str]:
    """Copy each finished run of ``results`` (proven from its rows) into ``runs`` unless ``runs`` holds it
    finished already."""
    restored: list[str] = []
    if not results.is_dir():
        return restored
    for src in sorted(p for p in results.iterdir() if p.is_dir() and finished(p)):
        dst = runs / src.name
        if finished(dst):
            continue
        if dst.exists():
            shutil.rmtree(dst)
        _export_run(src, dst)
        restored.append(src.name)
    return restored


def _export_run(src: Path, dst: Path) -> bool:
    """Write ``src``'s shipped files into ``dst``, each through a temp file and a rename, ``run.json`` last (a copy
    stopped half-way never says finished beside rows cut short); a file whose bytes are unchanged is not
    rewritten; nothing is written through a link (:class:`Refused`). Returns whether anything was written. An
    ``OSError`` names the file."""
    from entropy_rft.rundir.files import atomic_write_bytes

    wrote = False
    if dst.is_symlink():
        raise Refused(f"{_say(str(dst))} is a symbolic link; the export writes through no link: remove it")
    dst.mkdir(parents=True, exist_ok=True)
    for name in sorted(SHIPPED, key=lambda n: n == "run.json"):  # run.json last
        if not (src / name).is_file():
            continue
        target = dst / name
        if target.is_symlink():
            raise Refused(f"{_say(str(target))} is a symbolic link; the export writes through no link: replace it "
                          "by the file itself or remove it")
        data = (src / name).read_bytes()
        if target.is_file() and target.read_bytes() == data:
            continue
        atomic_write_bytes(target, data)
        wrote = True
    return wrote


def export(runs: Path, results: Path) -> list[str]:
    """Copy the shipped files of each finished run of ``runs`` (proven from its rows) into ``results``
    (:func:`_export_run`); returns the runs exported. Raises ``OSError`` (named) or :class:`Refused`."""
    done = []
    for src in sorted(p for p in runs.iterdir() if p.is_dir() and finished(p)) if runs.is_dir() else []:
        _export_run(src, results / src.name)
        done.append(src.name)
    return done


def try_export(runs: Path, results: Path) -> tuple[list[str], str | None]:
    """:func:`export`, its failure as one line instead of a traceback: (runs exported, None) or ([], the line)."""
    try:
        return export(runs, results), None
    except Refused as e:
        return [], str(e)
    except OSError as e:
        where = f": {_say(str(e.filename))}" if e.filename else ""
        return [], f"the export to {_say(str(results))} failed ({e.strerror or e}{where})"


def log_call(results: Path, entry: dict) -> str | None:
    """Append ``entry`` to ``results/environment.json`` (written through a temp file and a rename). A damaged log
    (cut short, not a list) is set aside as ``environment.json.damaged`` (``-2``, ... when taken) and a new one
    begun; returns the line that says so, or None."""
    from entropy_rft.rundir.files import atomic_write_text

    log = results / "environment.json"
    said = None
    entries: list = []
    if log.is_symlink():
        raise Refused(f"{_say(str(log))} is a symbolic link; the export writes through no link: remove it")
    if log.is_file():
        try:
            entries = json.loads(log.read_text())
            if not isinstance(entries, list):
                raise ValueError("not a list")
        except (ValueError, UnicodeDecodeError) as e:
            aside = log.with_name("environment.json.damaged")
            n = 2
            while aside.exists():
                aside, n = log.with_name(f"environment.json.damaged-{n}"), n + 1
            os.replace(log, aside)
            said = f"{_say(str(log))} was damaged ({_say(str(e)[:80])}): set aside as {aside.name}, a new one begun"
            entries = []
    results.mkdir(parents=True, exist_ok=True)
    atomic_write_text(log, json.dumps(entries + [entry], indent=1) + "\n")
    return said
