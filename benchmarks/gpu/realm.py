"""Issue 27's comparison on one GPU, resumable across leases: the driver behind `make run-gpu`, and, with
``--config configs/smollm2-cpu.yaml --jobs 2``, behind `make run-real-cpu` (issue 63: the same comparison on the CPU,
resumable across sittings).

    python benchmarks/gpu/realm.py [--config configs/smollm2-gpu.yaml] [--results results/smollm2-gpu]
                                 [--runs runs/smollm2-gpu] [--jobs 5] [--seeds 3] [--deadline-s 540]
                                 [--set KEY=VALUE ...] [--max-steps N]

1. Every run whose results are committed under ``--results`` (``run.json`` finished) is copied into ``--runs``,
   so ``erft compare`` keeps it instead of training it again (a new lease starts from a bare machine).
2. ``erft compare --methods none,clip_b,clip_v,clip_cov,kl_cov --seeds 3 --jobs N`` into ``--runs`` (a scratch
   folder: checkpoints and token records stay there), in its own process group. At ``--deadline-s`` the group
   gets SIGTERM: each run saves a checkpoint and stops (a later call on the same machine resumes it).
3. The shipped files of each finished run go to ``--results/<run>/`` (every ``--export-every-s`` while the runs
   train, and at the end) (metrics.jsonl, config.yaml, run.json,
   samples.jsonl; no checkpoints, token records, final weights or TensorBoard files), and once all runs are
   finished, the summary (md + json) and ``erft report``'s report.html. ``environment.json`` gets one entry per
   call: device, torch and transformers versions, wall time, runs finished.

The lease kit (benchmarks/lease, docs/lease.md) runs it as one paced wave a lease, with ``--no-report`` and
``--set train.checkpoints=false`` (no run is resumed across leases, so no checkpoint is written).

``--paced`` (the lease's train section; issues 49 and 64): every unfinished run of every seed, in an order that
completes seeds first, each its own ``erft compare --seed S --seeds 1`` process; the wave keeps the longest
prefix of that order that can finish by ``--deadline-s`` at the pace the runs show and that the device's memory
holds, killing the others at once (``realm_wave.py``; the pace figures ``pace.py``); ``--wave-json`` gets its
record, with the smaller setting that fits when not one run can. It refuses, in one line, when a kept run's
settings differ from the wave's. No summary is copied in this mode (each run is its own ``erft compare``): the
summary of all waves is made afterwards, on a CPU (docs/results-smollm2-gpu.md).

Exit status: 0 when every run is finished and reported, 3 when runs are left (call again), else compare's.
The CPU smoke test (tests/test_gpu_config.py) runs this with tiny --set overrides on SmolLM2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_files import SHIPPED, finished  # noqa: E402  (the files a run ships; a finished run: one definition)

METHODS = "none,clip_b,clip_v,clip_cov,kl_cov"
SUMMARY = ("summary.md", "summary.json")
INCOMPLETE = 3


def restore(results: Path, runs: Path) -> list[str]:
    """Copy each finished run of ``results`` into ``runs`` unless ``runs`` holds it finished already."""
    restored = []
    if not results.is_dir():
        return restored
    for src in sorted(p for p in results.iterdir() if p.is_dir() and finished(p)):
        dst = runs / src.name
        if finished(dst):
            continue
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for name in SHIPPED:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
        restored.append(src.name)
    return restored


def export(runs: Path, results: Path) -> list[str]:
    """Copy the shipped files of each finished run of ``runs`` into ``results``; returns the runs exported."""
    done = []
    for src in sorted(p for p in runs.iterdir() if p.is_dir() and finished(p)) if runs.is_dir() else []:
        dst = results / src.name
        dst.mkdir(parents=True, exist_ok=True)
        for name in SHIPPED:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
        done.append(src.name)
    return done


def environment() -> dict:
    import torch

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        tf = None
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"device": dev, "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": tf,
            "python": sys.version.split()[0]}


def _env() -> dict:
    """This environment with the checkout's src/ first on PYTHONPATH (the lent machine has no install)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP reached this driver: its runs are stopped with a checkpoint, then it ends."""


