"""What a lease returned, put where it is committed: the kernels' figures in benchmarks/results/, the runs of a
realm wave in results/smollm2-gpu/, and a record of every lease (``benchmarks/results/lease-<plan>-<time>.json``:
each call's lease.json, env.json and the end of its log) so that the next session sees what ran and how long."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from plans import KERNEL_PARTS, KERNEL_RESULTS, REALM_RESULTS, ROOT, Plan, realm_run_names

# The task check of the first lease that trains (issue 34): the base model's figures at the step-0 evaluation
TASK_PASS1 = (0.05, 0.3)
TASK_PASS8_OVER_PASS1 = 2.0
TASK_MIN_TOKENS = 48


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def lease_record(plan: Plan, folders: list[Path], root: Path) -> Path:
    calls, env = [], None
    for f in folders:
        rec = _read_json(f / "lease.json")
        if rec is None:
            raise SystemExit(f"collect: {f} has no lease.json: is it what a call of {plan.name} returned?")
        log = (f / "log.txt").read_text(errors="replace").splitlines() if (f / "log.txt").is_file() else []
        rec["log_tail"] = log[-300:]
        calls.append(rec)
        env = _read_json(f / "env.json") or env
    calls.sort(key=lambda r: r["call"])
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    out = root / KERNEL_RESULTS / f"lease-{plan.name}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plan": plan.name, "collected": stamp, "env": env, "calls": calls}, indent=1) + "\n")
    return out


def collect_kernels(folders: list[Path], root: Path) -> list[Path]:
    """Merge the parts' JSON into ``<device>-<date>.json`` and render its ``.md`` (benchmarks/gpu/kernels.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from kernels import render_markdown

    merged: dict = {}
    parts_read: list[dict] = []
    for f in folders:
        for part, _ in KERNEL_PARTS:
            res = _read_json(f / f"kernels-{part}.json")
            if res is None:
                continue
            parts_read.append(res)
            base = {k: v for k, v in res.items() if k not in ("stats", "head", "verl", "trl")}
            merged = {**base, **merged}
            if part in res:
                merged[part] = res[part]
    if not merged:
        return []
    merged["wall_s"] = sum(r.get("wall_s", 0) for r in parts_read)
    stem = f"{_slug(merged.get('device', 'device'))}-{merged.get('date', time.strftime('%Y-%m-%d'))}"
    if merged.get("quick"):
        stem += "-quick"
    js, md = root / KERNEL_RESULTS / f"{stem}.json", root / KERNEL_RESULTS / f"{stem}.md"
    js.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    md.write_text(render_markdown(merged))
    return [js, md]


def base_figures(run_dirs: list[Path]) -> dict:
    """The base model's step-0 evaluation, averaged over the wave's runs (each evaluates the same weights)."""
    rows = []
    for d in run_dirs:
        for line in (d / "metrics.jsonl").read_text().splitlines() if (d / "metrics.jsonl").is_file() else []:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("step") == 0 and "eval/pass@1" in r:
                rows.append(r)
                break
    if not rows:
        return {}
    k8 = next((k for k in rows[0] if k.startswith("eval/pass@") and k != "eval/pass@1"), None)
    mean = lambda k: sum(r.get(k, float("nan")) for r in rows) / len(rows)  # noqa: E731
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
    if base["pass@k"] is None or base["pass@k"] < TASK_PASS8_OVER_PASS1 * base["pass@1"]:
        miss.append(f"base {base['k']} {base['pass@k']} is under {TASK_PASS8_OVER_PASS1}x pass@1")
    if base["response_tokens"] < TASK_MIN_TOKENS:
        miss.append(f"responses average {base['response_tokens']:.1f} tokens, under {TASK_MIN_TOKENS}")
    return miss


def collect_realm(plan: Plan, folders: list[Path], root: Path, force: bool) -> list[Path]:
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from realm import _finished
    from status import committed_runs

    first = not committed_runs(root)  # the first lease that trains: the task is checked before anything is kept
    tars = [f / "runs.tar.gz" for f in folders if (f / "runs.tar.gz").is_file()]
    if not tars:
        print(f"collect: no runs.tar.gz came back from {plan.name}'s call 2; nothing to commit but the record")
        return []
    results = root / REALM_RESULTS
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tars[-1]) as tar:
            tar.extractall(tmp, filter="data")
        got = Path(tmp)
        names = realm_run_names()
        finished = [n for n in names if _finished(got / n)]
        for n in names:
            steps = 0
            if (got / n / "metrics.jsonl").is_file():
                steps = sum(1 for line in (got / n / "metrics.jsonl").read_text().splitlines() if '"step"' in line)
            if steps or n in finished:
                print(f"  {n}: {'finished' if n in finished else 'NOT finished'} ({steps} metric rows)")
        if first:
            base = base_figures([got / n for n in names if n.endswith("-s0")])
            miss = task_verdict(base)
            print(f"  the task's base figures (step 0): {base}")
            if miss and not force:
                print("collect: the task misses issue 34's wants (" + "; ".join(miss) + "). Nothing committed: "
                      "change task: in configs/smollm2-gpu.yaml once (and say so in docs/results-smollm2-gpu.md), "
                      "then run the realm plan again; --force commits these runs anyway")
                return []
        for n in finished:
            dst = results / n
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(got / n, dst)
            written.append(dst)
        if (got / "environment.json").is_file():
            results.mkdir(parents=True, exist_ok=True)
            shutil.copy2(got / "environment.json", results / "environment.json")
            written.append(results / "environment.json")
    for f in folders:
        if (f / "sampler.json").is_file():
            results.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f / "sampler.json", results / "sampler.json")
            written.append(results / "sampler.json")
    return written


def report_wave(plan: Plan, folders: list[Path], root: Path) -> None:
    """What the wave decided (each call's lease.json, ``wave``): the runs a partial wave left for the next lease
    of the plan, or the pace and the smaller setting when nothing fitted (status.wave_advice)."""
    from status import committed_runs, missing_runs, wave_advice

    for f in folders:
        wave = (_read_json(f / "lease.json") or {}).get("wave")
        if isinstance(wave, dict) and wave.get("verdict"):
            print(f"  the wave: {wave['verdict']}")
            for line in wave_advice(plan, wave, None, committed_runs(root)):
                print(f"  {line}")
    left = missing_runs(root)
    if left:
        print(f"collect: {plan.name} still needs {len(left)} run(s) ({', '.join(left)}): `kit.py next` offers it "
              "again")


def collect(plan: Plan, folders: list[Path], root: Path = ROOT, force: bool = False) -> list[Path]:
    """Put what ``folders`` (each the files one call returned) hold where it is committed; returns the paths."""
    written = [lease_record(plan, folders, root)]
    written += collect_realm(plan, folders, root, force) if plan.realm else collect_kernels(folders, root)
    if plan.realm:
        report_wave(plan, folders, root)
    return written
