"""``erft methods``: list every registered entropy-control method with its parameters, knob and paper."""

from __future__ import annotations

import argparse
import json
import sys

NAME = "methods"
HELP = "List the entropy-control methods: parameters and defaults, strength knob, its direction, paper."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the method descriptions as JSON")
    parser.add_argument("names", nargs="*", metavar="METHOD", help="only these methods (default: all)")


def _infos(names: list[str]) -> list[dict]:
    from entropy_rft import control  # torch: imported only when the command runs

    return [control.method_info(n) for n in (names or control.available_methods())]


def _fmt_params(info: dict) -> str:
    if not info["params"]:
        return "-"
    return "\n".join(f"{p['name']}={p['default']!r}" for p in info["params"])


def run(args: argparse.Namespace) -> int:
    try:
        infos = _infos(args.names)
    except ValueError as e:
        from entropy_rft.errors import UserError

        raise UserError(str(e)) from None
    if args.json:
        json.dump(infos, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="entropy-control methods", show_lines=True)
    table.add_column("method", no_wrap=True)
    for col in ("what it does", "parameters (defaults)", "knob", "knob ↑ ⇒ entropy", "paper"):
        table.add_column(col, overflow="fold")
    for info in infos:
        arrow = {1: "↑ raises", -1: "↓ lowers", 0: "-"}[info["knob_raises_entropy"]]
        table.add_row(info["name"], info["summary"], _fmt_params(info), info["knob"] or "-", arrow,
                      info["paper"])
    Console().print(table)
    return 0
