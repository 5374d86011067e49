"""``erft compare``: train several methods from the same base and seeds, then summarise them side by side.

Each entry of ``--methods`` is a method name, optionally with parameters and an entropy target::

    none                      the vanilla baseline
    clip_v:mu=1.5             ClipV with mu fixed at 1.5 (any method parameter: name:key=value[:key=value])
    clip_v@target=0.43        ClipV steered by the autopilot to entropy 0.43 (also @0.6x, @linear:0.6:0.3)
    clip_v:mu=3@target=0.6x   the same, starting the controller from mu = 3

The entry is the variant's label in the run-directory name, the summary table and the report.

``--methods all`` names every registered method at its preset. ``--entropy-targets 0.5x,0.65x,0.8x`` turns each
listed method that has a strength knob into one autopilot variant per setpoint (``clip_v@0.5x``, ...), with
``none`` added as the reference; ``preset`` in that list also keeps each method at its preset. Methods without a
knob (``none``, ``grad_mask``) run at their preset only. ``--jobs N`` trains N runs at a time, each in its own
process, its output in ``OUT/logs/``; on one GPU (``model.device=cuda``) the N processes share it, each with
its share of the CPU cores (:func:`worker_threads`).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from entropy_rft.common.errors import UserError

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
        if key.strip() in params:
            raise UserError(f"--methods entry {spec!r} sets {key.strip()} twice; give it once")
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
        value = checked_target(target, f"--methods entry {spec!r}")
    return Variant(spec, parts[0], params, value)


def checked_target(text: str, where: str) -> float | str:
    """An entropy target as the config takes it (``commands.train.target_value``), checked by the autopilot's
    parser; a bad one is refused naming ``where`` (the flag or entry it came from)."""
    from entropy_rft.cli.train import target_value
    from entropy_rft.control.autopilot import parse_target

    value = target_value(text)
    try:
        parse_target(value, field=where)
    except UserError as e:
        raise UserError(str(e).replace(f"config field '{where}'", where)) from None
    return value


PRESET = "preset"


def knob_of(name: str) -> str | None:
    """The method's strength knob (None: none, grad_mask); unknown names list the registered ones."""
    from entropy_rft.control import get_method_class

    try:
        return get_method_class(name).knob
    except ValueError as e:
        raise UserError(f"--methods: {e}") from None


