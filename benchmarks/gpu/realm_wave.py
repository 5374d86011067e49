"""Every missing run of the comparison on one GPU that paces itself (issues 49 and 64): ``realm.py --paced``, the
lease's train section. The runs not finished yet, of every seed, go in one fixed order that completes seeds first
(seed 0's five methods, then seed 1's, then seed 2's); each is its own ``erft compare --methods M --seed S
--seeds 1 --jobs 1`` process (its own process group, its output in ``RUNS/logs/<run>.log``).

Memory first: the device's free memory is read before any run starts; the first run starts alone unless an
earlier lease measured a run's peak (``--peak-mib``); once it has logged a training step its peak
(``perf/peak_memory_gb``, plus the CUDA context) says how many runs the memory holds (``pace.memory_cap``), and
no more than that ever run at once. Then the pace: once each run has logged a training step (or after
``window_s``), the wave keeps the longest prefix of the order that can finish by the deadline at the shared pace
(``pace.runs_that_fit``; 10 % to spare), always the first; running runs past it are killed at once, so that they
free the device, and the runs of the prefix not started yet start as room frees. Every ``check_s`` the kept runs
are checked against their own pace, measured since the cut, and a run that can no longer finish is stopped with
those after it. At the deadline what runs gets SIGTERM, then SIGKILL.

The wave's record (``--wave-json``) says what started, what was stopped and why, each run's pace, the memory
(free, a run's peak, how many fit), and its verdict: ``all finished``, ``partial`` (the next lease trains the
rest), or ``nothing fits`` with the pace, the budget one run would need, and the smaller setting that fits
(``pace.propose``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu.pace import (
    MEM_MARGIN,
    Pace,
    budget_of,
    measure,
    memory_cap,
    propose,
    remaining_s,
    run_s,
    runs_that_fit,
    runs_to_keep,
    still_fits,
)
from entropy_rft.common.processes import signal_session
from entropy_rft.launch.sessions import kill_session, start_session

POLL_S = 0.5
UNLIMITED = 1 << 30  # the runs a device whose free memory could not be read is taken to hold
CUDA_CONTEXT_MIB = 512  # a process's CUDA context, not in the allocator's peak a run logs


@dataclass
class Runner:
    """One run of the wave: its process and what was seen of it."""

    name: str
    method: str
    proc: subprocess.Popen
    t_launch: float
    folder: Path
    t_ready: float | None = None  # run.json appeared: the model is built, the step-0 evaluation starts
    t_row0: float | None = None  # the step-0 row appeared
    cut_step: int = 0  # the steps it had logged at the last cut (its pace is measured after them)
    pace: Pace | None = None
    ended: str | None = None
    rows: list = field(default_factory=list)

    def look(self, now: float) -> None:
        from benchmarks.gpu.pace import read_rows

        if self.t_ready is None and (self.folder / "run.json").is_file():
            self.t_ready = min(now, (self.folder / "run.json").stat().st_mtime - time.time() + now)
        self.rows = read_rows(self.folder / "metrics.jsonl")
        if self.t_row0 is None and any(r["step"] == 0 for r in self.rows):
            self.t_row0 = now
        startup = None if self.t_ready is None else max(0.0, self.t_ready - self.t_launch)
        eval0 = None if self.t_ready is None or self.t_row0 is None else max(0.0, self.t_row0 - self.t_ready)
        self.pace = measure(self.rows, startup, eval0, since_step=self.cut_step)

    def running(self) -> bool:
        return self.ended is None and self.proc.poll() is None

    def peak_mib(self) -> float | None:
        """The largest ``perf/peak_memory_gb`` its rows logged, in MiB (None before its first training step)."""
        seen = [r["perf/peak_memory_gb"] for r in self.rows if isinstance(r.get("perf/peak_memory_gb"), (int, float))]
        return max(seen) * 1024 if seen else None


def run_name(method: str, seed: int) -> str:
    return f"{method}-s{seed}"


def launch(method: str, seed: int, args, share: int, env: dict) -> Runner:
    """``erft compare`` of one method and seed (``--seed S --seeds 1``) in its own process group; ``share``: the runs
    sharing the device, each with its part of the CPU cores."""
    cmd = [sys.executable, "-m", "entropy_rft.cli", "compare", "--config", args.config, "--methods", method,
           "--seed", str(seed), "--seeds", "1", "--jobs", "1", "--out", str(args.runs)]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    for s in args.set:
        cmd += ["--set", s]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    name = run_name(method, seed)
    logs = args.runs / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{name}.log").open("a") as log:
        proc = start_session(cmd, env={**env, "OMP_NUM_THREADS": str(max(1, cores // share))}, stdout=log,
                             stderr=subprocess.STDOUT)
    return Runner(name, method, proc, time.monotonic(), args.runs / name)


def kill(r: Runner, why: str, say) -> None:
    """Stop ``r`` at once (SIGKILL to its session: nothing of it is resumed) and say why."""
    kill_session(r.proc)
    r.ended = f"stopped: {why}"
    say(f"wave: stopped {r.name} ({why})")


def stop_all(runners: list[Runner], wait_s: float, why: str, say) -> None:
    """SIGTERM to every running run, SIGKILL to those still running after ``wait_s``."""
    live = [r for r in runners if r.running()]
    for r in live:
        signal_session(r.proc.pid, signal.SIGTERM)
    end = time.monotonic() + wait_s
    for r in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(timeout=max(0.1, end - time.monotonic()))
        kill_session(r.proc)  # the last resort, to every process of its session
        r.ended = f"stopped: {why}"
    if live:
        say(f"wave: {why}: stopped {', '.join(r.name for r in live)}")


def settings_of(args) -> dict:
    """The settings every run of the wave has (the config, its --set overrides, --max-steps), and its device."""
    from entropy_rft.config.loading import load_config

    extra = {"train": {"max_steps": args.max_steps}} if args.max_steps is not None else None
    cfg = load_config(args.config, list(args.set), extra=extra, check_method=False)
    return {"train.max_steps": cfg.train.max_steps, "eval.every": cfg.eval.every, "eval.prompts": cfg.eval.prompts,
            "rollout.max_new_tokens": cfg.rollout.max_new_tokens}, str(cfg.model.device)


def free_mib(device: str) -> float | None:
    """The device's free memory in MiB, read from outside the runs (the wave itself never touches the GPU):
    ``nvidia-smi``, else a short torch process; on a CPU, the kernel's MemAvailable. None when unreadable."""
    if device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            return float(out[0])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
        try:
            out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.mem_get_info()[0] / 2**20)"],
                                 capture_output=True, text=True, timeout=120).stdout.split()
            return float(out[-1])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Wave:
    """The record of the wave, written (atomically) at every decision."""

    def __init__(self, path: Path | None, say, **fields):
        self.path, self.say, self.t0 = path, say, time.monotonic()
        self.data: dict = {**fields, "decisions": [], "stopped": {}}

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def _paces(runners: list[Runner]) -> dict:
    return {r.name: r.pace.to_dict() for r in runners if r.pace is not None}


