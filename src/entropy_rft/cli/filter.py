"""``erft filter``: drop training prompts that a model always or never solves (Paper A's pass-rate filter).

For every training question of a task, sample ``--n`` responses (default 16) with ``--model`` and score them
with the task's verifier. A question is dropped when its pass rate is <= ``--min-pass`` (default 1/16) or
>= ``--max-pass`` (default 15/16). Held-out questions (DAPO500) are never looked at.

Writes into ``--out``: ``filtered.jsonl`` (kept rows: ``prompt`` (the raw question), ``answer``,
``pass_rate``, ``correct``, ``n``, ``row``; train on it with ``--task math --set task.params.source=...``),
``dropped.jsonl``, ``filter.json`` (counts, thresholds) and ``pass_rate_hist.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from entropy_rft.common.errors import UserError

NAME = "filter"
HELP = "Pass-rate filter: sample n per training prompt, drop prompts solved <= 1/16 or >= 15/16 of the time."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="Policy that samples: a built-in name, folder or hub id.")
    p.add_argument("--dataset", default="dapo_math_17k", help="Task whose training questions are filtered.")
    p.add_argument("--task-param", action="append", default=[], metavar="KEY=VALUE",
                   help="Parameter for the task, value read as YAML (repeatable).")
    p.add_argument("--n", type=int, default=16, help="Samples per question (paper: 16).")
    p.add_argument("--min-pass", default="1/16", help="Drop questions with pass rate <= this (a fraction).")
    p.add_argument("--max-pass", default="15/16", help="Drop questions with pass rate >= this (a fraction).")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="Maximum response length in tokens.")
    p.add_argument("--limit", type=int, default=None, help="Only the first N training questions (after the "
                   "seeded shuffle).")
    p.add_argument("--batch-size", type=int, default=64, help="Sequences sampled together.")
    p.add_argument("--seed", type=int, default=0, help="Sampling seed.")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N.")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="Weights' dtype while sampling.")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (0: automatic, entropy_rft.common.threads: 1 for small models).")
    p.add_argument("--out", default="filtered", help="Output folder.")


def parse_fraction(text: str, flag: str) -> float:
    try:
        v = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        raise UserError(f"{flag} '{text}' must be a number or a fraction like 1/16") from None
    if not 0 <= v <= 1:
        raise UserError(f"{flag} must be in [0, 1], got {text}")
    return v


def keep_question(correct: int, n: int, min_pass: float, max_pass: float) -> bool:
    """Kept when min_pass < c/n < max_pass (exact rational comparison)."""
    rate = Fraction(correct, n)
    return Fraction(min_pass).limit_denominator(10**6) < rate < Fraction(max_pass).limit_denominator(10**6)


def count_correct(model, tok, task, examples, *, n: int, temperature: float, max_new_tokens: int,
                  batch_size: int, generator, on_progress: Callable[[int, int], None] | None = None) -> list[int]:
    """Correct samples (reward >= 1) out of ``n`` per example. ``on_progress(done, total)`` is called with the
    examples scored so far, before the first batch and after each (``evaluation.evaluate_policy``'s rule)."""
    from entropy_rft.policy.rollout import sample

    per_chunk = max(1, batch_size // n)
    counts: list[int] = []
    for i in range(0, len(examples), per_chunk):
        if on_progress is not None:
            on_progress(i, len(examples))
        part = examples[i : i + per_chunk]
        group = [ex for ex in part for _ in range(n)]
        rb = sample(model, tok, [ex.prompt for ex in group], max_new_tokens=max_new_tokens,
                    temperature=temperature, generator=generator)
        if hasattr(task, "check_many"):
            scores = [s for s, _ in task.check_many(rb.responses, group)]
        else:
            scores = [task.reward(r, ex) for r, ex in zip(rb.responses, group)]
        for j in range(len(part)):
            counts.append(sum(1 for s in scores[j * n : (j + 1) * n] if s >= 1.0))
    if on_progress is not None:
        on_progress(len(examples), len(examples))
    return counts


def histogram_png(counts: list[int], n: int, min_pass: float, max_pass: float) -> bytes:
    import numpy as np

    from entropy_rft.report.plots import figure_png, plt

    hist = np.bincount(np.asarray(counts, dtype=int), minlength=n + 1)
    kept = [keep_question(c, n, min_pass, max_pass) for c in range(n + 1)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(range(n + 1), hist, color=["tab:blue" if k else "tab:gray" for k in kept])
    ax.set_xlabel(f"correct samples of {n}")
    ax.set_ylabel("questions")
    ax.set_title(f"Pass rates: {sum(h for h, k in zip(hist, kept) if k)} kept (blue), "
                 f"{sum(h for h, k in zip(hist, kept) if not k)} dropped (grey)")
    return figure_png(fig)


def run(args: argparse.Namespace) -> int:
    from entropy_rft.cli.eval import check_sampling_args, load_model, parse_task_params
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
    if (out / "run.json").is_file():
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

    from entropy_rft.common.threads import apply_threads
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
    kept_rows: list[dict[str, Any]] = []
    dropped_rows: list[dict[str, Any]] = []
    for ex, c in zip(examples, counts):
        meta = ex.meta if isinstance(ex.meta, dict) else {}
        row = {"prompt": meta.get("question", str(ex.prompt)), "answer": ex.answer, "pass_rate": c / args.n,
               "correct": c, "n": args.n, "row": meta.get("row")}
        (kept_rows if keep_question(c, args.n, lo, hi) else dropped_rows).append(row)
    for name, rows in (("filtered.jsonl", kept_rows), ("dropped.jsonl", dropped_rows)):
        rundir.atomic_write_text(out / name, "".join(json.dumps(rundir.json_safe(r)) + "\n" for r in rows))
    summary = {"model": args.model, "dataset": args.dataset, "n": args.n, "min_pass": args.min_pass,
               "max_pass": args.max_pass, "temperature": args.temperature, "questions": len(examples),
               "kept": len(kept_rows), "dropped": len(dropped_rows),
               "pass_rate_hist": [counts.count(c) for c in range(args.n + 1)],
               "seconds": time.perf_counter() - t0}
    rundir.atomic_write_text(out / "filter.json", json.dumps(summary, indent=1))
    rundir.atomic_write_bytes(out / "pass_rate_hist.png", histogram_png(counts, args.n, lo, hi))
    print(f"kept {len(kept_rows)} of {len(examples)} questions (dropped pass rate <= {args.min_pass} or "
          f">= {args.max_pass}); wrote {out / 'filtered.jsonl'}")
    return 0
