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
its share of the CPU cores (``launch.sweep.worker_threads``).

The command parses and checks its flags; the variant grammar is ``launch.variants``, the sweep's plans, folder
checks and scheduler are ``launch.sweep``, and the tables ``analysis.summary.compare_summary``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from entropy_rft.cli.flags import add_sitting_flags
from entropy_rft.common.errors import UserError

NAME = "compare"
HELP = "Train each method on the same base and seeds; write a mean ± std summary table (markdown + JSON)."


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
                   help="Runs trained at a time (at most 256), each in its own process (output in OUT/logs/); on "
                        "a CPU keep jobs x threads per run <= cores. With --set model.device=cuda the N runs share "
                        "the one GPU, each with cores/N CPU threads (unless train.threads is set).")
    p.add_argument("--seeds", type=int, default=1, help="Number of seeds, counting up from --seed.")
    p.add_argument("--seed", type=int, default=None, help="First seed (default: the config's).")
    p.add_argument("--max-steps", type=int, help="Steps per run.")
    p.add_argument("--config", help="YAML config (default: the built-in one).")
    p.add_argument("--model", help="Policy for every run.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Config override (repeatable).")
    p.add_argument("--out", required=True, help="Folder: one run directory per method and seed, summaries on top.")
    p.add_argument("--overwrite", action="store_true", help="Restart runs that exist instead of resuming them.")
    g = p.add_argument_group("a sweep over many sittings (launch.resumable)")
    g.add_argument("--results", help="Folder the finished runs are committed to (their shipped files: metrics, "
                   "config, run.json, samples), exported while the others train; a later call keeps them and trains "
                   "only what is missing, resuming stopped runs from their checkpoints in --out.")
    add_sitting_flags(g)  # --deadline-s, --stop-wait-s, --export-every-s, --no-report: with --results only


def run(args: argparse.Namespace) -> int:
    """Prepare every run (nothing written), train them, summarise. A SIGTERM, SIGINT or SIGHUP ends each part
    in one line and 128 + the signal's number: before any run started, nothing was written; while runs train,
    each saves a checkpoint (``sweep.train_all``); after them, the summary is left as it was."""
    from entropy_rft.launch import sweep

    if getattr(args, "results", None) is not None:
        return _resumable(args)
    if getattr(args, "deadline_s", None) is not None or getattr(args, "no_report", False):
        raise UserError("--deadline-s and --no-report belong to a sweep over sittings: add --results DIR")
    try:
        with sweep.stop_raises():
            out, variants, plans = _prepare(args)
    except sweep.Stopped as s:
        return _say_stopped(s.signum, " before any run started; nothing was written")
    stopped_by = sweep.train_all(plans, out, args.jobs, args.overwrite)
    try:
        with sweep.stop_raises():
            return _summarise(args, out, variants, plans, stopped_by)
    except sweep.Stopped as s:
        if stopped_by is not None:
            return _say_stopped(s.signum, ": the running runs saved a checkpoint; the summary was not written; rerun "
                                "the same command to continue")
        return _say_stopped(s.signum, " after the runs ended, before the summary was written; rerun the same "
                            "command to write it (the runs are kept)")


def _resumable(args: argparse.Namespace) -> int:
    """``--results``: this sweep as one sitting of ``launch.resumable.drive``, which runs the same ``erft compare``
    (without the sitting's flags) in a session of its own, exports what finishes and stops it at the deadline."""
    import sys

    from entropy_rft.launch.resumable import Driver, drive

    results, out = Path(args.results), Path(args.out)
    if results.resolve() == out.resolve():
        raise UserError("--results must be another folder than --out: --out holds the runs as they train "
                        "(checkpoints too), --results what is committed of the finished ones")
    if args.overwrite:
        raise UserError("--overwrite with --results would train again the runs --results keeps; leave one out")
    for flag, value, low in (("--deadline-s", args.deadline_s, 0.0), ("--export-every-s", args.export_every_s, 0.0)):
        if value is not None and not value > low:
            raise UserError(f"{flag} must be a number of seconds > 0, got {value}")
    if not args.stop_wait_s >= 0:
        raise UserError(f"--stop-wait-s must be a number of seconds >= 0, got {args.stop_wait_s}")
    cmd = [sys.executable, "-m", "entropy_rft.cli", "compare", "--methods", args.methods, "--out", str(out),
           "--jobs", str(args.jobs), "--seeds", str(args.seeds)]
    for flag, value in (("--entropy-targets", args.entropy_targets), ("--seed", args.seed),
                        ("--max-steps", args.max_steps), ("--config", args.config), ("--model", args.model)):
        if value is not None:
            cmd += [flag, str(value)]
    for item in args.set:
        cmd += ["--set", item]
    deadline = float("inf") if args.deadline_s is None else args.deadline_s
    return drive(Driver(results=results, runs=out, compare=cmd, deadline_s=deadline, stop_wait_s=args.stop_wait_s,
                        export_every_s=args.export_every_s, report=not args.no_report, argv=cmd[4:]))