def median_pace(paces: list[Pace]) -> Pace | None:
    """The median startup, step and evaluation of ``paces`` (a run not started yet is expected to take it)."""
    import statistics

    if not paces:
        return None
    return Pace(statistics.median(p.startup_s for p in paces), statistics.median(p.step_s for p in paces),
                statistics.median(p.eval_s for p in paces), 0, 0)


def borrowed_paces(live: list[Runner]) -> list[Pace | None]:
    """Each run's pace; a run that has not logged a training step yet borrows the median step and evaluation of
    those that have (the wave's runs share every setting but the method and seed), with its own progress."""
    ref = median_pace([r.pace for r in live if r.pace is not None])
    if ref is None:
        return [None] * len(live)
    return [r.pace or Pace(0.0, ref.step_s, ref.eval_s, 0, int(r.t_row0 is not None)) for r in live]


class Memory:
    """How many runs the device's memory holds: its free memory read before any run started, one run's peak (an
    earlier lease's, or the first run's once it has logged a training step), ``MEM_MARGIN`` to spare."""

    def __init__(self, free: float | None, prior_peak_mib: float | None, played_runs: float | None, cuda: bool):
        self.free, self.played, self.context = free, played_runs, CUDA_CONTEXT_MIB if cuda else 0.0
        self.peak: float | None = None
        self.source = ""
        self.cap: int | None = None
        if prior_peak_mib:
            self.set_peak(prior_peak_mib, "an earlier lease's run", with_context=False)

    def set_peak(self, peak_mib: float, source: str, with_context: bool = True) -> int:
        self.peak = peak_mib + (self.context if with_context else 0.0)
        self.source = source
        if self.played is not None:  # the CPU rehearsal's small device: the memory holds that many runs
            self.cap = max(1, int(self.played))
        elif self.free is None:
            self.cap = UNLIMITED  # unreadable: the pace alone decides (the record says so)
        else:
            self.cap = memory_cap(self.free, self.peak)
        return self.cap

    def to_dict(self) -> dict:
        return {"free_mib": None if self.free is None else round(self.free), "peak_mib": None if self.peak is None
                else round(self.peak), "peak_from": self.source, "margin": MEM_MARGIN,
                "runs_it_holds": None if self.cap == UNLIMITED else self.cap,
                **({"played_runs": self.played} if self.played is not None else {})}


