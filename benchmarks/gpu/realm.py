"""Issue 27's comparison on one GPU, resumable across leases: the driver behind `make run-gpu`, and, with
``--config configs/smollm2-cpu.yaml --jobs 2``, behind `make run-real-cpu` (issue 63: the same comparison on the CPU,
resumable across sittings).

    python benchmarks/gpu/realm.py [--config configs/smollm2-gpu.yaml] [--results results/smollm2-gpu]
                                 [--runs runs/smollm2-gpu] [--jobs 5] [--seeds 3] [--deadline-s 540]
                                 [--set KEY=VALUE ...] [--max-steps N]

0. One writer (issue 73): the driver holds ``--results`` and ``--runs`` (erft's lock, ``.erft.lock``) for its whole
   life; a second driver is refused in one line naming the first's process. The committed runs are checked
   before anything trains (``launch.results.check_results``): a link under ``--results`` is refused; a run whose
   ``run.json`` says finished but whose rows do not prove it (``rundir.finished.missing``: a copy cut short, rows
   missing) is restored from a finished copy in ``--runs``, or refused in one line naming the file. Runs an
   earlier driver's sweep is still stopping are waited for (up to ``--stop-wait-s``).
1. Every finished run committed under ``--results`` (proven from its rows) is copied into ``--runs``, so
   ``erft compare`` keeps it instead of training it again (a new lease starts from a bare machine).
2. ``erft compare --methods none,clip_b,clip_v,clip_cov,kl_cov --seeds 3 --jobs N`` into ``--runs`` (a scratch
   folder: checkpoints and token records stay there), in a session of its own that ends with the driver however
   the driver ends (``launch.sessions.start_session``: the kernel sends it SIGTERM; its workers die with it the same
   way). At ``--deadline-s``, or on SIGINT/SIGTERM/SIGHUP, it gets SIGTERM: each run saves a checkpoint and stops
   (a later call resumes it); after ``--stop-wait-s`` SIGKILL reaches every process of the session.
3. The shipped files of each finished run go to ``--results/<run>/`` (every ``--export-every-s`` while the runs
   train, and at the end) (metrics.jsonl, config.yaml, run.json, samples.jsonl; no checkpoints, token records,
   final weights or TensorBoard files): each through a temp file and a rename, ``run.json`` last, unchanged files
   not rewritten, nothing through a link. A failed export (a full disk) is one line; training goes on, the export
   is tried again, and the call ends with exit 2 and that line if the last export failed. Once all runs are
   finished, the summary (md + json) and ``erft report``'s report.html. ``environment.json`` (written atomically;
   a damaged one set aside as ``environment.json.damaged``, said in one line) gets one entry per call: device,
   torch and transformers versions, wall time, runs finished.

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
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(ROOT / "src"))  # a checkout without the package installed (an installed one comes first)
from entropy_rft.launch.results import Refused, _say, check_results, log_call, restore, try_export  # noqa: E402
from entropy_rft.launch.sessions import wait_for_runs  # noqa: E402
from entropy_rft.rundir.finished import finished  # noqa: E402  (one definition: proven from the rows)

METHODS = "none,clip_b,clip_v,clip_cov,kl_cov"
SUMMARY = ("summary.md", "summary.json")
INCOMPLETE = 3


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


def run_compare(args: argparse.Namespace) -> tuple[int, str | None]:
    """erft compare in a session of its own that ends with this driver (sessions.start_session); SIGTERM at the
    deadline, or when this driver is interrupted (SIGINT, SIGTERM, SIGHUP: the runs stop with a checkpoint, a
    later call resumes them), and SIGKILL to every process of the session after ``--stop-wait-s``. Every
    ``--export-every-s`` the finished runs are exported; a failed export is said in one line and tried again,
    and training goes on. Returns compare's exit status (3: runs are left) and the last export's failure."""
    from entropy_rft.launch.sessions import start_session, stop_session

    cmd = [sys.executable, "-m", "entropy_rft.cli", "compare", "--config", args.config, "--methods", args.methods,
           "--seeds", str(args.seeds), "--jobs", str(args.jobs), "--out", str(args.runs)]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    for s in args.set:
        cmd += ["--set", s]
    handlers = {sig: signal.signal(sig, _interrupted) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc = start_session(cmd, env=_env())
    deadline = time.monotonic() + args.deadline_s
    failure: str | None = None
    try:
        while True:  # each run lands in --results as soon as it finishes: a sweep stopped later loses none of them
            try:
                return proc.wait(timeout=max(0.0, min(args.export_every_s, deadline - time.monotonic()))), failure
            except subprocess.TimeoutExpired:
                _, error = try_export(args.runs, args.results)
                if error and error != failure:
                    print(f"run_gpu: {error}; training goes on, the export is tried again every "
                          f"{args.export_every_s:g} s", flush=True)
                failure = error
                if time.monotonic() >= deadline:
                    print(f"run_gpu: deadline {args.deadline_s} s: stopping the runs (each saves a checkpoint)",
                          flush=True)
                    stop_session(proc, args.stop_wait_s)
                    return INCOMPLETE, failure
    except Interrupted as e:
        print(f"run_gpu: {e}: stopping the runs (each saves a checkpoint; call again to resume)", flush=True)
        stop_session(proc, args.stop_wait_s)
        return INCOMPLETE, failure
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
    try:
        with contextlib.ExitStack() as held:
            for folder, what in ((args.results, "results folder"), (args.runs, "runs folder")):
                held.callback(_driver_lock(folder, what).release)
            return sitting(args, sys.argv[1:] if argv is None else argv, t0)
    except Refused as e:
        print(f"run_gpu: {e}", flush=True)
        return 2


def _driver_lock(folder: Path, what: str):
    """This driver's hold on ``folder`` (``.erft.lock``, erft's one-writer lock) for its whole life: a second
    driver on the same results or runs is refused in one line naming the process, before anything is written."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.rundir.lock import RunLock

    lock = RunLock(folder, what=what, advice="another sweep driver is writing it: wait for it to finish or stop "
                   "it (kill PID: its runs save a checkpoint); nothing was started")
    try:
        return lock.acquire()
    except UserError as e:
        raise Refused(_say(str(e))) from None
    except OSError as e:
        raise Refused(f"{what} {_say(str(folder))} cannot be written ({e.strerror}); choose another") from None


