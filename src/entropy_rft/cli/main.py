"""The ``erft`` command. Parsing and dispatch only: each subcommand lives in ``entropy_rft.cli``.

A command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.

Every failure ends in one line on stderr, ``erft <cmd>: error: ...`` (bad input, exit 2; a resource such as a
full disk, exit 1) or ``erft <cmd>: internal error: ...`` (a bug, exit 1). ``--debug`` (or ``ERFT_DEBUG=1``)
re-raises instead, with the traceback. Command modules import torch and transformers lazily, inside
``run``, so that bad input is refused before the heavy imports (and ``erft --help`` stays fast).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import threading
from typing import NoReturn

from entropy_rft.cli import compare, doctor, experiment, export_verl, fit_law, methods, probe, report, tasks, train
from entropy_rft.cli import eval as eval_cmd
from entropy_rft.cli import filter as filter_cmd
from entropy_rft.common.errors import UserError
from entropy_rft.common.numerics import pin_cpu_numerics
from entropy_rft.common.text import visible
from entropy_rft.common.threads import prefer_passive_wait

# Subcommand modules, in the order ``erft --help`` lists them.
COMMANDS = (train, eval_cmd, compare, report, probe, filter_cmd, fit_law, doctor, experiment, methods, tasks,
            export_verl)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

# OSErrors that mean "this path or this permission is wrong" (the user can fix the command line): exit 2.
# Anything else (disk full, quota, I/O error, out of memory...) is a failure of the machine: exit 1.
_INPUT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                 errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL, errno.ENOTEMPTY, errno.EXDEV}
_ERRNO_HINTS = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check its permissions or choose another path",
    errno.EPERM: "check its permissions or choose another path",
    errno.EROFS: "the file system is read-only; choose a writable path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; fix the path",
    errno.EISDIR: "it is a folder; pass a file",
    errno.EEXIST: "remove it or choose another path",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ENOSPC: "the disk is full; free some space or choose another disk",
    errno.EDQUOT: "the disk quota is exceeded; free some space or choose another disk",
    errno.EIO: "the disk reported an I/O error; check the device",
    errno.ENOTEMPTY: "empty it or choose another path",
}


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends with ``(default: X)`` for every option whose default means something: not None, False,
    an empty list or SUPPRESS, and not already named in the help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default == []
                or "default" in text.lower() or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return text.rstrip() + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``erft train: error: ... (see erft train --help)``), exit 2."""

    _tokens: list[str] = []  # the arguments this parser was last given (for the hint in ``error``)

    def parse_known_args(self, args=None, namespace=None):
        self._tokens = [str(a) for a in (sys.argv[1:] if args is None else args)]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        message = _one_line(message) + self._dash_value_hint(message)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def _dash_value_hint(self, message: str) -> str:
        """``--entropy-target -0.5x``: argparse reads a value that starts with '-' as an option, and says only
        "expected one argument"; name the fix, ``--entropy-target=-0.5x``."""
        m = re.match(r"argument (\S+): expected one argument$", message)
        if not m:
            return ""
        names = m.group(1).split("/")
        tokens = self._tokens
        for i, token in enumerate(tokens[:-1]):
            value = tokens[i + 1]
            named = token in names or (token.startswith("--") and len(token) > 2
                                       and any(n.startswith(token) for n in names))  # an abbreviation
            if named and value.startswith("-") and value not in self._option_string_actions:
                flag = next((n for n in names if n.startswith("--")), token)
                return f"; to pass a value that starts with '-', join it with '=': {flag}={value}"
        return ""


