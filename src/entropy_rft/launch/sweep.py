"""A sweep (``erft compare``): the configs of every variant and seed, the checks of the output folder before
anything is trained, and the runs trained one at a time or ``jobs`` at a time, each in its own process.

A plan is ``(variant, seed, cfg)``; its run directory is ``OUT/<variant.dirname>-s<seed>``. ``--jobs N`` trains N
runs at a time, each in a fresh process, its output in ``OUT/logs/``; on one GPU (``model.device=cuda``) the N
processes share it, each with its share of the CPU cores (:func:`worker_threads`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from entropy_rft.common.errors import UserError
from entropy_rft.launch.variants import Variant

Plan = tuple[Variant, int, Any]  # (variant, seed, Config)


def run_dir_of(out: Path, v: Variant, seed: int) -> Path:
    """The run directory of one variant and seed in the sweep folder ``out``."""
    return out / f"{v.dirname}-s{seed}"


MAX_JOBS = 256  # --jobs: runs trained at a time, each a process holding its own model
MAX_RUNS = 1_000_000  # runs in one sweep: each plan holds its config (~5 KB) while the sweep runs


def make_plans(variants: list[Variant], seeds: range, config: str | None, sets: list[str],
          base_extra: dict[str, Any]) -> list[Plan]:
    """Every run's validated config, seed-major: an interrupted sweep holds whole seeds of every variant, not
    every seed of a few. ``base_extra``: the overrides every run shares (model, max_steps).

    A variant's configs differ only in ``train.seed``, whose one rule is its range: each variant's config is
    loaded and validated at the lowest and the highest seed (the first line naming the field, as a run-by-run
    check would), and every seed's config is a copy of it with its seed, so that 100,000 seeds take seconds,
    not the half hour of loading each (~18 ms a config)."""
    import copy

    from entropy_rft.config.loading import load_config

    def load(v: Variant, seed: int) -> Any:
        extra = {**base_extra, "method": v.method_extra(), "train": {**base_extra.get("train", {}), "seed": seed}}
        return load_config(config, sets, extra=extra, check_method=False)

    if not seeds:
        return []
    lo, hi = min(seeds[0], seeds[-1]), max(seeds[0], seeds[-1])
    base = []
    for v in variants:
        base.append(load(v, lo))
        if hi != lo:
            load(v, hi)
    out = []
    for seed in seeds:
        for v, cfg in zip(variants, base):
            own = copy.deepcopy(cfg)  # each run owns its config, as when each was loaded
            own.train.seed = seed
            out.append((v, seed, own))
    return out


def worker_threads(jobs: int, cores: int, requested: int, device: str) -> int:
    """CPU threads for each of ``jobs`` runs sharing one accelerator (0: leave it to ``entropy_rft.common.threads``).

    On CPU, and when ``train.threads`` is set, the run's own rule holds (``--jobs``' help asks for jobs x threads
    <= cores). On an accelerator that rule leaves torch's default, one thread per core, in every process: N runs
    on one GPU would start N x cores OpenMP threads that spin against each other (benchmarks/cpu/threads.py). Each
    run gets its share of the cores instead."""
    if requested > 0 or str(device).startswith("cpu"):
        return 0
    return max(1, cores // jobs)


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")  # a kill, a Ctrl-C, a closed terminal: each stops a sweep cleanly


_pending_stop: list[int] = []  # in a worker: the stop signal that came while it waited for a run


def _worker_start() -> None:
    """A worker's first act: its own process group, so that a Ctrl-C in the terminal reaches the parent alone
    (which stops each worker once, :class:`Stop`); a SIGTERM or SIGHUP while it waits for a run is kept (the
    worker must not die under the pool: that would break it and kill the other runs mid-checkpoint). When the
    parent ends without stopping it (a SIGKILL, the out-of-memory killer), the kernel sends it SIGTERM
    (``common.processes.die_with_parent``): its run saves a checkpoint and stops, instead of training on unwatched."""
    import multiprocessing
    import os
    import signal

    from entropy_rft.common.processes import die_with_parent

    os.setpgrp()
    for name in ("SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), lambda signum, _frame: _pending_stop.append(signum))
    parent = multiprocessing.parent_process()
    die_with_parent(signal.SIGTERM, parent.pid if parent is not None else None)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class Stopped(BaseException):  # not an Exception: nothing on the way turns it into another error
    """A stop signal (SIGTERM, SIGINT, SIGHUP) where no run's own handlers hold (:func:`stop_raises`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


