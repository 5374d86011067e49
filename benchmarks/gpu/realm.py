"""Issue 27's comparison on one GPU, resumable across leases: the driver behind `make run-gpu`, and, with
``--config configs/smollm2-cpu.yaml --jobs 2``, behind `make run-real-cpu` (issue 63: the same comparison on the CPU,
resumable across sittings).

    python -m benchmarks.gpu.realm [--config configs/smollm2-gpu.yaml] [--results results/smollm2-gpu]
                                 [--runs runs/smollm2-gpu] [--jobs 5] [--seeds 3] [--deadline-s 540]
                                 [--set KEY=VALUE ...] [--max-steps N]

The driver is the package's, ``entropy_rft.launch.resumable`` (its docstring: one writer, the committed runs
checked and kept, ``erft compare`` in a session of its own stopped at ``--deadline-s`` with checkpoints, the
finished runs exported every ``--export-every-s``, the summary and ``erft report`` once all are finished,
``environment.json``): ``erft compare --results DIR`` is the same driver for any sweep. This script gives it the
comparison's defaults (``--methods none,clip_b,clip_v,clip_cov,kl_cov --seeds 3``), the checkout's ``src/`` for a
machine without the package installed, its lines' prefix ``run_gpu:``, and the lease's paced wave.

The lease kit (benchmarks/lease, docs/lease.md) runs it as one paced wave a lease, with ``--no-report`` and
``--set train.checkpoints=false`` (no run is resumed across leases, so no checkpoint is written).

``--paced`` (the lease's train section; issues 49 and 64): every unfinished run of every seed, in an order that
completes seeds first, each its own ``erft compare --seed S --seeds 1`` process; the wave keeps the longest
prefix of that order that can finish by ``--deadline-s`` at the pace the runs show and that the device's memory
holds, killing the others at once (``realm_wave.py``; the pace figures ``pace.py``); ``--wave-json`` gets its
record, with the smaller setting that fits when not one run can. It refuses, in one line, when a kept run's
settings differ from the wave's. No summary is copied in this mode (each run is its own ``erft compare``): the
summary of all waves is made afterwards, on a CPU (docs/results-smollm2-gpu.md).

Exit status: 0 when every run is finished and reported, 3 when runs are left (call again), 2 when refused or the
export failed (one line says why), else compare's.
The CPU smoke test (tests/test_gpu_config.py) runs this with tiny --set overrides on SmolLM2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# a checkout without the package installed finds src/ through benchmarks/__init__.py (an installed one comes first)
from entropy_rft.cli.flags import add_sitting_flags  # the sitting's flags, as erft compare's
from entropy_rft.launch.resumable import Driver, compare_env, drive  # the driver: one sitting
from entropy_rft.rundir.finished import finished  # one definition: proven from the rows

ROOT = Path(__file__).resolve().parents[2]

METHODS = "none,clip_b,clip_v,clip_cov,kl_cov"


def _env() -> dict:
    """This environment with the checkout's src/ first on PYTHONPATH (the lent machine has no install)."""
    return compare_env(ROOT / "src")


def missing_runs(runs: Path, methods: str, seeds: int) -> list[tuple[str, int]]:
    """The (method, seed) of every run of seeds ``0..seeds-1`` not finished in ``runs``, seeds first: an early
    stop leaves whole seeds, and each lease's runs complete the table seed by seed."""
    return [(m, s) for s in range(seeds) for m in methods.split(",") if not finished(runs / f"{m}-s{s}")]


def check_settings(args: argparse.Namespace) -> str | None:
    """Whether every run kept in ``--runs`` (the committed ones, restored) was trained with the wave's settings:
    each run of a paced wave is its own ``erft compare --seed S --seeds 1``, which checks only its own folder (its
    CPU numerics too: this process is not pinned as a run is), so the wave checks the others' settings first. The
    one line of the mismatch, or None."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.launch import sweep
    from entropy_rft.launch.variants import expand_variants

    extra = {"train": {"max_steps": args.max_steps}} if args.max_steps is not None else {}
    plans = sweep.make_plans(expand_variants(args.methods, None), range(args.seeds), args.config, list(args.set),
                             extra)
    try:
        sweep.check_recorded_configs(args.runs, plans, cpu_numerics=False)
    except UserError as e:
        return str(e)
    return None


def run_paced(args: argparse.Namespace) -> int:
    """Every run of seeds ``0..--seeds-1`` not finished in ``--runs``, seeds first, as one paced wave
    (realm_wave.py); its exit status (0: all finished, 3: runs left, 2: settings differ from the kept runs')."""
    from benchmarks.gpu.realm_wave import train_wave

    missing = missing_runs(args.runs, args.methods, args.seeds)
    if not missing:
        print(f"run_gpu: every run of seeds 0-{args.seeds - 1} is finished already", flush=True)
        return 0
    mismatch = check_settings(args)
    if mismatch:
        print(f"run_gpu: {mismatch}", flush=True)
        return 2
    return train_wave(args, missing, _env(), lambda text: print(text, flush=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "smollm2-gpu.yaml"))
    p.add_argument("--results", type=Path, default=ROOT / "results" / "smollm2-gpu")
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "smollm2-gpu")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=5)
    p.add_argument("--max-steps", type=int)
    add_sitting_flags(p, deadline_s={"default": 540.0, "help": "Stop the runs after this long (a lease's command "
                                     "must end within 10 minutes: the default leaves time for the export)."})
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--paced", action="store_true", help="Train every unfinished run, seeds first, as a wave that "
                   "keeps only the runs that can finish by --deadline-s at their measured pace and that the device's "
                   "memory holds (realm_wave.py).")
    p.add_argument("--wave-json", type=Path, help="--paced: where the wave's record goes.")
    p.add_argument("--window-s", type=float, default=90.0, help="--paced: read the pace once each run has logged "
                   "a training step, or after this long.")
    p.add_argument("--at-once", type=int, default=5, help="--paced: at most this many runs at once (fewer when the "
                   "device's memory holds fewer; the rest start as runs end, when one can still finish).")
    p.add_argument("--peak-mib", type=float, help="--paced: one run's peak device memory as an earlier lease "
                   "measured it (then the first runs start together; without it the first starts alone until its "
                   "peak is read).")
    p.add_argument("--memory-runs", type=float, help="--paced, the CPU rehearsal only: the device's memory holds "
                   "this many runs (a small device on demand).")
    p.add_argument("--check-s", type=float, default=10.0, help="--paced: check the kept runs this often.")
    p.add_argument("--budget-runs", type=float, help="--paced, the CPU rehearsal only: once the pace is read, the "
                   "budget is what this many runs of the wave's order need at it (pace.budget_of; 7.5: seven fit, "
                   "not eight): a slow device on demand.")
    args = p.parse_args(argv)
    cmd = [sys.executable, "-m", "entropy_rft.cli", "compare", "--config", args.config, "--methods", args.methods,
           "--seeds", str(args.seeds), "--jobs", str(args.jobs), "--out", str(args.runs)]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    for s in args.set:
        cmd += ["--set", s]
    driver = Driver(results=args.results, runs=args.runs, compare=cmd, deadline_s=args.deadline_s,
                    stop_wait_s=args.stop_wait_s, export_every_s=args.export_every_s, report=not args.no_report,
                    summarise=not args.paced, name="run_gpu", env=_env(),
                    argv=sys.argv[1:] if argv is None else list(argv))
    if args.paced:
        return drive(driver, train=lambda _d: (run_paced(args), None))
    return drive(driver)


if __name__ == "__main__":
    sys.exit(main())
