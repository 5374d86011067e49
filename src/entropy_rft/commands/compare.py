"""``erft compare``: train several methods from the same base and seeds, then summarise them side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from entropy_rft.errors import UserError

NAME = "compare"
HELP = "Train each method on the same base and seeds; write a mean ± std summary table (markdown + JSON)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", required=True, help="Comma-separated method names, e.g. none,clip_b,clip_v.")
    p.add_argument("--seeds", type=int, default=1, help="Number of seeds, counting up from --seed.")
    p.add_argument("--seed", type=int, default=None, help="First seed (default: the config's).")
    p.add_argument("--max-steps", type=int, help="Steps per run.")
    p.add_argument("--config", help="YAML config (default: the built-in one).")
    p.add_argument("--model", help="Policy for every run.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Config override (repeatable).")
    p.add_argument("--out", required=True, help="Folder: one run directory per method and seed, summaries on top.")
    p.add_argument("--overwrite", action="store_true", help="Restart runs that exist instead of resuming them.")


def run(args: argparse.Namespace) -> int:
    from entropy_rft import launch
    from entropy_rft.analysis.summary import SHORT_COLUMNS, aggregate, markdown_table, run_summary
    from entropy_rft.config import load_config
    from entropy_rft.rundir import atomic_write_json, atomic_write_text

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise UserError("--methods is empty; give e.g. --methods none,clip_v")
    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    out = Path(args.out)
    base_extra: dict = {}
    if args.model:
        base_extra["model"] = {"name": args.model}
    if args.max_steps is not None:
        base_extra["train"] = {"max_steps": args.max_steps}
    # Validate every config before training anything.
    plans = []
    first_seed = args.seed if args.seed is not None else load_config(args.config, args.set).train.seed
    for method in methods:
        for seed in range(first_seed, first_seed + args.seeds):
            extra = {**base_extra, "method": {"name": method},
                     "train": {**base_extra.get("train", {}), "seed": seed}}
            plans.append((method, seed, load_config(args.config, args.set, extra=extra)))
    out.mkdir(parents=True, exist_ok=True)
    for i, (method, seed, cfg) in enumerate(plans, 1):
        print(f"[{i}/{len(plans)}] {method} seed {seed}")
        launch.start_or_resume(cfg, out / f"{method}-s{seed}", overwrite=args.overwrite)
    summaries = [run_summary(out / f"{m}-s{s}") for m, s, _ in plans]
    agg = aggregate(summaries)
    table = markdown_table(agg)
    atomic_write_json(out / "summary.json", {"runs": summaries, "methods": agg})
    atomic_write_text(out / "summary.md", table)
    print(markdown_table(agg, SHORT_COLUMNS))
    print(f"summary written to {out / 'summary.md'} and {out / 'summary.json'}")
    return 0
