"""The flags several commands share, declared once: the sampling flags (``erft eval``, ``erft filter``, and
``--temperature``, ``--seed``, ``--device`` of ``erft probe``), ``--task-param`` (also ``erft export-verl``), their
parsing and their checks; the flags of a sweep over sittings (``erft compare --results``, benchmarks/gpu/realm.py).
A command adds the ones it takes, in the order its ``--help`` lists them, and says in its own words only what
differs for it (a default, a help text)."""

from __future__ import annotations

import argparse
from typing import Any

from entropy_rft.common.errors import UserError

DTYPES = ["float32", "bfloat16", "float16"]

# flag -> add_argument's keywords; a command gives what it says differently (``add_sampling_flags``' ``own``).
SAMPLING_FLAGS: dict[str, dict[str, Any]] = {
    "--task-param": {"action": "append", "default": [], "metavar": "KEY=VALUE"},
    "--temperature": {"type": float},
    "--max-new-tokens": {"type": int, "default": 1024, "help": "Maximum response length in tokens."},
    "--limit": {"type": int, "default": None},
    "--batch-size": {"type": int, "default": 64, "help": "Sequences sampled together."},
    "--seed": {"type": int, "default": 0},
    "--device": {"default": "cpu", "help": "cpu, cuda or cuda:N."},
    "--dtype": {"default": "float32", "choices": DTYPES, "help": "Weights' dtype while sampling."},
    "--cuda-graphs": {"action": "store_true",
                      "help": "Sample with the static decoder's GPU loop (rollout.cuda_graphs): each decode step a "
                              "CUDA-graph replay on CUDA; the same tokens as without it."},
    "--threads": {"type": int, "default": 0,
                  "help": "CPU threads (0: automatic, entropy_rft.common.threads: 1 for small models)."},
}


# The clock of a sweep over sittings (launch.resumable.Driver); a command gives what it says differently.
SITTING_FLAGS: dict[str, dict[str, Any]] = {
    "--deadline-s": {"type": float, "help": "Stop the runs after this long (each saves a checkpoint; exit 3: call "
                                            "again to go on). Default: none."},
    "--stop-wait-s": {"type": float, "default": 60.0, "help": "After a stop's SIGTERM, wait this long for the runs' "
                                                              "checkpoints, then SIGKILL (default 60)."},
    "--export-every-s": {"type": float, "default": 60.0, "help": "Export the finished runs this often while the "
                                                                 "others train (default 60)."},
    "--no-report": {"action": "store_true", "help": "Leave out erft report when every run is finished."},
}


def add_sitting_flags(p: argparse.ArgumentParser | Any, **own: dict[str, Any]) -> None:
    """Add :data:`SITTING_FLAGS` to ``p`` (a parser or an argument group); ``own`` as ``add_sampling_flags``'."""
    for flag, kw in SITTING_FLAGS.items():
        p.add_argument(flag, **{**kw, **own.pop(flag.lstrip("-").replace("-", "_"), {})})
    if own:
        raise TypeError(f"add_sitting_flags: {sorted(own)} given but not added")


def add_sampling_flags(p: argparse.ArgumentParser, *flags: str, **own: dict[str, Any]) -> None:
    """Add the shared ``flags`` to ``p`` in the order given. ``own``: per flag, by its name without dashes
    (``temperature={"default": 0.7, "help": ...}``), what this command says differently."""
    for flag in flags:
        p.add_argument(flag, **{**SAMPLING_FLAGS[flag], **own.pop(flag.lstrip("-").replace("-", "_"), {})})
    if own:
        raise TypeError(f"add_sampling_flags: {sorted(own)} given but not added")


def parse_task_params(items: list[str]) -> dict[str, Any]:
    """``--task-param KEY=VALUE`` items as a dict, each value read as YAML (text when it is not YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--task-param '{item}' must look like key=value, e.g. --task-param limit=50")
        k, v = item.split("=", 1)
        if not k.strip().isidentifier():
            raise UserError(f"--task-param '{item}': {k.strip()!r} is not a parameter name; use key=value, "
                            "e.g. --task-param limit=50")
        try:
            out[k.strip()] = yaml.safe_load(v) if v.strip() else ""
        except yaml.YAMLError:
            out[k.strip()] = v
    return out


def check_sampling_args(args: argparse.Namespace) -> None:
    """The flags eval and filter share, checked: batch size, threads, seed, temperature, device, output folder."""
    import math

    from entropy_rft.common.threads import MAX_THREADS
    from entropy_rft.training import preflight

    preflight.check_min("--batch-size", args.batch_size, 1)
    preflight.check_range("--threads", args.threads, 0, MAX_THREADS, "0: automatic")
    preflight.check_min("--seed", args.seed, 0)
    if not math.isfinite(args.temperature):
        raise UserError(f"--temperature must be a finite number, got {args.temperature}")
    preflight.check_device(args.device, "--device", "--device cpu")
    preflight.check_out(args.out, file_hint="")