def cut(wave: Wave, started: list[Runner], needs: list[float], share: int, room: int, left: float,
        pending: list[tuple[str, int]], say) -> int:
    """The first decision: the longest prefix of the order (the runs started, in order, then those not started;
    ``needs``: each one's seconds to finish, 0 for a run that ended, measured with ``share`` runs on the device)
    that can finish with at most ``room`` at once (:func:`pace.runs_that_fit`), always the first still running;
    running runs past it are killed, runs past it not started yet are given up. Returns the count kept."""
    names = [r.name for r in started] + [run_name(m, s) for m, s in pending]
    fit = runs_that_fit(needs, share, left, room)
    first = next((i for i, r in enumerate(started) if r.running()), 0)
    keep = max(first + 1, fit)
    wave.data["decisions"].append({"at_s": wave.at(), "share": share, "left_s": round(left, 1), "fit": fit,
                                   "at_once": room, "remaining_s": {n: round(x, 1) for n, x in zip(names, needs)},
                                   "kept": names[:keep]})
    say(f"wave: pace read at {wave.at():.0f} s with {share} run(s) sharing the device; "
        + ", ".join(f"{r.name} needs {x:.0f} s" for r, x in zip(started, needs) if r.running())
        + (f"; a run not started needs {needs[len(started)]:.0f} s" if len(needs) > len(started) else "")
        + f"; {left:.0f} s left, at most {room} at once: "
        + (f"the first {fit} of {len(names)} can finish" if fit > first else
           "none more can at this pace; the first goes on alone, measured again"))
    for r in started[keep:]:
        if r.running():
            kill(r, f"cannot finish by the deadline with {keep} run(s) ahead of it", say)
            wave.data["stopped"][r.name] = f"cut at {wave.at()} s: {len(names)} runs measured, {keep} kept"
    start = max(0, keep - len(started))
    for m, s in pending[start:]:
        wave.data["stopped"][run_name(m, s)] = f"not started: the budget fits {keep} run(s)"
    del pending[start:]
    wave.data["paces"] = _paces(started)
    wave.save()
    return keep


