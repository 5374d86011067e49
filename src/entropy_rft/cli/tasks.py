"""``erft tasks``: every task name (registered tasks and ``rg:<dataset>``) with its parameters and defaults.

Parsing and rendering only: what a task takes is read by ``entropy_rft.tasks.introspect``. ``erft tasks NAME``
shows one task in full (for ``rg:NAME`` also the reasoning-gym dataset's own config fields). Imports nothing
heavy at load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from typing import Any

from entropy_rft.tasks.introspect import SET_HINT, infos

NAME = "tasks"
HELP = "List the tasks (names for --task and --dataset) with their parameters, defaults and help."



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="TASK",
                        help="show one task in full: a registered name, rg:<dataset> or pkg.module:Class")
    parser.add_argument("--json", action="store_true", help="print the descriptions as JSON")


# ----------------------------------------------------------------------------- reading a factory


def _short(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a cut string keeps its closing quote)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[: limit - 4] + "..." + text[0] if text[:1] in "'\"" else text[: limit - 3] + "..."


def terminal_width() -> int:
    return max(60, min(100, shutil.get_terminal_size((80, 24)).columns))


def _wrap(text: str, indent: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent) or [indent.rstrip()]


def render_list(all_infos: list[dict[str, Any]], width: int) -> str:
    lines = _wrap("Tasks: the NAME of --task (erft train) and --dataset (erft eval, erft filter), with their "
                  f"parameters and defaults ({SET_HINT}). 'erft tasks NAME' shows each parameter's help.", "", width)
    lines.append("")
    for info in all_infos:
        lines.append(info["name"])
        lines += _wrap(info["summary"], "    ", width)
        params = "  ".join(f"{p['name']}" + ("=<required>" if p["required"] else f"={_short(p['default'], 24)}")
                           for p in info["params"])
        lines += _wrap("params: " + (params or "-"), "    ", width)
        if info.get("datasets"):
            lines += _wrap("datasets: " + ", ".join(info["datasets"]), "    ", width)
    return "\n".join(lines) + "\n"


def render_one(info: dict[str, Any], width: int) -> str:
    lines = [f"{info['name']}  ({info['factory']})"]
    lines += _wrap(info["description"] or info["summary"], "  ", width)
    for k, v in info["fixed"].items():
        lines.append(f"  {k}: {v!r} (fixed by the name)")
    lines += ["", "parameters:"] + _wrap(SET_HINT, "  ", width)
    for p in info["params"]:
        head = f"  {p['name']} = "
        lines.append(head + ("<required>" if p["required"] else _short(p["default"], width - len(head))))
        if p["help"]:
            lines += _wrap(p["help"], "      ", width)
    if "dataset_params" in info:
        lines.append("")
        lines += _wrap(f"{info['fixed']['dataset']}'s own parameters (inside task param 'params', e.g. "
                       "--set task.params.params.NAME=VALUE):", "", width)
        for f in info["dataset_params"]:
            line = f"  {f['name']} = {_short(f['default'], width - len(f['name']) - 5)}"
            kind = f"  ({f['type']})"
            lines += [line + kind] if len(line + kind) <= width else [line] + _wrap(f"({f['type']})", "      ", width)
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    found = infos(args.name)
    if args.json:
        json.dump(found[0] if args.name else found, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    width = terminal_width()
    sys.stdout.write(render_one(found[0], width) if args.name else render_list(found, width))
    return 0