def _interrupted(signum, frame):  # noqa: ARG001 - signal handler signature
    raise Interrupted(signal.Signals(signum).name)


def _stop_group(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM to erft compare's process group (each run saves a checkpoint), SIGKILL after ``wait_s``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_compare(args: argparse.Namespace) -> int:
    """erft compare in its own process group; SIGTERM to the group at the deadline, or when this driver is
    interrupted (SIGINT, SIGTERM, SIGHUP: the runs stop with a checkpoint, a later call resumes them). Returns
    compare's exit status (3: runs are left)."""
    cmd = [sys.executable, "-m", "entropy_rft.cli", "compare", "--config", args.config, "--methods", args.methods,
           "--seeds", str(args.seeds), "--jobs", str(args.jobs), "--out", str(args.runs)]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    for s in args.set:
        cmd += ["--set", s]
    handlers = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc = subprocess.Popen(cmd, env=_env(), start_new_session=True)
    deadline = time.monotonic() + args.deadline_s
    try:
        while True:  # each run lands in --results as soon as it finishes: a sweep stopped later loses none of them
            try:
                return proc.wait(timeout=max(0.0, min(args.export_every_s, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                export(args.runs, args.results)
                if time.monotonic() >= deadline:
                    print(f"run_gpu: deadline {args.deadline_s} s: stopping the runs (each saves a checkpoint)",
                          flush=True)
                    _stop_group(proc, args.stop_wait_s)
                    return INCOMPLETE
    except Interrupted as e:
        print(f"run_gpu: {e}: stopping the runs (each saves a checkpoint; call again to resume)", flush=True)
        _stop_group(proc, args.stop_wait_s)
        return INCOMPLETE
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


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
    from realm_wave import train_wave

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
    p.add_argument("--deadline-s", type=float, default=540.0, help="Stop the runs after this long (a lease's "
                   "command must end within 10 minutes: the default leaves time for the export).")
    p.add_argument("--stop-wait-s", type=float, default=60.0, help="After the deadline's SIGTERM, wait this long "
                   "for the runs to stop (each saves a checkpoint unless train.checkpoints is false), then SIGKILL.")
    p.add_argument("--export-every-s", type=float, default=60.0, help="While the runs train, copy the shipped files "
                   "of each run that finished into --results this often.")
    p.add_argument("--no-report", action="store_true", help="Leave out erft report when every run is finished "
                   "(a lease wave: the report of all waves is made afterwards, on a CPU).")
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
    t0 = time.monotonic()
    restored = restore(args.results, args.runs)
    if restored:
        print(f"run_gpu: kept {len(restored)} run(s) already in {args.results}: {', '.join(restored)}", flush=True)
    rc = run_paced(args) if args.paced else run_compare(args)
    exported = export(args.runs, args.results)
    complete = rc == 0
    if complete and args.paced:
        print("run_gpu: every run finished; the summary: `erft compare` over the results, on a CPU", flush=True)
    elif complete:
        for name in SUMMARY:
            shutil.copy2(args.runs / name, args.results / name)
        report = args.results / "report"
        cmd = [sys.executable, "-m", "entropy_rft.cli", "report", str(args.results), "--out", str(report)]
        rc = 0 if args.no_report else subprocess.call(cmd, env=_env())
        complete = rc == 0
    log = args.results / "environment.json"
    entries = json.loads(log.read_text()) if log.is_file() else []
    entries.append({**environment(), "wall_s": round(time.monotonic() - t0, 1), "runs_finished": len(exported),
                    "complete": complete, "argv": sys.argv[1:] if argv is None else argv})
    args.results.mkdir(parents=True, exist_ok=True)
    log.write_text(json.dumps(entries, indent=1) + "\n")
    print(f"run_gpu: {len(exported)} run(s) finished in {args.results}; "
          + ("complete" if complete else "incomplete: run it again"), flush=True)
    return 0 if complete else (rc if rc not in (0, None) else INCOMPLETE)


if __name__ == "__main__":
    sys.exit(main())
