"""A realm wave's pace, read off its runs, and what it decides: how many runs can finish by the deadline, and,
when not even one can, the smaller setting that fits (issue 49). Pure functions of numbers; the standard library
only (the GPU machine imports this before any carried wheel, and the lease kit reads it here).

A run's time is ``startup + max_steps x step + evaluations x eval`` (an evaluation at step 0, at every multiple of
``eval.every`` and at the last step). Its pace is measured from its own files: ``run.json`` appears when the model
is built (the startup ends, the step-0 evaluation starts), the step-0 row ends that evaluation, and every later
row carries ``time/step`` (with ``time/eval`` at the steps that evaluate).

Runs that share one GPU take turns on it: the wave assumes the device's throughput is shared, so ``k`` runs of
the ``m`` measured would each need ``k/m`` of the time measured, and runs that wait for room need their whole
run's work on top (:func:`finish_s`, :func:`runs_that_fit`); it checks the runs it kept against their own pace
once they run with fewer (:func:`runs_to_keep`). Memory is part of what fits: no more runs at once than the
device's free memory holds at one run's measured peak (:func:`memory_cap`).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

FIT_MARGIN = 1.1  # a cut keeps runs whose projected time, times this, fits what is left
MEM_MARGIN = 1.25  # a run's measured peak memory, times this, is what each run is given
TRIM_SLACK = 1.15  # a kept run is stopped only when its projection is over what is left by more than this
SETTING_KEYS = ("train.max_steps", "eval.every", "eval.prompts", "rollout.max_new_tokens")


@dataclass(frozen=True)
class Pace:
    """One run's measured figures (seconds), and how far it is."""

    startup_s: float  # launch to a built model (run.json)
    step_s: float  # one training step, its evaluation left out
    eval_s: float  # one evaluation
    steps: int  # training steps logged
    evals: int  # evaluations logged

    def to_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def read_rows(path: Path) -> list[dict]:
    """The intact rows of a metrics.jsonl another process is writing (a torn last line is left for later)."""
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            rows.append(r)
    return rows


def eval_steps(max_steps: int, every: int) -> list[int]:
    """The steps that evaluate: 0, each multiple of ``every`` and the last (none when ``every`` is 0)."""
    if every <= 0:
        return []
    return sorted({*range(0, max_steps + 1, every), max_steps})


def measure(rows: list[dict], startup_s: float | None, eval0_s: float | None, since_step: int = 0) -> Pace | None:
    """A run's pace from its rows: the median step (``time/step`` less ``time/eval``) and evaluation of the rows
    after ``since_step`` (a cut: the steps the run took once it had more of the device), else of all rows;
    ``eval0_s``: the step-0 evaluation, timed from outside. None until a training step is logged."""
    train = [r for r in rows if r["step"] >= 1 and isinstance(r.get("time/step"), (int, float))]
    if not train or startup_s is None:
        return None
    late = [r for r in train if r["step"] > since_step]
    use = late if late else train
    steps = [r["time/step"] - (r.get("time/eval") or 0.0) for r in use]
    evals = [r["time/eval"] for r in use if isinstance(r.get("time/eval"), (int, float))]
    if not evals:
        evals = [r["time/eval"] for r in train if isinstance(r.get("time/eval"), (int, float))]
    if not evals and eval0_s is not None:
        evals = [eval0_s]
    n_evals = sum(1 for r in rows if any(k.startswith("eval/") for k in r))
    return Pace(startup_s, max(0.0, statistics.median(steps)), statistics.median(evals) if evals else 0.0,
                max(r["step"] for r in train), n_evals)


def remaining_s(p: Pace, max_steps: int, every: int) -> float:
    """Seconds a running run needs to finish at pace ``p``."""
    evals_left = max(0, len(eval_steps(max_steps, every)) - p.evals)
    return max(0, max_steps - p.steps) * p.step_s + evals_left * p.eval_s


def run_s(p: Pace, max_steps: int, every: int) -> float:
    """Seconds one run needs from its launch at pace ``p``."""
    return p.startup_s + max_steps * p.step_s + len(eval_steps(max_steps, every)) * p.eval_s


def finish_s(needs: list[float], share: int, cap: int) -> float:
    """When the last of the runs ``needs`` ends (each one's seconds to finish, measured while ``share`` runs shared
    the device; a run not started yet needs its whole run), run in order at most ``cap`` at once: the device's
    throughput is shared, so the runs need their total work, ``sum / share`` seconds of the device alone, and none
    ends sooner than it would sharing the device with ``min(len, cap)`` runs."""
    if not needs:
        return 0.0
    return max(sum(needs) / share, max(needs) * min(len(needs), cap) / share)