def train_wave(args, runs: list[tuple[str, int]], env: dict, say) -> int:
    """Train ``runs`` (method, seed; in the wave's order: seeds first), paced as the module says. Returns 0 when
    every one finished, 3 otherwise (the record says why)."""
    settings, device = settings_of(args)
    n, every = settings["train.max_steps"], settings["eval.every"]
    budget_end = time.monotonic() + args.deadline_s
    names = [run_name(m, s) for m, s in runs]
    wave = Wave(args.wave_json, say, runs=names, budget_s=args.deadline_s, settings=settings, started=[])
    for name in names:  # what an earlier call on this machine left of it: never resumed (no checkpoints)
        shutil.rmtree(args.runs / name, ignore_errors=True)
    mem = Memory(free_mib(device), args.peak_mib, args.memory_runs, device.startswith("cuda"))
    wave.data["memory"] = mem.to_dict()
    pending = list(runs)
    first = 1 if mem.cap is None else min(args.at_once, mem.cap, len(pending))
    runners = [launch(*pending.pop(0), args, first, env) for _ in range(first)]
    say(f"wave: {len(runs)} run(s) missing, seeds first: {', '.join(names)}; started {first} at once "
        f"({', '.join(r.name for r in runners)}); budget {args.deadline_s:.0f} s; "
        + (f"the memory holds {mem.cap} at {mem.peak:.0f} MiB a run ({mem.source})" if mem.cap is not None else
           "the first runs alone until its peak memory is read")
        + f"; the pace is read once each running run has logged a step (at most {args.window_s:.0f} s)")
    wave.save()
    cut_done, next_check, share, window_from, most = False, 0.0, len(runners), wave.t0, len(runners)
    while any(r.running() for r in runners) or (cut_done and pending):
        time.sleep(POLL_S)
        now = time.monotonic()
        live = [r for r in runners if r.running()]
        for r in live:
            r.look(now)
        if now >= budget_end:
            stop_all(runners, args.stop_wait_s, "the deadline", say)
            break
        room = min(args.at_once, mem.cap or 1)
        if mem.cap is None:  # the first run alone: how many runs the memory holds, once its peak is read
            peak = runners[0].peak_mib()
            if peak is None and runners[0].running():
                continue
            if peak is None:
                mem.cap, mem.source = 1, f"none: {runners[0].name} ended before logging a step"
            else:
                mem.set_peak(peak, f"{runners[0].name}, measured")
            more = max(0, min(args.at_once, mem.cap, len(pending) + len(live)) - len(live))
            runners += [launch(*pending.pop(0), args, len(live) + more, env) for _ in range(more)]
            runners[0].cut_step = runners[0].pace.steps if runners[0].pace else 0  # its pace from now on, shared
            wave.data["memory"] = mem.to_dict()
            say(f"wave: {mem.source}: peak {mem.peak or 0:.0f} MiB a run, {mem.free or 0:.0f} MiB free: the memory "
                f"holds {mem.cap} run(s); started {more} more")
            window_from, share = now, len(live) + more
            wave.save()
            continue
        most = max(most, len(live))
        if not cut_done:
            if not live:
                cut_done = True  # every run ended before its pace was read
                continue
            measured = all(r.pace is not None for r in live)
            if not (measured or now - window_from >= args.window_s):
                continue
            paces = dict(zip((r.name for r in live), borrowed_paces(live)))
            ref = median_pace([p for p in paces.values() if p is not None])
            needs = [0.0 if r.name not in paces else remaining_s(paces[r.name], n, every) if paces[r.name]
                     else float("inf") for r in runners]  # a run that ended already needs nothing more
            needs += [run_s(ref, n, every) if ref else float("inf") for _ in pending]
            if args.budget_runs is not None:  # the CPU rehearsal's slow device: a budget of so many runs
                budget_end = now + budget_of(needs, len(live), room, args.budget_runs)
                wave.data["budget_s"] = round(budget_end - wave.t0, 1)
            keep = cut(wave, runners, needs, len(live), room, budget_end - now, pending, say)
            kept = [r for r in runners[:keep] if r.running()]
            for r in kept:
                r.cut_step = (r.pace.steps if r.pace else 0) + 1  # the step under way straddles the cut
            cut_done, share, next_check = True, max(1, min(len(kept), room)), now + args.check_s
            continue
        if pending and len(live) < room:  # room is free: the next kept run starts unless it can no longer finish
            ref = median_pace([r.pace for r in runners if r.pace is not None])
            needs = [remaining_s(r.pace, n, every) if r.pace else 0.0 for r in live]
            needs.append(run_s(ref, n, every) if ref else float("inf"))
            if still_fits(needs, share, budget_end - now, room):
                runners.append(launch(*pending.pop(0), args, len(live) + 1, env))
                wave.data["started"] = [r.name for r in runners]
                say(f"wave: started {runners[-1].name} (one run needs {needs[-1]:.0f} s at the pace read; "
                    f"{budget_end - now:.0f} s left)")
                wave.save()
                continue
            for m, s in pending:
                wave.data["stopped"][run_name(m, s)] = f"not started: one run needs {needs[-1]:.0f} s with " \
                                                       f"{len(live)} running, {budget_end - now:.0f} s left"
            say(f"wave: {', '.join(run_name(m, s) for m, s in pending)} not started: one run needs "
                f"{needs[-1]:.0f} s, {budget_end - now:.0f} s left")
            pending.clear()
        if now < next_check:
            continue
        next_check = now + args.check_s
        clean = [r for r in live if r.pace is not None and any(x["step"] > r.cut_step for x in r.rows)]
        if len(clean) < len(live):
            continue  # each kept run is judged on a step taken after the cut
        rem = [remaining_s(r.pace, n, every) for r in live]
        keep = runs_to_keep(rem, budget_end - now)
        if keep < len(live):
            wave.data["decisions"].append({"at_s": wave.at(), "share": len(live), "left_s": round(budget_end - now, 1),
                                           "remaining_s": {r.name: round(x, 1) for r, x in zip(live, rem)},
                                           "kept": [r.name for r in live[:keep]]})
            for r, x in zip(live[keep:], rem[keep:]):
                kill(r, f"needs {x:.0f} s at its pace since the cut, {budget_end - now:.0f} s left", say)
                wave.data["stopped"][r.name] = f"at {wave.at()} s: needs {x:.0f} s, {budget_end - now:.0f} s left"
            if pending:  # the runs after a stopped one are given up with it
                for m, s in pending:
                    wave.data["stopped"][run_name(m, s)] = "not started: a run before it could not finish"
                pending.clear()
            wave.data["paces"] = _paces(runners)
            wave.save()
    wave.data["most_at_once"] = most
    return finish(wave, runners, settings, share)