def sitting(args: argparse.Namespace, argv: list[str], t0: float) -> int:
    """One call of the driver, its folders held: check the committed runs, wait for an earlier sweep's runs to be
    released, keep the finished ones, train the rest, export, summarise, log the call."""
    say = lambda text: print(text, flush=True)  # noqa: E731 - the one way this driver speaks
    for line in check_results(args.results, args.runs):
        say(f"run_gpu: {line}")
    still = wait_for_runs(args.runs, args.stop_wait_s, lambda text: say(f"run_gpu: {text}"))
    if still:
        raise Refused(f"{len(still)} run(s) in {_say(str(args.runs))} are still held by an earlier sweep "
                      f"({', '.join(f'{n}: {w}' for n, w in still[:3])}): wait for it to end or stop it")
    try:
        restored = restore(args.results, args.runs)
    except OSError as e:
        raise Refused(f"keeping the committed runs in {_say(str(args.runs))} failed ({e.strerror}: "
                      f"{_say(str(e.filename))}); free the space and run it again") from None
    if restored:
        say(f"run_gpu: kept {len(restored)} run(s) already in {_say(str(args.results))}: {', '.join(restored)}")
    rc, failure = (run_paced(args), None) if args.paced else run_compare(args)
    exported, failure = try_export(args.runs, args.results)
    complete = rc == 0 and failure is None
    if complete and args.paced:
        say("run_gpu: every run finished; the summary: `erft compare` over the results, on a CPU")
    elif complete:
        from entropy_rft.rundir.files import atomic_write_bytes

        try:
            for name in SUMMARY:
                atomic_write_bytes(args.results / name, (args.runs / name).read_bytes())
        except OSError as e:
            failure = f"the summary's export failed ({e.strerror}: {_say(str(e.filename))})"
        report = args.results / "report"
        cmd = [sys.executable, "-m", "entropy_rft.cli", "report", str(args.results), "--out", str(report)]
        rc = 0 if args.no_report or failure else subprocess.call(cmd, env=_env())
        complete = rc == 0 and failure is None
    try:
        aside = log_call(args.results, {**environment(), "wall_s": round(time.monotonic() - t0, 1),
                                        "runs_finished": len(exported), "complete": complete, "argv": argv})
        if aside:
            say(f"run_gpu: {aside}")
    except OSError as e:
        failure = failure or f"writing {_say(str(args.results / 'environment.json'))} failed ({e.strerror})"
    if failure:
        say(f"run_gpu: {failure}: the finished runs are kept in {_say(str(args.runs))}; free the space (or mend "
            "the folder) and run it again to export them")
        return 2
    say(f"run_gpu: {len(exported)} run(s) finished in {_say(str(args.results))}; "
        + ("complete" if complete else "incomplete: run it again"))
    return 0 if complete else (rc if rc not in (0, None) else INCOMPLETE)


if __name__ == "__main__":
    sys.exit(main())
