"""A run folder as a resumable sweep sees it (``launch.results``, the drivers of benchmarks/gpu and the lease kit):
the files a run ships, and whether it finished, proven from its rows (issue 73): the one definition of a finished
run that a sweep exports or keeps. The standard library and PyYAML only (every environment that runs erft has it,
the GPU image too)."""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED = ("metrics.jsonl", "config.yaml", "run.json", "samples.jsonl")  # per run; everything else stays
MAX_METRICS_BYTES = 256 << 20  # a metrics.jsonl larger than this is not a run's (100 steps: about 1 MB)


def claims_finished(run_dir: str | Path) -> bool:
    """Whether ``run_dir``'s ``run.json`` says the run finished all its steps. A damaged ``run.json`` is data: the
    run is not finished (no traceback)."""
    try:
        info = json.loads((Path(run_dir) / "run.json").read_text())
        return info.get("status") == "finished" and int(info.get("step", 0)) >= int(info.get("max_steps", 1 << 30))
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def spans(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"`` (sorted, each step once)."""
    runs: list[list[int]] = []
    for s in sorted(set(steps)):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def eval_steps(max_steps: int, every: int) -> list[int]:
    """The steps at which a run evaluates (training/trainer.py): step 0 and every ``every`` steps, and the last;
    none when ``every`` is 0."""
    if every <= 0:
        return []
    return [s for s in range(max_steps + 1) if s % every == 0 or s == max_steps]


def _eval_every(run_dir: Path) -> int:
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    every = cfg["eval"]["every"]
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError("eval.every is not a whole number")
    return every


def missing(run_dir: str | Path) -> str | None:
    """What keeps ``run_dir`` from being a finished run, in words, or None when it is one: ``run.json`` says
    finished with ``max_steps`` steps, and ``metrics.jsonl`` ends in a whole line and holds every step once
    (step 0 too when the run evaluates) and an evaluation at every step the run evaluates at (its
    ``config.yaml``'s ``eval.every``). A run is never taken as finished from ``run.json`` alone: a copy cut short
    beside it would be reported as the run (issue 73)."""
    run_dir = Path(run_dir)  # a str too (it once read as "not finished", whatever the files said)
    if not claims_finished(run_dir):
        return "run.json does not say finished"
    try:
        max_steps = int(json.loads((run_dir / "run.json").read_text())["max_steps"])
    except (OSError, ValueError, TypeError, KeyError):
        return "run.json has no max_steps"
    try:
        every = _eval_every(run_dir)
    except OSError:
        return "config.yaml is missing"
    except Exception:  # noqa: BLE001 - a damaged config.yaml is data (yaml's, KeyError, TypeError): said, not raised
        return "config.yaml has no whole eval.every"
    path = run_dir / "metrics.jsonl"
    try:
        if path.stat().st_size > MAX_METRICS_BYTES:
            return f"metrics.jsonl is over {MAX_METRICS_BYTES >> 20} MiB"
        data = path.read_bytes()
    except OSError:
        return "metrics.jsonl is missing"
    problems: list[str] = []
    lines = data.split(b"\n")
    if lines[-1].strip():
        problems.append("its last line is cut short (no line end)")
    seen: dict[int, int] = {}
    evals: set[int] = set()
    bad: list[int] = []
    for n, line in enumerate(lines[:-1], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = row["step"]
            if isinstance(step, bool) or not isinstance(step, int):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            bad.append(n)
            continue
        seen[step] = seen.get(step, 0) + 1
        if any(isinstance(k, str) and k.startswith("eval/") for k in row):
            evals.add(step)
    if bad:
        problems.append(f"line(s) {spans(bad)} do not parse as rows")
    wanted = set(range(1, max_steps + 1)) | ({0} if every > 0 else set())
    if wanted - set(seen):
        problems.append(f"step(s) {spans(sorted(wanted - set(seen)))} of 0-{max_steps} missing")
    twice = [s for s, c in seen.items() if c > 1]
    if twice:
        problems.append(f"step(s) {spans(twice)} logged more than once")
    extra = [s for s in seen if s not in wanted]
    if extra:
        problems.append(f"step(s) {spans(extra)} outside 0-{max_steps}")
    no_eval = sorted(set(eval_steps(max_steps, every)) - evals)
    if no_eval:
        problems.append(f"no evaluation at step(s) {spans(no_eval)}")
    return f"metrics.jsonl: {'; '.join(problems)}" if problems else None


def finished(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a finished run, proven from its rows (:func:`missing`), not from ``run.json``
    alone."""
    return missing(run_dir) is None