def finish(wave: Wave, runners: list[Runner], settings: dict, share: int) -> int:
    """The verdict in the record; with nothing finished, the pace of the first run and the smaller setting."""
    for r in runners:
        if r.ended is None:
            rc = r.proc.wait()
            log = r.folder.parent / "logs" / f"{r.name}.log"
            r.ended = "finished" if rc == 0 else f"failed (exit {rc}; see {log})"
            if rc:
                tail = log.read_text(errors="replace").splitlines()[-8:] if log.is_file() else []
                wave.say(f"wave: {r.name} failed (exit {rc}); the end of its log:\n" + "\n".join(tail))
        r.look(time.monotonic())
    from entropy_rft.rundir.finished import finished as run_finished

    finished = [r.name for r in runners if r.ended == "finished" and run_finished(r.folder)]
    wave.data["started"] = [r.name for r in runners]
    for name in wave.data["runs"]:
        if name not in wave.data["started"]:
            wave.data["stopped"].setdefault(name, "not started: the deadline came first")
    total = len(wave.data["runs"])
    wave.data.update(finished=finished, ended={r.name: r.ended for r in runners}, paces=_paces(runners),
                     wall_s=wave.at())
    n, every = settings["train.max_steps"], settings["eval.every"]
    failed = [r.name for r in runners if r.ended.startswith("failed")]
    if failed:
        wave.data["failed"] = failed
    if len(finished) == total:
        wave.data["verdict"] = "all finished"
    elif failed and not finished:
        wave.data["verdict"] = "failed"
        wave.say(f"wave: {', '.join(failed)} failed (their logs are above): mend here before another lease")
    elif finished:
        wave.data["verdict"] = "partial"
        wave.say(f"wave: {len(finished)} of {total} run(s) finished ({', '.join(finished)}); the next lease "
                 "of this plan trains the rest")
    else:
        first = next((r for r in runners if r.pace is not None), None)
        wave.data["verdict"] = "nothing fits"
        if first is None:
            wave.data["why"] = "no run logged a training step before the deadline"
            wave.say("wave: nothing finished, and no run logged a training step: no pace to propose from")
        else:
            need = run_s(first.pace, n, every)
            prop = propose(first.pace, settings, wave.data["budget_s"])
            alone = first.cut_step > 0 and any(x["step"] > first.cut_step for x in first.rows)
            wave.data.update(pace=first.pace.to_dict(), pace_run=first.name,
                             pace_share=share if alone else len(runners),
                             needed_s=round(need, 1), proposal=prop)
            wave.say(f"wave: nothing fits: {first.name} at its pace ({first.pace.step_s:.2f} s a step, "
                     f"{first.pace.eval_s:.2f} s an evaluation, {first.pace.startup_s:.0f} s to start) needs "
                     f"{need:.0f} s, the budget is {wave.data['budget_s']:.0f} s; "
                     + (f"proposal: {prop['sets']} (one run {prop['predicted_s']:.0f} s)" if prop["sets"] else
                        f"even the smallest setting needs {prop['predicted_s']:.0f} s"))
    wave.save()
    return 0 if len(finished) == total else 2 if failed else 3

