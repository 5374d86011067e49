"""``erft compare``: train several methods from the same base and seeds, then summarise them side by side.

Each entry of ``--methods`` is a method name, optionally with parameters and an entropy target::

    none                      the vanilla baseline
    clip_v:mu=1.5             ClipV with mu fixed at 1.5 (any method parameter: name:key=value[:key=value])
    clip_v@target=0.43        ClipV steered by the autopilot to entropy 0.43 (also @0.6x, @linear:0.6:0.3)
    clip_v:mu=3@target=0.6x   the same, starting the controller from mu = 3

The entry is the variant's label in the run-directory name, the summary table and the report.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from entropy_rft.errors import UserError

NAME = "compare"
HELP = "Train each method on the same base and seeds; write a mean ± std summary table (markdown + JSON)."


@dataclass
class Variant:
    label: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    target: Any = None

    @property
    def dirname(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.=@+-]", "_", self.label)

    def method_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"name": self.name}
        if self.params:
            extra["params"] = self.params
        if self.target is not None:
            extra["entropy_target"] = self.target
        if self.params or self.target is not None:
            extra["label"] = self.label
        return extra


def parse_variant(spec: str) -> Variant:
    """``name[:key=value...][@[target=]TARGET]`` -> Variant; values are read as YAML (numbers, null)."""
    spec = spec.strip()
    head, at, target = spec.partition("@")
    parts = [p.strip() for p in head.split(":")]
    if not parts[0]:
        raise UserError(f"--methods entry {spec!r} has no method name; e.g. clip_v, clip_v:mu=1.5, clip_v@target=0.43")
    params: dict[str, Any] = {}
    for kv in parts[1:]:
        key, eq, raw = kv.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--methods entry {spec!r}: {kv!r} must look like param=value (e.g. clip_v:mu=1.5)")
        try:
            params[key.strip()] = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            params[key.strip()] = raw
    value = None
    if at:
        target = target.strip()
        if target.startswith("target="):
            target = target[len("target="):]
        if not target:
            raise UserError(f"--methods entry {spec!r}: empty entropy target after '@' (e.g. clip_v@target=0.43)")
        from entropy_rft.commands.train import target_value

        value = target_value(target)
    return Variant(spec, parts[0], params, value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", required=True,
                   help="Comma-separated variants: method names (none,clip_b,clip_v), fixed parameters "
                        "(clip_v:mu=1.5) or an autopilot entropy target (clip_v@target=0.43, clip_v@0.6x).")
    p.add_argument("--seeds", type=int, default=1, help="Number of seeds, counting up from --seed.")
    p.add_argument("--seed", type=int, default=None, help="First seed (default: the config's).")
    p.add_argument("--max-steps", type=int, help="Steps per run.")
    p.add_argument("--config", help="YAML config (default: the built-in one).")
    p.add_argument("--model", help="Policy for every run.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Config override (repeatable).")
    p.add_argument("--out", required=True, help="Folder: one run directory per method and seed, summaries on top.")
    p.add_argument("--overwrite", action="store_true", help="Restart runs that exist instead of resuming them.")


def _knob_last(run_dir: Path) -> float | None:
    from entropy_rft.rundir import read_jsonl

    vals = [r["control/knob"] for r in read_jsonl(run_dir / "metrics.jsonl")
            if isinstance(r.get("control/knob"), (int, float))]
    return vals[-1] if vals else None


def run(args: argparse.Namespace) -> int:
    from entropy_rft import preflight
    from entropy_rft.config import load_config

    preflight.check_out(args.out, file_hint=" (a new folder, or an earlier erft compare --out)")
    variants = [parse_variant(m) for m in args.methods.split(",") if m.strip()]
    if not variants:
        raise UserError("--methods is empty; give e.g. --methods none,clip_v")
    dirs = [v.dirname for v in variants]
    dup = sorted({d for d in dirs if dirs.count(d) > 1})
    if dup:
        raise UserError(f"--methods names the same variant twice ({', '.join(dup)}); give each once")
    preflight.check_min("--seeds", args.seeds, 1)
    preflight.check_min("--max-steps", args.max_steps, 1)
    preflight.check_min("--seed", args.seed, 0)
    out = Path(args.out)
    base_extra: dict = {}
    if args.model:
        base_extra["model"] = {"name": args.model}
    if args.max_steps is not None:
        base_extra["train"] = {"max_steps": args.max_steps}
    # Validate every config before training anything.
    plans = []
    first_seed = (args.seed if args.seed is not None
                  else load_config(args.config, args.set, check_method=False).train.seed)
    for v in variants:
        for seed in range(first_seed, first_seed + args.seeds):
            extra = {**base_extra, "method": v.method_extra(),
                     "train": {**base_extra.get("train", {}), "seed": seed}}
            plans.append((v, seed, load_config(args.config, args.set, extra=extra, check_method=False)))
    # The whole request (output folders, device, task, method, model) before anything is created.
    for v, seed, cfg in plans:
        preflight.check_train(cfg, out / f"{v.dirname}-s{seed}")
    from entropy_rft import launch
    from entropy_rft.analysis.summary import DEFAULT_COLUMNS, SHORT_COLUMNS, aggregate, markdown_table, run_summary
    from entropy_rft.rundir import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    for i, (v, seed, cfg) in enumerate(plans, 1):
        print(f"[{i}/{len(plans)}] {v.label} seed {seed}")
        launch.start_or_resume(cfg, out / f"{v.dirname}-s{seed}", overwrite=args.overwrite)
    summaries = []
    for v, s, _ in plans:
        summ = run_summary(out / f"{v.dirname}-s{s}")
        summ["method"] = v.label
        summ["control/knob_last"] = _knob_last(out / f"{v.dirname}-s{s}")
        summaries.append(summ)
    agg = aggregate(summaries)
    columns, short = DEFAULT_COLUMNS, SHORT_COLUMNS
    if any(v.target is not None for v in variants):
        columns, short = (*DEFAULT_COLUMNS, "control/knob_last"), (*SHORT_COLUMNS, "control/knob_last")
    table = markdown_table(agg, columns)
    atomic_write_json(out / "summary.json", {"runs": summaries, "methods": agg})
    atomic_write_text(out / "summary.md", table)
    print(markdown_table(agg, short))  # the full table is in summary.md
    print(f"summary written to {out / 'summary.md'} and {out / 'summary.json'}")
    return 0