class stop_raises:  # noqa: N801 - used as a context manager, like contextlib's lower-case ones
    """While installed (``with``), a SIGTERM, SIGINT or SIGHUP raises :class:`Stopped` at once: for the parts of
    ``erft compare`` where no run's own handlers hold (preparing the runs: nothing written yet; between runs; the
    summary, written atomically), so there is nothing to save first. A run's handlers (``launch.run.StopSignals``,
    :class:`Stop`) put these back when they end. Outside the main thread nothing is installed."""

    def __init__(self) -> None:
        self._old: dict = {}

    def __enter__(self) -> stop_raises:
        import contextlib
        import signal

        for name in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread
                self._old[name] = signal.signal(getattr(signal, name), _raise_stopped)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for name, h in self._old.items():
            signal.signal(getattr(signal, name), h)


class Stop:
    """While installed (``with``) in ``erft compare``'s parent, the first SIGTERM, SIGINT or SIGHUP is recorded
    (``signum``) and passed on once, as SIGTERM, to each worker (``pids()``): each run saves a checkpoint at its
    next step and records "stopped"; no new run starts. A later signal only says what is awaited."""

    def __init__(self, pids: Any) -> None:
        self.pids = pids
        self.signum: int | None = None
        self._old: dict = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        import contextlib
        import os
        import signal
        import sys

        name = signal.Signals(signum).name
        pids = list(self.pids())
        if self.signum is None:
            self.signum = signum
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            print(f"erft compare: {name}: stopping {len(pids)} running run(s) at their next step, each with a "
                  "checkpoint; no new run starts", file=sys.stderr, flush=True)
        else:
            print(f"erft compare: {name}: still waiting for {len(pids)} run(s) to save their checkpoint",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> Stop:
        import contextlib
        import signal

        for name in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread
                self._old[name] = signal.signal(getattr(signal, name), self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for name, h in self._old.items():
            signal.signal(getattr(signal, name), h)


def _first_line(err: BaseException) -> str:
    """An error in a few words: its first line, at most 200 characters (torch's C++ text runs on)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def status_since(run_dir: Path, since: float) -> dict:
    """The run's ``run.json`` when it was written at or after ``since`` (``time.time()``; 2 s earlier counts, for
    file systems that keep whole seconds), else ``{}``: what this sweep's worker recorded, not a status left by an
    earlier session."""
    from entropy_rft.rundir.files import read_status

    try:
        fresh = (run_dir / "run.json").stat().st_mtime >= since - 2.0
    except OSError:
        return {}
    return read_status(run_dir) if fresh else {}


def outcome(err: BaseException | None, signalled: bool, status: dict, checkpoints: bool = True) -> tuple[str, str]:
    """How a run trained in a worker ended: ``("done" | "stopped" | "failed", words)`` for its line.

    ``err``: the exception its future holds (None: it returned); ``signalled``: a stop signal reached the sweep;
    ``status``: its ``run.json`` as this sweep's worker left it (:func:`status_since`; read once the workers have
    ended). A worker killed under the pool (a SIGKILL, the out-of-memory killer) breaks the pool, and every run
    then holds ``BrokenProcessPool``: the pool stops the others with a SIGTERM, on which each saves a checkpoint
    and records "stopped". Only a run that recorded neither that nor "finished" is the failure."""
    from concurrent.futures.process import BrokenProcessPool

    if err is None:
        return "done", "done"
    if signalled and isinstance(err, SystemExit):
        return "stopped", "stopped"
    if isinstance(err, BrokenProcessPool):
        if status.get("status") == "finished":
            return "done", "done"
        if status.get("status") == "stopped":
            saved = ("checkpoint saved; rerun the same command to resume it" if checkpoints else
                     "no checkpoint, train.checkpoints is false: a rerun starts it again")
            return "stopped", (f"stopped at step {status.get('step')} when another run's process was killed "
                               f"({saved})")
        return "failed", ("FAILED: its process was killed by a signal sent to it alone or by the out-of-memory "
                          "killer, before it recorded a stop")
    return "failed", f"FAILED: {_first_line(err)}"


def _train_logged(cfg: Any, run_dir: Path, log: Path, overwrite: bool, threads: int = 0) -> None:
    """One run in a worker process, its stdout and stderr appended to ``log``; ``threads`` > 0: torch's
    thread count in this process (:func:`worker_threads`)."""
    import os
    import signal
    import sys

    from entropy_rft.launch import run as launch

    if _pending_stop:  # stopped before this run started: it does not start
        raise SystemExit(128 + _pending_stop[0])
    for name in ("SIGTERM", "SIGHUP"):  # until the run installs its own (a checkpoint, then "stopped")
        signal.signal(getattr(signal, name), _exit_on_signal)
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


PROGRESS_EVERY_S = 60.0  # a line of progress for the runs trained side by side, at this interval


def progress_words(out: Path, v: Variant, seed: int, cfg: Any) -> str:
    """``clip_v seed 0: step 120/300`` from the run's last logged row (``starting`` before its first row: the
    model is loading, or the base policy being built)."""
    from entropy_rft.rundir.files import last_step

    step = last_step(run_dir_of(out, v, seed))
    if step is not None:
        return f"{v.label} seed {seed}: step {step}/{cfg.train.max_steps}"
    building = base_build_words(cfg.model.name)
    return f"{v.label} seed {seed}: " + ("starting" if building is None else f"waiting for its base policy "
                                                                              f"({building})")


def base_build_words(model: str) -> str | None:
    """How far the build of a built-in base policy (``default``, ``default-strong``) is, when one is under way in
    this cache (``models.cache.progress_words``: the building process, its step, rate and time left)."""
    from entropy_rft.models.files import SFT_NAMES

    if model not in SFT_NAMES:
        return None
    from entropy_rft.models.cache import progress_words
    from entropy_rft.training.sft import BUILT_IN_RECIPES, default_policy_dir

    return progress_words(default_policy_dir(None, **BUILT_IN_RECIPES[model]))


def run_parallel(plans: list, out: Path, jobs: int, overwrite: bool) -> int | None:
    """Train the plans ``jobs`` at a time in fresh processes; a failed run is named, the others go on. On
    SIGTERM, SIGINT or SIGHUP (:class:`Stop`) the running runs stop with a checkpoint, the rest do not start, and
    the signal's number is returned once every worker has ended (None: every run ended)."""
    import multiprocessing as mp
    import time
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    from entropy_rft.common.threads import available_cores
    from entropy_rft.launch.run import is_finished

    todo = []
    for i, (v, seed, cfg) in enumerate(plans, 1):
        if not overwrite and is_finished(run_dir_of(out, v, seed), cfg.train.max_steps):
            print(f"[{i}/{len(plans)}] {v.label} seed {seed}: already finished, kept", flush=True)
        else:
            todo.append((i, (v, seed, cfg)))
    failed: list[str] = []
    broken: list = []  # the runs a killed worker's broken pool ended: said once every worker has ended
    ctx = mp.get_context("spawn")  # a fresh interpreter per run: no torch state shared with this one
    pools: list = []  # the pool's live workers: a private map of the executor (None once it has shut down)

    def workers() -> list[int]:
        return [p.pid for pool in pools for p in (getattr(pool, "_processes", None) or {}).values() if p.is_alive()]

    with Stop(workers) as stop, ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, max_tasks_per_child=1,
                                                    initializer=_worker_start) as pool:
        pools.append(pool)
        running: dict = {}
        while todo or running:
            while todo and len(running) < jobs and stop.signum is None and not broken:
                i, (v, seed, cfg) = todo.pop(0)
                name = f"{v.dirname}-s{seed}"
                log = out / "logs" / f"{name}.log"
                print(f"[{i}/{len(plans)}] {v.label} seed {seed}: started (log: {log})", flush=True)
                threads = worker_threads(jobs, available_cores(), cfg.train.threads, cfg.model.device)
                fut = pool.submit(_train_logged, cfg, out / name, log, overwrite, threads)
                running[fut] = (i, v, seed, cfg, log, time.time())
            if not running:
                break  # stopped: what was not started stays so
            done, _ = wait(running, timeout=PROGRESS_EVERY_S, return_when=FIRST_COMPLETED)
            if not done:  # the runs' own progress bars are in their logs: one line for all of them here
                print("  " + "; ".join(progress_words(out, v, seed, cfg) for _, v, seed, cfg, *_ in running.values()),
                      flush=True)
            for fut in done:
                i, v, seed, cfg, log, since = running.pop(fut)
                err = fut.exception()
                if isinstance(err, BrokenProcessPool):  # its status is final once the pool's workers have ended
                    broken.append((i, v, seed, cfg, log, since, err))
                    continue
                kind, words = outcome(err, stop.signum is not None, {})
                _said(i, len(plans), v, seed, kind, words, log, failed)
    stopped = 0
    for i, v, seed, cfg, log, since, err in broken:  # the pool has shut down: every worker has ended
        kind, words = outcome(err, stop.signum is not None, status_since(out / f"{v.dirname}-s{seed}", since),
                              cfg.train.checkpoints)
        stopped += kind == "stopped"
        _said(i, len(plans), v, seed, kind, words, log, failed)
    if broken and todo:
        print(f"{len(todo)} run(s) not started: a worker was killed, which ends the pool", flush=True)
    if failed and stop.signum is None:
        rest = "".join(f"{n} {what}; " for n, what in ((stopped, "other run(s) stopped"),
                                                          (len(todo) if broken else 0, "not started")) if n)
        raise UserError(f"{len(failed)} run(s) failed: {'; '.join(failed)}; {rest}fix and rerun the same command "
                        "(finished runs are kept, stopped ones resume)")
    return stop.signum


