"""What a lease returned, put where it is committed: the kernels' figures in benchmarks/results/, the runs of a
realm wave in results/smollm2-gpu/, and a record of every lease (``benchmarks/results/lease-<plan>-<time>.json``:
each call's lease.json, env.json and the end of its log) so that the next session sees what ran and how long.

What came back is data (issue 65): every file is checked first (``checks.py``), and only then is anything
written: the record, then each finished run's shipped files and nothing else. A malformed file, a tar member no
run ships, a run trained with other settings than the committed ones: one line, and nothing written.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.lease.checks import (
    LeaseDataError,
    check_call_record,
    check_kernels_part,
    check_metrics,
    check_run_json,
    extract,
    read_json,
    tar_members,
    visible,
)
from benchmarks.lease.plans import KERNEL_PARTS, KERNEL_RESULTS, REALM_RESULTS, ROOT, Plan, realm_run_names
from entropy_rft.rundir.finished import SHIPPED, claims_finished, missing  # what a run ships; finished

# The task check of the first lease that trains (issue 34): the base model's figures at the step-0 evaluation
TASK_PASS1 = (0.05, 0.3)
TASK_PASS8_OVER_PASS1 = 2.0
TASK_MIN_TOKENS = 48
LOG_TAIL_BYTES = 1 << 20  # the end of a call's log.txt kept in the record (at most 300 lines of it)
SAME_BUT = ("method.name", "train.seed")  # what may differ between the runs of the comparison


def read_calls(plan: Plan, folders: list[Path]) -> list[dict]:
    """Each folder's ``lease.json`` (checked), its ``env.json`` and the end of its ``log.txt``, by call number."""
    calls = []
    for f in folders:
        if not (f / "lease.json").is_file():
            raise LeaseDataError(f, f"has no lease.json: is it what a call of {plan.name} returned?")
        rec = check_call_record(read_json(f / "lease.json"), f / "lease.json", len(plan.calls))
        log = f / "log.txt"
        if log.is_file():
            with log.open("rb") as fh:
                fh.seek(max(0, log.stat().st_size - LOG_TAIL_BYTES))
                rec["log_tail"] = fh.read().decode("utf-8", errors="replace").splitlines()[-300:]
        env = read_json(f / "env.json") if (f / "env.json").is_file() else None
        if env is not None and not isinstance(env, dict):
            raise LeaseDataError(f / "env.json", "is not an object")
        calls.append((rec, env))
    calls.sort(key=lambda c: c[0]["call"])
    return calls


def lease_record(plan: Plan, calls: list, root: Path) -> Path:
    """``benchmarks/results/lease-<plan>-<time>.json``, a new file: two collects in one second never overwrite
    each other (the second gets ``-2``)."""
    stamp = time.strftime("%Y-%m-%d-%H%M%S", time.gmtime())
    env = next((e for _, e in reversed(calls) if e is not None), None)
    text = json.dumps({"plan": plan.name, "collected": stamp, "env": env, "calls": [c for c, _ in calls]},
                      indent=1) + "\n"
    (root / KERNEL_RESULTS).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        out = root / KERNEL_RESULTS / f"lease-{plan.name}-{stamp}{'' if n == 1 else f'-{n}'}.json"
        try:
            with out.open("x") as f:
                f.write(text)
            return out
        except FileExistsError:
            continue
    raise LeaseDataError(root / KERNEL_RESULTS, f"999 lease records of {plan.name} stamped {stamp}")


def read_kernels(folders: list[Path]) -> list[tuple[str, dict]]:
    """Each kernels part that came back (checked), with its name."""
    parts = []
    for f in folders:
        for part, _ in KERNEL_PARTS:
            path = f / f"kernels-{part}.json"
            if path.is_file():
                parts.append((part, check_kernels_part(read_json(path), path)))
    return parts


def kernels_files(parts: list[tuple[str, dict]], root: Path) -> list[tuple[Path, str]]:
    """The parts' JSON merged into ``<device>-<date>.json`` and its ``.md`` (benchmarks/gpu/kernels.py), as
    (path, text), rendered before anything is written: the parts are checked (``checks.check_kernels_part``)."""
    from benchmarks.gpu.kernels_report import render_markdown, result_stem

    merged: dict = {}
    for part, res in parts:
        base = {k: v for k, v in res.items() if k not in ("stats", "head", "verl", "trl")}
        merged = {**base, **merged}
        if part in res:
            merged[part] = res[part]
    if not merged:
        return []
    merged["wall_s"] = sum(r.get("wall_s", 0) for _, r in parts)
    stem = result_stem(merged)
    return [(root / KERNEL_RESULTS / f"{stem}.json", json.dumps(merged, indent=1, default=str) + "\n"),
            (root / KERNEL_RESULTS / f"{stem}.md", render_markdown(merged))]