def expand_variants(methods: str, targets: str | None) -> list[Variant]:
    """The variants of ``--methods`` (``all``: every registered method) crossed with ``--entropy-targets``.

    Without targets each entry is one variant as written. With targets, every method that has a knob gets one
    ``name@T`` variant per setpoint ``T`` (``preset``: the method as configured), a method without a knob runs
    at its preset, and ``none`` is always there as the reference. Entries that already carry parameters or a
    target are kept as written.
    """
    from entropy_rft.common.comma_lists import comma_items
    from entropy_rft.control import available_methods

    entries = comma_items(methods, "--methods", "none,clip_v")
    if "all" in entries:
        i = entries.index("all")
        named = set(entries)
        entries = entries[:i] + [m for m in available_methods() if m not in named] + entries[i + 1:]
    if targets is None:
        return [parse_variant(m) for m in entries]
    points = comma_items(targets, "--entropy-targets", "preset,0.5x,0.65x,0.8x")
    for t in points:
        if t != PRESET:
            checked_target(t, f"--entropy-targets {t!r}")
    steerable = [e for e in entries if ":" not in e and "@" not in e and knob_of(e) is not None]
    if not steerable:
        raise UserError(f"--entropy-targets: none of --methods {methods!r} has a knob the autopilot can steer; "
                        "add one such as clip_v (`erft methods` lists the knobs), or leave out --entropy-targets")
    out: list[Variant] = [] if "none" in entries else [parse_variant("none")]
    for entry in entries:
        if ":" in entry or "@" in entry or knob_of(entry) is None:
            out.append(parse_variant(entry))
            continue
        for t in points:
            out.append(parse_variant(entry if t == PRESET else f"{entry}@{t}"))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", required=True,
                   help="Comma-separated variants: method names (none,clip_b,clip_v), fixed parameters "
                        "(clip_v:mu=1.5) or an autopilot entropy target (clip_v@target=0.43, clip_v@0.6x); "
                        "'all': every registered method (`erft methods`).")
    p.add_argument("--entropy-targets", metavar="T1,T2,...",
                   help="Drive every listed method that has a knob to each entropy setpoint (nats, or 0.5x: "
                        "a fraction of the first batch's entropy), one variant per method and setpoint, with "
                        "'none' as the reference; 'preset' in the list also runs each method at its preset. "
                        "E.g. --methods all --entropy-targets preset,0.5x,0.65x,0.8x.")
    p.add_argument("--jobs", type=int, default=1,
                   help="Runs trained at a time, each in its own process (output in OUT/logs/); on a CPU keep "
                        "jobs x threads per run <= cores. With --set model.device=cuda the N runs share the one "
                        "GPU, each with cores/N CPU threads (unless train.threads is set).")
    p.add_argument("--seeds", type=int, default=1, help="Number of seeds, counting up from --seed.")
    p.add_argument("--seed", type=int, default=None, help="First seed (default: the config's).")
    p.add_argument("--max-steps", type=int, help="Steps per run.")
    p.add_argument("--config", help="YAML config (default: the built-in one).")
    p.add_argument("--model", help="Policy for every run.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Config override (repeatable).")
    p.add_argument("--out", required=True, help="Folder: one run directory per method and seed, summaries on top.")
    p.add_argument("--overwrite", action="store_true", help="Restart runs that exist instead of resuming them.")


