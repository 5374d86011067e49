"""``erft methods``: list every registered entropy-control method with its parameters, knob and paper.

The default layout is one block per method, wrapped to the terminal (80 columns fit), each parameter on its own
line as ``erft train --help-config`` shows a config field: ``name = default (its range or choices): help``;
``--wide`` is the table with a column per field; ``--json`` the descriptions as data.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap

NAME = "methods"
HELP = ("List the entropy-control methods: parameters and defaults, strength knob, its direction, what each "
        "does per lens quadrant, engines, paper.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the method descriptions as JSON")
    parser.add_argument("--wide", action="store_true", help="one table, a column per field (needs a wide terminal)")
    parser.add_argument("names", nargs="*", metavar="METHOD", help="only these methods (default: all)")


def _infos(names: list[str]) -> list[dict]:
    from entropy_rft.control.registry import available_methods, method_info

    return [method_info(n) for n in (names or available_methods())]


def _fmt_params(info: dict) -> str:
    if not info["params"]:
        return "-"
    return "\n".join(f"{p['name']}={p['default']!r}{f' ({rule})' if (rule := p['rule']) else ''}"
                     for p in info["params"])


def param_line(p: dict) -> str:
    """``name = default (rule): help``: one parameter with its constraints (range, choices, rule) in words."""
    rule = f" ({p['rule']})" if p["rule"] else ""
    return f"{p['name']} = {p['default']!r}{rule}: {p['help']}"


_ARROWS = {1: "↑ raises", -1: "↓ lowers", 0: "-"}


def _fmt_quadrants(info: dict, sep: str) -> str:
    """What the method does to each lens quadrant (A>0/A<0/A=0 × S_c>0/S_c<=0); untouched ones left out."""
    touched = [f"{q}: {e}" for q, e in info["quadrants"].items() if e != "-"]
    return sep.join(touched) or "no quadrant touched (vanilla)"


def render_blocks(infos: list[dict], width: int) -> str:
    """One block per method: name and stage, what it does, its knob and direction, parameters, paper."""

    def wrap(text: str, indent: str = "    ") -> list[str]:
        return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + "  ")

    lines: list[str] = []
    for info in infos:
        lines += wrap(f"{info['name']}  ({info['stage']} stage)", "")
        lines += wrap(info["summary"])
        if info["knob"]:
            lines += wrap(f"knob: {info['knob']} ({info['direction']})")
        lines += wrap(f"params:{'' if info['params'] else ' -'}")
        for p in info["params"]:
            lines += wrap(param_line(p), "      ")
        lines += wrap(f"lens: {_fmt_quadrants(info, '; ')}")
        if info["engines"] != ["native", "trl", "verl"]:
            lines += wrap(f"engines: {', '.join(info['engines'])} only")
        if sorted(info["algorithms"]) != ["dr_grpo", "grpo", "ppo"]:
            lines += wrap(f"algorithms: {', '.join(info['algorithms'])} only")
        lines += wrap(f"paper: {info['paper']}")
        lines.append("")
    lines += wrap("As data: erft methods --json NAME; one table: erft methods --wide.", "")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        infos = _infos(args.names)
    except ValueError as e:
        from entropy_rft.common.errors import UserError

        raise UserError(str(e)) from None
    if args.json:
        json.dump(infos, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    if not args.wide:
        sys.stdout.write(render_blocks(infos, max(40, min(100, shutil.get_terminal_size((80, 24)).columns))))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="entropy-control methods", show_lines=True)
    table.add_column("method", no_wrap=True)
    for col in ("what it does", "per quadrant (lens)", "parameters (defaults)", "knob", "knob ↑ ⇒ entropy",
                "engines", "paper"):
        table.add_column(col, overflow="fold")
    for info in infos:
        arrow = _ARROWS[info["knob_raises_entropy"]]
        table.add_row(info["name"], info["summary"], _fmt_quadrants(info, "\n"), _fmt_params(info),
                      info["knob"] or "-", arrow, ", ".join(info["engines"]), info["paper"])
    Console().print(table)
    return 0