def base_figures(run_dirs: list[Path]) -> dict:
    """The base model's step-0 evaluation, averaged over the runs (each evaluates the same weights); the runs'
    metrics.jsonl are checked (``checks.check_metrics``) before this reads them."""
    rows = []
    for d in run_dirs:
        for line in (d / "metrics.jsonl").read_text().splitlines() if (d / "metrics.jsonl").is_file() else []:
            r = json.loads(line)
            if r.get("step") == 0 and isinstance(r.get("eval/pass@1"), (int, float)):
                rows.append(r)
                break
    if not rows:
        return {}
    k8 = next((k for k in rows[0] if k.startswith("eval/pass@") and k != "eval/pass@1"), None)

    def mean(k: str) -> float:  # a run without the figure (null, or not logged) makes it unknown
        vals = [r.get(k) for r in rows]
        return sum(vals) / len(rows) if all(isinstance(v, (int, float)) for v in vals) else float("nan")
    return {"runs": len(rows), "pass@1": mean("eval/pass@1"), "pass@k": mean(k8) if k8 else None, "k": k8,
            "response_tokens": mean("eval/response_tokens")}


def task_verdict(base: dict) -> list[str]:
    """What the task misses of issue 34's wants (empty: it fits)."""
    if not base:
        return ["no step-0 evaluation came back"]
    miss = []
    lo, hi = TASK_PASS1
    if not lo <= base["pass@1"] <= hi:
        miss.append(f"base pass@1 {base['pass@1']:.3f} is outside {lo}-{hi}")
    if base["pass@k"] is None or not base["pass@k"] >= TASK_PASS8_OVER_PASS1 * base["pass@1"]:
        miss.append(f"base {base['k']} {base['pass@k']} is under {TASK_PASS8_OVER_PASS1}x pass@1")
    if not base["response_tokens"] >= TASK_MIN_TOKENS:
        miss.append(f"responses average {base['response_tokens']:.1f} tokens, under {TASK_MIN_TOKENS}")
    return miss


@dataclass
class Staged:
    """A realm lease's runs, checked and unpacked in a scratch folder, before anything is written."""

    folder: Path
    finished: list[str]
    rows: dict[str, int] = field(default_factory=dict)
    environment: bool = False


def settings_differ(run: Path, ref: Path) -> str | None:
    """How ``run``'s recorded settings differ from ``ref``'s (all but the method and seed), in words; None when
    they agree. A config.yaml the schema refuses is a malformed file."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.config.schema import changed_fields
    from entropy_rft.rundir.checkpoints import load_run_config

    try:
        a, b = load_run_config(ref, check_method=False), load_run_config(run, check_method=False)
    except UserError as e:
        raise LeaseDataError(run / "config.yaml", str(e)) from None
    changed = changed_fields(a, b, ignore=SAME_BUT)
    if not changed:
        return None
    return "; ".join(f"{k}: {x!r} in {ref.name}, {y!r} here" for k, x, y in changed[:3]) + \
        (f" and {len(changed) - 3} more" if len(changed) > 3 else "")


def stage_realm(folders: list[Path], tmp: Path, root: Path) -> Staged | None:
    """Check the last call's ``runs.tar.gz`` member by member, unpack only the shipped files into ``tmp``, check each
    run's files, and check that every finished run has the committed runs' settings (or, with none committed, the
    first finished run's). None when no tar came back."""
    tars = [f / "runs.tar.gz" for f in folders if (f / "runs.tar.gz").is_file()]
    if not tars:
        return None
    allowed = {f"{n}/{f}" for n in realm_run_names() for f in SHIPPED} | {"environment.json"}
    names = tar_members(tars[-1], allowed)
    extract(tars[-1], names, tmp)
    staged = Staged(tmp, [], environment="environment.json" in names)
    if staged.environment:
        read_json(tmp / "environment.json")
    for n in realm_run_names():
        if (tmp / n / "metrics.jsonl").is_file():
            staged.rows[n] = check_metrics(tmp / n / "metrics.jsonl")
        if (tmp / n / "run.json").is_file():
            check_run_json(tmp / n / "run.json")
            if claims_finished(tmp / n):
                if not (tmp / n / "config.yaml").is_file():
                    raise LeaseDataError(tars[-1], f"{n} is finished but ships no config.yaml")
                why = missing(tmp / n)  # finished is proven from the rows, never taken from run.json alone
                if why is not None:
                    raise LeaseDataError(tars[-1], f"{n}'s run.json says finished, but {why}")
                staged.finished.append(n)
    committed = sorted(p for p in (root / REALM_RESULTS).glob("*/config.yaml")) if (root / REALM_RESULTS).is_dir() \
        else []
    ref = committed[0].parent if committed else (tmp / staged.finished[0] if staged.finished else None)
    for n in staged.finished:
        diff = settings_differ(tmp / n, ref) if ref is not None else None
        if diff:
            raise LeaseDataError(tars[-1], f"{n} was trained with other settings than the committed runs ({diff}): "
                                 "one table would mix two settings; find out why before committing any of them")
    return staged


def commit_realm(staged: Staged, folders: list[Path], root: Path) -> list[Path]:
    """Each finished run's shipped files (and nothing else) into results/smollm2-gpu/, with environment.json and
    the sampler check."""
    results = root / REALM_RESULTS
    written: list[Path] = []
    for n in staged.finished:
        dst = results / n
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for f in SHIPPED:
            if (staged.folder / n / f).is_file():
                shutil.copyfile(staged.folder / n / f, dst / f)
        written.append(dst)
    if staged.environment:
        shutil.copyfile(staged.folder / "environment.json", results / "environment.json")
        written.append(results / "environment.json")
    for f in folders:
        if (f / "sampler.json").is_file():
            results.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f / "sampler.json", results / "sampler.json")
            written.append(results / "sampler.json")
    return written