def _said(i: int, n: int, v: Variant, seed: int, kind: str, words: str, log: Path, failed: list[str]) -> None:
    """A run's line ``[i/n] label seed S: words``; a failed one is also named in ``failed``."""
    if kind == "failed":
        failed.append(f"{v.label} seed {seed} ({words.removeprefix('FAILED: ')}; see {log})")
    elif kind == "stopped" and words == "stopped":
        words = f"stopped (see {log})"
    print(f"[{i}/{n}] {v.label} seed {seed}: {words}", flush=True)


OWN_FILES = ("summary.md", "summary.json", "logs", "report")  # what erft compare (and report --out) writes on top


def _being_written(p: Path) -> bool:
    """What another ``erft compare`` on the same ``--out`` leaves for a moment (lease waves start one per method,
    side by side): a run folder it has locked but not yet marked (no ``run.json`` until its model is built),
    empty or holding only the lock, and the temp file of its atomic summary write (``.summary.json.XXXX``)."""
    from entropy_rft.rundir.lock import LOCK

    if p.is_dir() and not p.is_symlink():
        return all(q.name == LOCK and q.is_file() for q in p.iterdir())
    return any(p.name.startswith(f".{own}.") for own in OWN_FILES)


def check_out_folder(out: Path, plans: list) -> None:
    """``--out`` is new, empty, or an earlier ``erft compare --out``: it holds nothing but run directories made by
    erft, this request's run folders and the summaries. A training run directory or someone's folder is refused
    (never written into)."""
    from entropy_rft.rundir.files import is_run_dir
    from entropy_rft.rundir.lock import LOCK

    if not out.is_dir():
        return
    if is_run_dir(out):
        raise UserError(f"--out {out} is a training run directory, not a folder of compared runs; choose another "
                        "--out")
    planned = {f"{v.dirname}-s{seed}" for v, seed, _ in plans}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in planned and p.name not in OWN_FILES
                     and p.name != LOCK and not _being_written(p) and not (p.is_dir() and is_run_dir(p)))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise UserError(f"--out {out} holds files erft compare did not write ({shown}); choose a new folder or an "
                        "earlier erft compare --out")