def _one_line(text: object, limit: int = 600) -> str:
    """The message on one line (newlines joined with '; '), at most ``limit`` characters."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    line = "; ".join(parts)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def debug_enabled(argv_flag: bool = False) -> bool:
    """``--debug`` given, or ``ERFT_DEBUG`` set to a true value (1, true, yes, on)."""
    return argv_flag or os.environ.get("ERFT_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="erft", formatter_class=_DefaultsFormatter,
        description="entropy-rft: reinforcement fine-tuning with policy entropy at the centre.",
    )
    debug_help = "On an error, show the Python traceback instead of one line (also: ERFT_DEBUG=1)."
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in COMMANDS:
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP, formatter_class=_DefaultsFormatter)
        mod.add_arguments(p)
        # Also accepted after the command (erft train --debug ...); SUPPRESS keeps the global flag's value.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        p.set_defaults(_run=mod.run)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an unknown option after the command (``erft train --nope``) is
    reported by that command's parser, which points to its own help (``erft train --help``)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        tokens = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
        before = tokens[:tokens.index(args.command)] if args.command in tokens else tokens
        subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        sub = subparsers.choices.get(args.command) if subparsers is not None else None
        culprit = sub if sub is not None and not any(e in before for e in extra) else parser
        culprit.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def os_error_message(e: OSError) -> tuple[str, int]:
    """One line for an OSError (the file, the errno text and a fix) and the exit code."""
    text = e.strerror or _one_line(e) or type(e).__name__
    files = [f for f in (e.filename, e.filename2) if f is not None]
    where = " -> ".join(repr(os.fsdecode(f)) if isinstance(f, (bytes, str)) else repr(f) for f in files)
    hint = _ERRNO_HINTS.get(e.errno or -1)
    msg = f"{where}: {text}" if where else f"{type(e).__name__}: {text}"
    if hint:
        msg += f"; {hint}"
    code = EXIT_USAGE if e.errno in _INPUT_ERRNOS else EXIT_FAILED
    return _one_line(msg), code


def _quiet_broken_pipe() -> int:
    """stdout was closed early (``erft methods | head``): no message, no traceback at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    # Our own progress bars speak for long work; the hub's per-file bars are noise here.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Idle OpenMP threads sleep instead of spinning, so two busy processes on shared cores do not collapse
    # (benchmarks/cpu/threads.py); read once when torch loads, so it is set before any command imports torch.
    prefer_passive_wait()
    # The same bytes on every x86-64 CPU: ATen and oneDNN on their AVX2 paths, MKL on COMPATIBLE (common.numerics;
    # read when torch loads, and inherited by the processes a command spawns). ERFT_CPU_PIN=0 keeps the native ones.
    pin_cpu_numerics()
    parser = build_parser()
    args = _parse(parser, argv)
    debug = debug_enabled(bool(getattr(args, "debug", False)))
    cmd = f"erft {args.command}"
    hook = threading.excepthook
    if not debug:
        threading.excepthook = _thread_failed
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"{cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except UserError as e:
        if debug:
            raise
        print(f"{cmd}: error: {visible(_one_line(e))}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        if debug:
            raise
        msg, code = os_error_message(e)
        print(f"{cmd}: error: {visible(msg)}", file=sys.stderr)
        return code
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback behind --debug
        if debug:
            raise
        if (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"  # torch.OutOfMemoryError
                or (isinstance(e, RuntimeError) and "DefaultCPUAllocator" in str(e))):  # torch's CPU allocator
            what = visible(_one_line(e, limit=200)) or type(e).__name__
            print(f"{cmd}: error: out of memory ({what}); use a smaller batch (rollout.prompts_per_step, "
                  "rollout.group_size, algo.grad_accum) or model", file=sys.stderr)
            return EXIT_FAILED
        detail = visible(_one_line(e, limit=300))
        print(f"{cmd}: internal error: {type(e).__name__}{': ' + detail if detail else ''} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        threading.excepthook = hook


def _thread_failed(a: threading.ExceptHookArgs) -> None:
    """A library's background thread that dies (TensorBoard's event writer on a full disk): one warning line
    instead of its traceback ahead of ours; what it means for the run, the main thread says (the tracker is
    dropped, or the command fails in one line). ``--debug`` keeps Python's traceback."""
    if a.exc_type is SystemExit:
        return
    e = a.exc_value
    what = os_error_message(e)[0] if isinstance(e, OSError) else f"{a.exc_type.__name__}: {_one_line(e, limit=200)}"
    name = a.thread.name if a.thread is not None else "?"
    print(f"erft: warning: a background thread ({visible(name)}) stopped: {visible(what)}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
