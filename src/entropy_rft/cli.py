"""The ``erft`` command. Parsing and dispatch only: each subcommand lives in ``entropy_rft.commands``.

A command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from entropy_rft.errors import UserError

# Subcommand modules, in the order ``erft --help`` lists them.
COMMANDS = ["train", "eval", "compare", "report", "probe", "filter", "fit_law", "experiment", "methods"]


def _load_commands() -> list:
    mods = []
    for name in COMMANDS:
        try:
            mods.append(importlib.import_module(f"entropy_rft.commands.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"entropy_rft.commands.{name}":
                raise
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="erft",
        description="entropy-rft: reinforcement fine-tuning with policy entropy at the centre.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in _load_commands():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Our own progress bars speak for long work; the hub's per-file bars are noise here.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UserError as e:
        print(f"erft {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"erft {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