def worker_threads(jobs: int, cores: int, requested: int, device: str) -> int:
    """CPU threads for each of ``jobs`` runs sharing one accelerator (0: leave it to ``entropy_rft.common.threads``).

    On CPU, and when ``train.threads`` is set, the run's own rule holds (``--jobs``' help asks for jobs x threads
    <= cores). On an accelerator that rule leaves torch's default, one thread per core, in every process: N runs
    on one GPU would start N x cores OpenMP threads that spin against each other (benchmarks/threads.py). Each
    run gets its share of the cores instead."""
    if requested > 0 or str(device).startswith("cpu"):
        return 0
    return max(1, cores // jobs)


def _train_logged(cfg: Any, run_dir: Path, log: Path, overwrite: bool, threads: int = 0) -> None:
    """One run in a worker process, its stdout and stderr appended to ``log``; ``threads`` > 0: torch's
    thread count in this process (:func:`worker_threads`)."""
    import os
    import sys

    from entropy_rft.launch import run as launch

    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", buffering=1) as f:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        launch.start_or_resume(cfg, run_dir, overwrite=overwrite)


def _run_parallel(plans: list, out: Path, jobs: int, overwrite: bool) -> None:
    """Train the plans ``jobs`` at a time in fresh processes; a failed run is named, the others go on."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from entropy_rft.common.threads import available_cores
    from entropy_rft.launch.run import is_finished

    todo = []
    for i, (v, seed, cfg) in enumerate(plans, 1):
        if not overwrite and is_finished(out / f"{v.dirname}-s{seed}", cfg.train.max_steps):
            print(f"[{i}/{len(plans)}] {v.label} seed {seed}: already finished, kept", flush=True)
        else:
            todo.append((i, (v, seed, cfg)))
    failed: list[str] = []
    ctx = mp.get_context("spawn")  # a fresh interpreter per run: no torch state shared with this one
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        running: dict = {}
        while todo or running:
            while todo and len(running) < jobs:
                i, (v, seed, cfg) = todo.pop(0)
                name = f"{v.dirname}-s{seed}"
                log = out / "logs" / f"{name}.log"
                print(f"[{i}/{len(plans)}] {v.label} seed {seed}: started (log: {log})", flush=True)
                threads = worker_threads(jobs, available_cores(), cfg.train.threads, cfg.model.device)
                running[pool.submit(_train_logged, cfg, out / name, log, overwrite, threads)] = (i, v, seed, log)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                i, v, seed, log = running.pop(fut)
                err = fut.exception()
                if err is None:
                    print(f"[{i}/{len(plans)}] {v.label} seed {seed}: done", flush=True)
                else:
                    failed.append(f"{v.label} seed {seed} ({type(err).__name__}: {err}; see {log})")
                    print(f"[{i}/{len(plans)}] {v.label} seed {seed}: FAILED: {err}", flush=True)
    if failed:
        raise UserError(f"{len(failed)} run(s) failed: {'; '.join(failed)}; fix and rerun the same command "
                        "(finished runs are kept)")


OWN_FILES = ("summary.md", "summary.json", "logs", "report")  # what erft compare (and report --out) writes on top


def _check_out_folder(out: Path, plans: list) -> None:
    """``--out`` is new, empty, or an earlier ``erft compare --out``: it holds nothing but run directories made by
    erft, this request's run folders and the summaries. A training run directory or someone's folder is refused
    (never written into)."""
    from entropy_rft.rundir.files import LOCK, is_run_dir

    if not out.is_dir():
        return
    if is_run_dir(out):
        raise UserError(f"--out {out} is a training run directory, not a folder of compared runs; choose another "
                        "--out")
    planned = {f"{v.dirname}-s{seed}" for v, seed, _ in plans}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in planned and p.name not in OWN_FILES
                     and p.name != LOCK and not (p.is_dir() and is_run_dir(p)))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise UserError(f"--out {out} holds files erft compare did not write ({shown}); choose a new folder or an "
                        "earlier erft compare --out")


def _check_recorded_configs(out: Path, plans: list) -> None:
    """A run this request would keep or resume was trained with the same settings (all but ``train.max_steps``,
    which a rerun may raise); otherwise one table would mix two settings."""
    from entropy_rft.config.schema import changed_fields
    from entropy_rft.rundir.checkpoints import load_run_config

    for v, seed, cfg in plans:
        run_dir = out / f"{v.dirname}-s{seed}"
        if not (run_dir / "config.yaml").is_file():
            continue
        changed = changed_fields(load_run_config(run_dir), cfg, ignore=("train.max_steps",))
        if changed:
            shown = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in changed[:3])
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise UserError(f"{run_dir} was trained with other settings ({shown}{more}); one table would mix "
                            "them: choose another --out, or pass --overwrite to train every run again")


def _equal_entropy(summaries: list[dict], numbers: dict[str, Any], table: str) -> tuple[str, str]:
    """The equal-entropy comparison (``analysis.equal_entropy``) added to summary.json and summary.md; returns
    summary.md's text and the table to print."""
    from entropy_rft.analysis import equal_entropy as ee

    k = ee.summaries_k(summaries)
    rows = ee.comparison_rows(summaries)
    verdict, dyn = ee.verdict(rows, k), ee.dynamics_verdict(summaries)
    numbers["comparison"] = {"rows": rows, "verdict": verdict, "dynamics": dyn}
    main = ee.comparison_markdown(rows, k)
    ctrl = ee.controller_markdown(summaries)
    if any(s.get("controller/kind") == "own" for s in summaries):  # a method's own law next to the autopilot
        numbers["comparison"]["controllers"] = ctrl
        main += ("\n## Which controller holds entropy (own law vs autopilot, mean ± std over seeds)\n\n" + ctrl)
    md = ("## Methods at equal entropy (mean ± std over seeds)\n\n" + main + "\n" + verdict + "\n\n"
          "## The law and the batch predictions of the entropy change\n\n" + ee.dynamics_markdown(rows, ee.LAW_COLUMNS)
          + "\n" + ee.dynamics_markdown(rows, ee.AGREEMENT_COLUMNS) + "\n"
          + dyn + "\n\n## Every figure per variant\n\n" + table)
    return md, main + "\n" + verdict


def _knob_last(run_dir: Path) -> float | None:
    from entropy_rft.rundir.files import read_jsonl

    vals = [r["control/knob"] for r in read_jsonl(run_dir / "metrics.jsonl")
            if isinstance(r.get("control/knob"), (int, float))]
    return vals[-1] if vals else None


def run(args: argparse.Namespace) -> int:
    from entropy_rft.config.loading import load_config
    from entropy_rft.rundir.files import forget_warnings
    from entropy_rft.training import preflight

    forget_warnings()  # each damaged line of the runs read: one warning in this command
    preflight.check_out(args.out, file_hint=" (a new folder, or an earlier erft compare --out)")
    variants = expand_variants(args.methods, args.entropy_targets)
    dirs = [v.dirname for v in variants]
    dup = sorted({d for d in dirs if dirs.count(d) > 1})
    if dup:
        raise UserError(f"--methods names the same variant twice ({', '.join(dup)}); give each once")
    preflight.check_min("--seeds", args.seeds, 1)
    preflight.check_min("--max-steps", args.max_steps, 1)
    preflight.check_min("--seed", args.seed, 0)
    preflight.check_min("--jobs", args.jobs, 1)
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
    # Seed-major: an interrupted sweep holds whole seeds of every variant, not every seed of a few.
    for seed in range(first_seed, first_seed + args.seeds):
        for v in variants:
            extra = {**base_extra, "method": v.method_extra(),
                     "train": {**base_extra.get("train", {}), "seed": seed}}
            plans.append((v, seed, load_config(args.config, args.set, extra=extra, check_method=False)))
    # The whole request (output folders, device, task, method, model) before anything is created.
    _check_out_folder(out, plans)
    for v, seed, cfg in plans:
        preflight.check_train(cfg, out / f"{v.dirname}-s{seed}")
    if not args.overwrite:
        _check_recorded_configs(out, plans)
    from entropy_rft.analysis.summary import DEFAULT_COLUMNS, SHORT_COLUMNS, aggregate, markdown_table, run_summary
    from entropy_rft.launch import run as launch
    from entropy_rft.rundir.files import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    if args.jobs == 1:
        for i, (v, seed, cfg) in enumerate(plans, 1):
            print(f"[{i}/{len(plans)}] {v.label} seed {seed}")
            launch.start_or_resume(cfg, out / f"{v.dirname}-s{seed}", overwrite=args.overwrite)
    else:
        _run_parallel(plans, out, args.jobs, args.overwrite)
    summaries = []
    for v, s, _ in sorted(plans, key=lambda p: variants.index(p[0])):
        summ = run_summary(out / f"{v.dirname}-s{s}")
        summ["method"] = v.label
        summ["control/knob_last"] = _knob_last(out / f"{v.dirname}-s{s}")
        summaries.append(summ)
    agg = aggregate(summaries)
    columns, short = DEFAULT_COLUMNS, SHORT_COLUMNS
    if any(v.target is not None for v in variants):
        columns, short = (*DEFAULT_COLUMNS, "control/knob_last"), (*SHORT_COLUMNS, "control/knob_last")
    table = markdown_table(agg, columns)
    numbers: dict[str, Any] = {"runs": summaries, "methods": agg}
    if args.entropy_targets is not None or any(v.target is not None for v in variants):
        table, short_table = _equal_entropy(summaries, numbers, table)
    else:
        short_table = markdown_table(agg, short)  # the full table is in summary.md
    atomic_write_json(out / "summary.json", numbers)
    atomic_write_text(out / "summary.md", table)
    print(short_table)
    print(f"summary written to {out / 'summary.md'} and {out / 'summary.json'}")
    return 0