def numerics_mismatch(recorded: dict, now: dict) -> str | None:
    """How a run's recorded CPU numerics (run.json's ``cpu_numerics``) differ from what it would compute with now,
    in words (None: the same instruction set and pin, or nothing recorded). A pinned run also names MKL's branch:
    a run pinned before the pin took MKL's vendor-independent branch (no ``mkl_branch`` recorded: MKL_CBWR=AVX2)
    is not this pin's."""
    if not recorded:
        return None
    keys = ("cpu_capability", "pinned", *(("mkl_branch",) if now.get("pinned") else ()))
    if all(recorded.get(k) == now.get(k) for k in keys):
        return None

    def said(r: dict) -> str:
        mkl = f", MKL {r.get('mkl_branch') or 'branch not recorded'}" if "mkl_branch" in keys else ""
        return f"{r.get('cpu_capability')} {'pinned' if r.get('pinned') else 'not pinned'}{mkl}"
    return f"{said(recorded)} there, {said(now)} now"


def planned_numerics(now: dict, cfg: Any) -> dict:
    """What a run of ``cfg`` records as its numerics when started from this process (``now``: its
    ``numerics_record``, taken before any matrix multiply): a pretrained model's run takes MKL's fast branch
    (``training.policies.exact_gemm``), so it is not pinned; the others compute as this process does."""
    if "MKL_CBWR" not in now.get("pin_set", ()):
        return now
    from entropy_rft.training.policies import exact_gemm

    return now if exact_gemm(str(cfg.model.name), cfg.model.cpu_gemm) else {**now, "pinned": False}