def budget_of(needs: list[float], share: int, cap: int, runs: float) -> float:
    """The seconds ``runs`` of ``needs`` take (:func:`finish_s`, interpolated between whole counts) with
    ``FIT_MARGIN``: the CPU rehearsal's slow device (a budget of 7.5 runs fits seven, not eight)."""
    lo = int(runs)
    a, b = finish_s(needs[:lo], share, cap), finish_s(needs[: lo + 1], share, cap)
    return (a + (b - a) * (runs - lo)) * FIT_MARGIN


def runs_that_fit(needs: list[float], share: int, left_s: float, cap: int | None = None) -> int:
    """How many of the runs ``needs`` (in the wave's fixed order: the running ones first, then those not started)
    can be kept: the largest ``k`` whose first ``k`` all end (:func:`finish_s`, at most ``cap`` at once, the
    memory's count) within ``left_s`` with ``FIT_MARGIN`` to spare."""
    cap = len(needs) if cap is None else max(1, cap)
    best = 0
    for k in range(1, len(needs) + 1):
        if finish_s(needs[:k], share, cap) * FIT_MARGIN <= left_s:
            best = k
    return best


def still_fits(needs: list[float], share: int, left_s: float, cap: int) -> bool:
    """Whether a kept run not started yet (the last of ``needs``, after the running ones) still ends in time: as
    :func:`runs_to_keep` judges a running one, over what is left by no more than ``TRIM_SLACK`` (the cut kept it
    with ``FIT_MARGIN`` to spare)."""
    return finish_s(needs, share, cap) <= left_s * TRIM_SLACK


def memory_cap(free_mib: float, peak_mib: float) -> int:
    """How many runs the device's free memory (``free_mib``, read before any run started) holds at one run's
    measured peak (``peak_mib``) with ``MEM_MARGIN`` to spare; at least 1 (the first run always goes on)."""
    if peak_mib <= 0:
        return 1
    return max(1, int(free_mib // (peak_mib * MEM_MARGIN)))


def runs_to_keep(remaining: list[float], left_s: float) -> int:
    """After a cut: how many of the kept runs (in order) to go on with, each at its own pace as measured now; a
    run over what is left by more than ``TRIM_SLACK`` is stopped, and the runs after it. May be 0."""
    for i, r in enumerate(remaining):
        if r > left_s * TRIM_SLACK:
            return i
    return len(remaining)


def _scaled(settings: dict, changes: dict) -> dict:
    return {**settings, **changes}


def candidates(settings: dict) -> list[dict]:
    """The smaller settings, least change first, each one the last plus one cut: fewer evaluation prompts (1/2,
    1/4), fewer steps (4/5, 2/3, 1/2; ``eval.every`` scaled so the count of evaluations stays), shorter
    responses (3/4, 1/2)."""
    n, every, prompts, tokens = (int(settings[k]) for k in SETTING_KEYS)
    out, cur = [], {}
    for f in (2, 4):
        cur = {**cur, "eval.prompts": max(1, prompts // f)}
        out.append(dict(cur))
    for f in (0.8, 2 / 3, 0.5):
        steps = max(1, round(n * f))
        cur = {**cur, "train.max_steps": steps, "eval.every": max(1, round(every * steps / n)) if every else 0}
        out.append(dict(cur))
    for f in (0.75, 0.5):
        cur = {**cur, "rollout.max_new_tokens": max(1, round(tokens * f))}
        out.append(dict(cur))
    seen, unique = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        if key not in seen and any(settings[k] != v for k, v in c.items()):
            seen.add(key)
            unique.append(c)
    return unique


def predicted_s(p: Pace, settings: dict, changes: dict) -> float:
    """One run's seconds under ``changes``: a step scales with the response length, an evaluation with the
    prompts and the response length; the startup stays."""
    new = _scaled(settings, changes)
    tokens = new["rollout.max_new_tokens"] / settings["rollout.max_new_tokens"]
    prompts = new["eval.prompts"] / settings["eval.prompts"]
    evals = len(eval_steps(int(new["train.max_steps"]), int(new["eval.every"])))
    return p.startup_s + new["train.max_steps"] * p.step_s * tokens + evals * p.eval_s * prompts * tokens


def propose(p: Pace, settings: dict, budget_s: float) -> dict:
    """The least change of ``settings`` (:func:`candidates`) under which one run at pace ``p`` fits ``budget_s``
    with ``FIT_MARGIN``: ``{"sets": {key: value}, "predicted_s": ...}``; ``sets`` is None when even the smallest
    does not fit (then ``predicted_s`` is the smallest's)."""
    last = None
    for c in candidates(settings):
        t = predicted_s(p, settings, c)
        last = (c, t)
        if t * FIT_MARGIN <= budget_s:
            return {"sets": c, "predicted_s": round(t, 1), "budget_s": round(budget_s, 1)}
    return {"sets": None, "predicted_s": round(last[1], 1) if last else math.inf, "budget_s": round(budget_s, 1),
            "smallest": last[0] if last else None}
