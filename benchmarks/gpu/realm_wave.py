"""One seed of the five methods on one GPU that paces itself (issue 49): ``realm.py --paced``, the lease's train
section. Every run of the seed not finished yet starts at once, each its own ``erft compare --methods M --jobs 1``
process (its own process group, its output in ``RUNS/logs/<run>.log``). Once each has logged a training step
(or after ``window_s``), the wave reads their pace (``pace.py``) and keeps only as many runs as can finish by the
deadline, in the methods' fixed order, always the first; the others are killed at once, so that they free the
device. Every ``check_s`` the kept runs are checked against their own pace, measured since the cut, and a run that
can no longer finish is stopped with those after it. At the deadline what runs gets SIGTERM, then SIGKILL.

The wave's record (``--wave-json``) says what started, what was stopped and why, each run's pace, and its verdict:
``all finished``, ``partial`` (the next lease of the plan trains the rest), or ``nothing fits`` with the pace, the
budget one run would need, and the smaller setting that fits (``pace.propose``).
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

from pace import FIT_MARGIN, Pace, measure, propose, remaining_s, run_s, runs_that_fit, runs_to_keep

POLL_S = 0.5


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
        from pace import read_rows

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


def launch(method: str, seeds: int, args, share: int, env: dict) -> Runner:
    """``erft compare`` of one method (the earlier seeds kept from the results, this wave's seed trained) in its
    own process group; ``share``: the runs sharing the device, each with its part of the CPU cores."""
    cmd = [sys.executable, "-m", "entropy_rft.cli", "compare", "--config", args.config, "--methods", method,
           "--seeds", str(seeds), "--jobs", "1", "--out", str(args.runs)]
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    for s in args.set:
        cmd += ["--set", s]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    name = f"{method}-s{seeds - 1}"
    logs = args.runs / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{name}.log").open("a") as log:
        proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": str(max(1, cores // share))}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Runner(name, method, proc, time.monotonic(), args.runs / name)


def kill(r: Runner, why: str, say) -> None:
    """Stop ``r`` at once (SIGKILL to its group: nothing of it is resumed) and say why."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(r.proc.pid, signal.SIGKILL)
    r.proc.wait()
    r.ended = f"stopped: {why}"
    say(f"wave: stopped {r.name} ({why})")


def stop_all(runners: list[Runner], wait_s: float, why: str, say) -> None:
    """SIGTERM to every running run, SIGKILL to those still running after ``wait_s``."""
    live = [r for r in runners if r.running()]
    for r in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, signal.SIGTERM)
    end = time.monotonic() + wait_s
    for r in live:
        try:
            r.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
        r.ended = f"stopped: {why}"
    if live:
        say(f"wave: {why}: stopped {', '.join(r.name for r in live)}")


def settings_of(args) -> dict:
    """The settings every run of the wave has (the config, its --set overrides, --max-steps)."""
    from entropy_rft.config.loading import load_config

    extra = {"train": {"max_steps": args.max_steps}} if args.max_steps is not None else None
    cfg = load_config(args.config, list(args.set), extra=extra, check_method=False)
    return {"train.max_steps": cfg.train.max_steps, "eval.every": cfg.eval.every, "eval.prompts": cfg.eval.prompts,
            "rollout.max_new_tokens": cfg.rollout.max_new_tokens}


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


def borrowed_paces(live: list[Runner]) -> list[Pace | None]:
    """Each run's pace; a run that has not logged a training step yet borrows the median step and evaluation of
    those that have (the wave's runs share every setting but the method), with its own progress."""
    import statistics

    read = [r.pace for r in live if r.pace is not None]
    if not read:
        return [None] * len(live)
    step, ev = statistics.median(p.step_s for p in read), statistics.median(p.eval_s for p in read)
    return [r.pace or Pace(0.0, step, ev, 0, int(r.t_row0 is not None)) for r in live]


def cut(wave: Wave, live: list[Runner], rem: list[float], left: float, pending: list[str], seeds: int,
        say) -> int:
    """The first decision: how many of the running runs go on (at least the first; :func:`pace.runs_that_fit`);
    the others are killed, and the runs not started yet are given up when any is. Returns the count kept."""
    fit = runs_that_fit(rem, len(live), left)
    keep = max(1, fit)
    wave.data["decisions"].append({"at_s": wave.at(), "share": len(live), "left_s": round(left, 1), "fit": fit,
                                   "remaining_s": {r.name: round(x, 1) for r, x in zip(live, rem)},
                                   "kept": [r.name for r in live[:keep]]})
    say(f"wave: pace read at {wave.at():.0f} s with {len(live)} run(s) sharing the device; each needs "
        + ", ".join(f"{r.name} {x:.0f} s" for r, x in zip(live, rem)) + f"; {left:.0f} s left: "
        + (f"{fit} can finish with the device shared {fit} way(s)" if fit else
           "none can at this pace; the first goes on alone, measured again"))
    for r in live[keep:]:
        kill(r, f"cannot finish by the deadline with {keep} run(s) ahead of it", say)
        wave.data["stopped"][r.name] = f"cut at {wave.at()} s: {len(live)} runs measured, {keep} kept"
    if keep < len(live):
        for m in pending:
            wave.data["stopped"][f"{m}-s{seeds - 1}"] = f"not started: the budget fits {keep} run(s)"
        pending.clear()
    wave.data["paces"] = _paces(live)
    wave.save()
    return keep