def report_wave(plan: Plan, calls: list, root: Path) -> None:
    """What the wave decided (each call's lease.json, ``wave``): the runs a partial wave left for the next lease
    of the plan, or the pace and the smaller setting when nothing fitted (status.wave_advice)."""
    from benchmarks.lease.status import committed_runs, missing_runs, wave_advice

    for rec, _ in calls:
        wave = rec.get("wave")
        if isinstance(wave, dict):
            print(f"  the wave: {visible(wave['verdict'])}")
            for line in wave_advice(plan, wave, None, committed_runs(root)):
                print(f"  {line}")
    left = missing_runs(root)
    if left:
        print(f"collect: {plan.name} still needs {len(left)} run(s) ({', '.join(left)}): `kit.py next` offers it "
              "again")


def collect(plan: Plan, folders: list[Path], root: Path = ROOT, force: bool = False) -> list[Path]:
    """Put what ``folders`` (each the files one call returned) hold where it is committed; returns the paths.
    Everything is checked before the first file is written (``checks.LeaseDataError``: one line)."""
    from benchmarks.lease.status import committed_runs

    calls = read_calls(plan, folders)
    if not plan.realm:
        files = kernels_files(read_kernels(folders), root)
        written = [lease_record(plan, calls, root)]
        for path, text in files:
            path.write_text(text)
            written.append(path)
        return written
    for f in folders:
        if (f / "sampler.json").is_file() and not isinstance(read_json(f / "sampler.json"), dict):
            raise LeaseDataError(f / "sampler.json", "is not an object")
    first = not committed_runs(root)  # the first lease that trains: the task is checked before anything is kept
    with tempfile.TemporaryDirectory() as tmp:
        staged = stage_realm(folders, Path(tmp), root)
        written = [lease_record(plan, calls, root)]
        if staged is None:
            print(f"collect: no runs.tar.gz came back from {plan.name}'s call {len(plan.calls)}; nothing to commit but "
                  "the record")
        else:
            for n, rows in staged.rows.items():
                print(f"  {n}: {'finished' if n in staged.finished else 'NOT finished'} ({rows} metric rows)")
            base = base_figures([staged.folder / n for n in realm_run_names() if n.endswith("-s0")]) if first else {}
            miss = task_verdict(base) if first else []
            if first:
                print(f"  the task's base figures (step 0): {base}")
            if miss and not force:
                print("collect: the task misses issue 34's wants (" + "; ".join(miss) + "). Nothing committed: "
                      "change task: in configs/smollm2-gpu.yaml once (and say so in docs/results-smollm2-gpu.md), "
                      "then run the realm plan again; --force commits these runs anyway")
            else:
                written += commit_realm(staged, folders, root)
    report_wave(plan, calls, root)
    return written