def _prepare(args: argparse.Namespace) -> tuple[Path, list, list]:
    """The checked request: ``--out``, the variants and every run's plan (``sweep.make_plans``), with each run's
    folder, device, task, method and model checked before anything is created."""
    from entropy_rft.config.loading import load_config
    from entropy_rft.config.schema import MAX_SEED
    from entropy_rft.launch import sweep
    from entropy_rft.launch.variants import expand_variants
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
    preflight.check_range("--jobs", args.jobs, 1, sweep.MAX_JOBS, "runs trained at a time, each a process")
    n_runs = len(variants) * args.seeds
    if n_runs > sweep.MAX_RUNS:
        raise UserError(f"--seeds {args.seeds} x {len(variants)} variant(s) is {n_runs} runs, more than the "
                        f"{sweep.MAX_RUNS:,} one sweep holds; lower --seeds or split the sweep")
    out = Path(args.out)
    base_extra: dict = {}
    if args.model:
        base_extra["model"] = {"name": args.model}
    if args.max_steps is not None:
        base_extra["train"] = {"max_steps": args.max_steps}
    first_seed = (args.seed if args.seed is not None
                  else load_config(args.config, args.set, check_method=False).train.seed)
    if first_seed + args.seeds - 1 > MAX_SEED:
        raise UserError(f"--seeds {args.seeds} from seed {first_seed} ends at seed {first_seed + args.seeds - 1}, "
                        f"above train.seed's maximum {MAX_SEED}; lower --seeds or --seed")
    if n_runs >= 1000:
        print(f"preparing {n_runs} runs (each run's config and folder checked before the first starts)", flush=True)
    # Validate every config before training anything.
    plans = sweep.make_plans(variants, range(first_seed, first_seed + args.seeds), args.config, args.set, base_extra)
    # The whole request (output folders, device, task, method, model) before anything is created. A variant's
    # runs differ only in their seed and folder: its config is checked once (with its first seed's folder), and
    # the folders that may differ from that one: those that exist, and the longest name (the highest seed).
    sweep.check_out_folder(out, plans)
    present = {p.name for p in out.iterdir()} if out.is_dir() else set()
    last = first_seed + args.seeds - 1
    checked: set[str] = set()
    for v, seed, cfg in plans:
        run_dir = sweep.run_dir_of(out, v, seed)
        if v.dirname not in checked:
            preflight.check_train(cfg, run_dir)
            checked.add(v.dirname)
        elif seed == last or run_dir.name in present:
            preflight.check_out(run_dir)
    if not args.overwrite:
        sweep.check_recorded_configs(out, plans)
    return out, variants, plans


def _summarise(args: argparse.Namespace, out: Path, variants: list, plans: list, stopped_by: int | None) -> int:
    """The summary of the runs (``analysis.summary.compare_summary``), written on top of ``out``."""
    from entropy_rft.analysis.summary import compare_summary
    from entropy_rft.launch import sweep
    from entropy_rft.rundir.files import atomic_write_json, atomic_write_text

    targets = any(v.target is not None for v in variants)
    runs = [(v.label, sweep.run_dir_of(out, v, s)) for v, s, _ in sorted(plans, key=lambda p: variants.index(p[0]))]
    if stopped_by is not None:  # the summary of what ran; the runs that never logged a step are left out
        from entropy_rft.rundir.files import read_step_log

        runs = [(label, d) for label, d in runs if any(r["step"] >= 1 for r in read_step_log(d / "metrics.jsonl"))]
        if not runs:
            return _stopped(stopped_by, out, wrote=False)
    numbers, table, short_table = compare_summary(runs, knob=targets,
                                                  equal_entropy=args.entropy_targets is not None or targets)
    atomic_write_json(out / "summary.json", numbers)
    atomic_write_text(out / "summary.md", table)
    print(short_table)
    print(f"summary written to {out / 'summary.md'} and {out / 'summary.json'}")
    return 0 if stopped_by is None else _stopped(stopped_by, out, wrote=True)


def _stopped(signum: int, out: Path, *, wrote: bool) -> int:
    """The one line of a sweep a signal stopped, and its exit status (128 + the signal's number)."""
    what = f"the summary of what ran is in {out / 'summary.md'}" if wrote else "no run had logged a step"
    return _say_stopped(signum, f": the running runs saved a checkpoint; {what}; rerun the same command to continue")


def _say_stopped(signum: int, words: str) -> int:
    """``erft compare: stopped by SIGTERM<words>`` on stderr (``words``: ``: ...`` or `` before ...``); returns
    128 + the signal's number."""
    import signal
    import sys

    print(f"erft compare: stopped by {signal.Signals(signum).name}{words}", file=sys.stderr, flush=True)
    return 128 + signum