def check_recorded_configs(out: Path, plans: list, cpu_numerics: bool = True) -> None:
    """A run this request would keep or resume was trained with the same settings (all but ``train.max_steps``,
    which a rerun may raise) and, with ``cpu_numerics``, the same CPU instruction set (``common.numerics``: only
    a process that trains, pinned as its runs are, can tell); otherwise one table would mix two settings."""
    from entropy_rft.config.schema import changed_fields
    from entropy_rft.rundir.checkpoints import load_run_config
    from entropy_rft.rundir.files import read_status

    now: dict | None = None
    for v, seed, cfg in plans:
        run_dir = run_dir_of(out, v, seed)
        if not (run_dir / "config.yaml").is_file():
            continue
        recorded = read_status(run_dir).get("cpu_numerics") or {}
        if cpu_numerics and recorded and str(cfg.model.device).startswith("cpu"):
            if now is None:
                from entropy_rft.common.numerics import numerics_record

                now = numerics_record()
            mismatch = numerics_mismatch(recorded, planned_numerics(now, cfg))
            if mismatch:
                raise UserError(f"{run_dir} was trained with another CPU instruction set ({mismatch}); one table "
                                "would mix them: choose another --out, pass --overwrite to train every run again, "
                                "or set the pin as it was (ERFT_CPU_PIN, docs/performance.md)")
        changed = changed_fields(load_run_config(run_dir), cfg, ignore=("train.max_steps",))
        if changed:
            shown = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, a, b in changed[:3])
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            raise UserError(f"{run_dir} was trained with other settings ({shown}{more}); one table would mix "
                            "them: choose another --out, or pass --overwrite to train every run again")


def train_all(plans: list[Plan], out: Path, jobs: int, overwrite: bool) -> int | None:
    """Train (or resume, or keep when finished) every plan: in this process one after the other, or ``jobs``
    at a time in fresh processes. Returns the number of the signal that stopped the sweep (SIGTERM, SIGINT,
    SIGHUP: the running runs saved a checkpoint and record "stopped"), or None when every run ended.

    A signal while no run's own handlers hold (``launch.run.StopSignals``, :class:`Stop`: a run loading its model
    or ending, between two runs) stops the sweep there at once (:func:`stop_raises`): there is nothing to save."""
    import signal

    from entropy_rft.launch import run as launch

    out.mkdir(parents=True, exist_ok=True)
    stops = {128 + getattr(signal, name) for name in STOP_SIGNALS}
    try:
        with stop_raises():
            if jobs > 1:
                return run_parallel(plans, out, jobs, overwrite)
            for i, (v, seed, cfg) in enumerate(plans, 1):
                print(f"[{i}/{len(plans)}] {v.label} seed {seed}")
                try:
                    launch.start_or_resume(cfg, run_dir_of(out, v, seed), overwrite=overwrite)
                except SystemExit as e:  # the run's own handlers (launch.run.StopSignals) saved it and said so
                    if isinstance(e.code, int) and e.code in stops:
                        return e.code - 128
                    raise
    except Stopped as s:
        return s.signum
    return None
