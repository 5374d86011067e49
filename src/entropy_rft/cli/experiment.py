"""``erft experiment``: reproductions of the papers' experiments. ``masking``: Paper A's four-condition ablation."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from entropy_rft.common.errors import UserError

NAME = "experiment"
HELP = ("Run a paper's experiment. 'masking': Paper A's gradient-masking ablation (train only A>0/A<0 tokens "
        "with S>0/S<0) plus a vanilla baseline; reports whether entropy moved as the theory predicts.")
EXPERIMENTS = ("masking",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=EXPERIMENTS, help="Which experiment: masking.")
    p.add_argument("--steps", type=int, default=40,
                   help="Training steps per run (5 runs; ~0.2-0.5 s/step on the built-in default). Default 40.")
    p.add_argument("--out", default="runs/masking", help="Folder: one run directory per condition, results on top.")
    p.add_argument("--config", help="YAML config (default: the built-in one).")
    p.add_argument("--model", help="Policy (default: the config's, i.e. the built-in default).")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Config override (repeatable). Evaluation is off unless you set eval.every.")
    p.add_argument("--s-field", choices=("s_star", "s_centered"), default="s_star",
                   help="Discriminator whose sign is kept: S (s_star, as in the paper) or S_c (s_centered).")
    p.add_argument("--window", type=int, default=5,
                   help="Entropy change = mean over the last WINDOW steps minus the first WINDOW. Default 5.")
    p.add_argument("--tol", type=float, default=0.01,
                   help="A change within this fraction of the starting entropy counts as flat. Default 0.01.")
    p.add_argument("--overwrite", action="store_true", help="Restart runs that exist instead of resuming them.")


def run(args: argparse.Namespace) -> int:
    from entropy_rft.config.loading import load_config
    from entropy_rft.training import preflight

    preflight.check_min("--window", args.window, 1)
    if not (args.tol >= 0 and math.isfinite(args.tol)):
        raise UserError(f"--tol must be a finite number >= 0, got {args.tol}")
    preflight.check_min("--steps", args.steps, 2)
    if 2 * args.window > args.steps:
        raise UserError(f"--window {args.window} needs --steps >= {2 * args.window} (the first and the last "
                        f"{args.window} steps must not overlap), got --steps {args.steps}; lower --window or raise "
                        "--steps")
    fixed = sorted({kv.partition("=")[0].strip() for kv in args.set} & {"method.name", "method.params", "method"})
    if fixed:
        raise UserError(f"--set {fixed[0]}: the masking experiment sets the method of each of its runs itself; "
                        "drop it")
    preflight.check_out(args.out, file_hint=" (a new folder, or an earlier erft experiment --out)")
    # The base request (config, device, task, model) before any run directory is made.
    extra: dict = {"train": {"max_steps": args.steps}}
    if args.model:
        extra["model"] = {"name": args.model}
    cfg = load_config(args.config, ["eval.every=0", *args.set], extra=extra, check_method=False)
    preflight.check_train(cfg, Path(args.out) / "vanilla")
    from entropy_rft.analysis import masking
    from entropy_rft.rundir.files import atomic_write_bytes, atomic_write_json, atomic_write_text

    out = Path(args.out)
    masking.run_experiment(out, steps=args.steps, config=args.config, model=args.model, sets=args.set,
                           s_field=args.s_field, overwrite=args.overwrite)
    res = masking.analyse(out, window=args.window, tol=args.tol)
    md = masking.markdown(res)
    atomic_write_json(out / "masking.json", res)
    atomic_write_text(out / "masking.md", md)
    atomic_write_bytes(out / "masking.png", masking.plot(out, res))
    print(md)
    print(f"written: {out / 'masking.md'}, {out / 'masking.json'}, {out / 'masking.png'}")
    return 0
