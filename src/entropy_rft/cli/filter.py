"""``erft filter``: drop training prompts that a model always or never solves (Paper A's pass-rate filter).

For every training question of a task, sample ``--n`` responses (default 16) with ``--model`` and score them
with the task's verifier. A question is dropped when its pass rate is <= ``--min-pass`` (default 1/16) or
>= ``--max-pass`` (default 15/16). Held-out questions (DAPO500) are never looked at.

Writes into ``--out``: ``filtered.jsonl`` (kept rows: ``prompt`` (the raw question), ``answer``,
``pass_rate``, ``correct``, ``n``, ``row``; train on it with ``--task math --set task.params.source=...``),
``dropped.jsonl``, ``filter.json`` (counts, thresholds) and ``pass_rate_hist.png``.

The command parses and checks its flags; the counting and the rule are ``analysis.pass_filter``, the figure
``report.histograms.filter_histogram_png``.
"""

from __future__ import annotations

import argparse
import json
import time
from fractions import Fraction

from entropy_rft.cli.flags import add_sampling_flags, check_sampling_args, parse_task_params
from entropy_rft.common.errors import UserError

NAME = "filter"
HELP = "Pass-rate filter: sample n per training prompt, drop prompts solved <= 1/16 or >= 15/16 of the time."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="Policy that samples: a built-in name, folder or hub id.")
    p.add_argument("--dataset", default="dapo_math_17k", help="Task whose training questions are filtered.")
    add_sampling_flags(p, "--task-param",
                       task_param={"help": "Parameter for the task, value read as YAML (repeatable)."})
    p.add_argument("--n", type=int, default=16, help="Samples per question (paper: 16).")
    p.add_argument("--min-pass", default="1/16", help="Drop questions with pass rate <= this (a fraction).")
    p.add_argument("--max-pass", default="15/16", help="Drop questions with pass rate >= this (a fraction).")
    add_sampling_flags(p, "--temperature", "--max-new-tokens", "--limit", "--batch-size", "--seed", "--device",
                       "--dtype", "--threads",
                       temperature={"default": 1.0, "help": "Sampling temperature."},
                       limit={"help": "Only the first N training questions (after the seeded shuffle)."},
                       seed={"help": "Sampling seed."})
    p.add_argument("--out", default="filtered", help="Output folder.")


def parse_fraction(text: str, flag: str) -> float:
    try:
        v = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        raise UserError(f"{flag} '{text}' must be a number or a fraction like 1/16") from None
    if not 0 <= v <= 1:
        raise UserError(f"{flag} must be in [0, 1], got {text}")
    return v


def run(args: argparse.Namespace) -> int:
    from entropy_rft.rundir.files import is_run_dir
    from entropy_rft.training import preflight

    preflight.check_min("--n", args.n, 1)
    preflight.check_min("--max-new-tokens", args.max_new_tokens, 1)
    if not args.temperature > 0:
        raise UserError(f"--temperature must be > 0, got {args.temperature}")
    preflight.check_min("--limit", args.limit, 1)
    check_sampling_args(args)
    lo, hi = parse_fraction(args.min_pass, "--min-pass"), parse_fraction(args.max_pass, "--max-pass")
    if lo >= hi:
        raise UserError(f"--min-pass ({args.min_pass}) must be below --max-pass ({args.max_pass})")
    out = preflight.check_out(args.out, file_hint="")
    if is_run_dir(out):
        raise UserError(f"--out {out} is a training run directory; choose another --out for the filtered data")
    task = preflight.build_task(args.dataset, parse_task_params(args.task_param), flag="--dataset",
                                params_flag="--task-param")
    preflight.check_model(args.model)
    examples = task.split(args.seed)[0]
    if args.limit is not None:
        examples = examples[: args.limit]
    if not examples:
        raise UserError(f"--dataset {args.dataset}: has no training questions to filter")
    import torch

    from entropy_rft.analysis.evaluate import load_model
    from entropy_rft.analysis.pass_filter import count_correct, filter_rows
    from entropy_rft.common.threads import apply_threads
    from entropy_rft.report.histograms import filter_histogram_png
    from entropy_rft.rundir import files as rundir
    from entropy_rft.training.step_log import prompt_progress

    model, tok = load_model({"path": args.model}, args.device, args.dtype)
    apply_threads(args.threads, model, args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    t0 = time.perf_counter()
    with prompt_progress(f"filter {args.dataset} with {args.model}", len(examples)) as on_progress:
        counts = count_correct(model, tok, task, examples, n=args.n, temperature=args.temperature,
                               max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, generator=gen,
                               on_progress=on_progress)
    out.mkdir(parents=True, exist_ok=True)
    kept_rows, dropped_rows = filter_rows(examples, counts, args.n, lo, hi)
    for name, rows in (("filtered.jsonl", kept_rows), ("dropped.jsonl", dropped_rows)):
        rundir.atomic_write_text(out / name, "".join(json.dumps(rundir.json_safe(r)) + "\n" for r in rows))
    summary = {"model": args.model, "dataset": args.dataset, "n": args.n, "min_pass": args.min_pass,
               "max_pass": args.max_pass, "temperature": args.temperature, "questions": len(examples),
               "kept": len(kept_rows), "dropped": len(dropped_rows),
               "pass_rate_hist": [counts.count(c) for c in range(args.n + 1)],
               "seconds": time.perf_counter() - t0}
    rundir.atomic_write_text(out / "filter.json", json.dumps(summary, indent=1))
    rundir.atomic_write_bytes(out / "pass_rate_hist.png", filter_histogram_png(counts, args.n, lo, hi))
    print(f"kept {len(kept_rows)} of {len(examples)} questions (dropped pass rate <= {args.min_pass} or "
          f">= {args.max_pass}); wrote {out / 'filtered.jsonl'}")
    return 0