def train_wave(args, seeds: int, missing: list[str], env: dict, say) -> int:
    """Train the runs ``missing`` (method names, in the fixed order) of seed ``seeds - 1``, paced as the module
    says. Returns 0 when every one finished, 3 otherwise (the record says why)."""
    settings = settings_of(args)
    n, every = settings["train.max_steps"], settings["eval.every"]
    budget_end = time.monotonic() + args.deadline_s
    wave = Wave(args.wave_json, say, seed=seeds - 1, methods=missing, budget_s=args.deadline_s,
                settings=settings, started=[f"{m}-s{seeds - 1}" for m in missing])
    wave.save()
    for m in missing:  # what an earlier call on this machine left of it: never resumed (no checkpoints)
        shutil.rmtree(args.runs / f"{m}-s{seeds - 1}", ignore_errors=True)
    pending = list(missing)
    first = min(args.at_once, len(pending))
    runners = [launch(pending.pop(0), seeds, args, first, env) for _ in range(first)]
    say(f"wave: started {len(runners)} run(s) at once: {', '.join(r.name for r in runners)}"
        + (f" ({', '.join(pending)} after them, as the pace allows)" if pending else "")
        + f"; budget {args.deadline_s:.0f} s; the pace is read once each has logged a step (at most "
        f"{args.window_s:.0f} s)")
    cut_done, next_check, share = False, 0.0, len(runners)
    while any(r.running() for r in runners) or (cut_done and pending):
        time.sleep(POLL_S)
        now = time.monotonic()
        live = [r for r in runners if r.running()]
        for r in live:
            r.look(now)
        if now >= budget_end:
            stop_all(runners, args.stop_wait_s, "the deadline", say)
            break
        if not cut_done:
            if not live:
                cut_done = True  # every run ended before its pace was read
                continue
            measured = all(r.pace is not None for r in live)
            if not (measured or now - wave.t0 >= args.window_s):
                continue
            rem = [remaining_s(p, n, every) if p else float("inf") for p in borrowed_paces(live)]
            if args.budget_runs is not None:  # the CPU rehearsal's slow device: a budget of so many runs
                ref = [x for x in rem[: int(args.budget_runs) + 1] if x != float("inf")]
                budget_end = now + args.budget_runs / len(live) * FIT_MARGIN * (max(ref) if ref else 0.0)
                wave.data["budget_s"] = round(budget_end - wave.t0, 1)
            keep = cut(wave, live, rem, budget_end - now, pending, seeds, say)
            for r in live[:keep]:
                r.cut_step = (r.pace.steps if r.pace else 0) + 1  # the step under way straddles the cut
            cut_done, share, next_check = True, keep, now + args.check_s
            continue
        if pending and len(live) < args.at_once:  # a slot is free: the next run starts if it can finish
            ref = next((r.pace for r in runners if r.pace is not None), None)
            need = run_s(ref, n, every) if ref else float("inf")
            if need * FIT_MARGIN <= budget_end - now:
                runners.append(launch(pending.pop(0), seeds, args, len(live) + 1, env))
                say(f"wave: started {runners[-1].name} (one run needs {need:.0f} s at the pace read; "
                    f"{budget_end - now:.0f} s left)")
                continue
            for m in pending:
                wave.data["stopped"][f"{m}-s{seeds - 1}"] = f"not started: one run needs {need:.0f} s, " \
                                                            f"{budget_end - now:.0f} s left"
            say(f"wave: {', '.join(pending)} not started: one run needs {need:.0f} s, {budget_end - now:.0f} s left")
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
            wave.data["paces"] = _paces(runners)
            wave.save()
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
    from realm import _finished

    finished = [r.name for r in runners if r.ended == "finished" and _finished(r.folder)]
    wave.data["started"] = [r.name for r in runners]
    for name in (f"{m}-s{wave.data['seed']}" for m in wave.data["methods"]):
        if name not in wave.data["started"]:
            wave.data["stopped"].setdefault(name, "not started: the deadline came first")
    total = len(wave.data["methods"])
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

