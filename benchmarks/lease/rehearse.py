"""Every plan end to end on the CPU, under the device's conditions (``make lease-rehearsal``, a step of .ci/run).

- A virtualenv holding only what the image holds (benchmarks/lease/image.txt; torch from the local CPU wheel,
  transformers 5.17): no entropy-rft install, no trl, datasets, reasoning-gym or gguf.
- A copy of the working tree as the device tool sends it (tracked and untracked-not-ignored files), with the
  plan's carry packed into it for the rehearsal's Python and installed as on the device
  (``pip install --no-index --no-deps --target``); each call's size checked against ``plans.CARRY_LIMIT``.
- Each call run by its documented command with ``OUT`` set, ``HF_HUB_OFFLINE=1``, no package index, and
  ``ERFT_LEASE_REHEARSAL=1`` (``--device cpu``, tiny sizes); ``$OUT`` checked against the tool's limits (8 files,
  16 MiB each, 64 MiB in all, two folders deep, plain names).
- A call killed half-way (SIGKILL to its process group once a section has ended) still returns that section's
  files, whole.
- What came back is collected into the copy as it would be here (realm waves in order, so realm-2 keeps realm-1's
  runs), and the collected files checked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from carry import image_packages, pack, tree_bytes, tree_files
from collect import collect
from plans import (
    CALL_DEADLINE_S,
    CARRY_DIR,
    OUT_MAX_DEPTH,
    OUT_MAX_FILE,
    OUT_MAX_FILES,
    OUT_MAX_TOTAL,
    PLANS,
    ROOT,
    Plan,
    realm_run_names,
)

NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")


def build_venv(vdir: Path) -> Path:
    """The image-like virtualenv (made once; rebuilt when image.txt or constraints.txt change)."""
    py = vdir / "bin" / "python"
    stamp = vdir / ".image-stamp"
    want = (ROOT / "benchmarks" / "lease" / "image.txt").read_text() + (ROOT / "constraints.txt").read_text()
    if py.exists() and stamp.is_file() and stamp.read_text() == want:
        return py
    shutil.rmtree(vdir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(vdir)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    pinned = {n for n, v in image_packages().items() if v}
    cons = vdir / "constraints.txt"  # constraints.txt for the names the image does not pin
    keep = [ln for ln in (ROOT / "constraints.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#") and re.sub(r"[-_.]+", "-", ln.split("==")[0]).lower()
            not in pinned | {"torch"}]
    cons.write_text("\n".join(keep) + "\n")
    subprocess.run([*pip, "-r", str(ROOT / "benchmarks" / "lease" / "image.txt"), "-c", str(cons)], check=True)
    stamp.write_text(want)
    return py


def device_copy(dest: Path) -> int:
    """Copy the working tree as the device tool sends it into ``dest``; returns its bytes."""
    if dest.exists():
        shutil.rmtree(dest)
    for name in tree_files(ROOT):
        src, dst = ROOT / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    return tree_bytes(ROOT)


def check_out(out: Path) -> list[str]:
    """What in ``out`` would not come back from the device (the tool's limits); empty when all would."""
    problems, files, total = [], [], 0
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if any(not NAME_OK.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters other than letters, digits, '.', '_' and '-'")
        if p.is_symlink() or (not p.is_file() and not p.is_dir()):
            problems.append(f"{rel}: not a plain file")
        elif p.is_file():
            files.append(rel)
            total += p.stat().st_size
            if len(rel.parts) - 1 > OUT_MAX_DEPTH:
                problems.append(f"{rel}: more than {OUT_MAX_DEPTH} folders down")
            if p.stat().st_size > OUT_MAX_FILE:
                problems.append(f"{rel}: {p.stat().st_size} bytes, over 16 MiB")
    if len(files) > OUT_MAX_FILES:
        problems.append(f"{len(files)} files, over {OUT_MAX_FILES}: {', '.join(map(str, files))}")
    if total > OUT_MAX_TOTAL:
        problems.append(f"{total} bytes in all, over 64 MiB")
    return problems


def call_env(venv_py: Path, out: Path, state: Path, deadline_s: float | None = None,
             extra: dict | None = None) -> dict:
    """The device's conditions: the image's python3 first on PATH, no package index, no hub, the tiny sizes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV", "ERFT_"))}
    env.update(PATH=f"{venv_py.parent}{os.pathsep}{env.get('PATH', '')}", OUT=str(out), HF_HUB_OFFLINE="1",
               PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, ERFT_LEASE_REHEARSAL="1", ERFT_LEASE_STATE=str(state))
    if deadline_s is not None:
        env["ERFT_LEASE_DEADLINE_S"] = str(deadline_s)
    return {**env, **(extra or {})}


def run_call(plan: Plan, n: int, copy: Path, venv_py: Path, out: Path, state: Path,
             kill_after_section: str | None = None, extra: dict | None = None) -> tuple[int, float]:
    """Call ``n`` of ``plan`` by its documented command in ``copy``; ``kill_after_section``: SIGKILL the call's
    process group once that section has ended. Returns (exit status, seconds)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = plan.calls[n - 1].command(plan.name, n)
    t = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=copy, env=call_env(venv_py, out, state, extra=extra),
                            start_new_session=True)
    limit = t + CALL_DEADLINE_S + 60
    while proc.poll() is None:
        time.sleep(0.5)
        if kill_after_section and _section_ended(out, kill_after_section):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -9, time.monotonic() - t
        if time.monotonic() > limit:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit(f"rehearsal: {plan.name} call {n} did not end by itself within its deadline")
    return proc.returncode, time.monotonic() - t


def _section_ended(out: Path, name: str) -> bool:
    try:
        rec = json.loads((out / "lease.json").read_text())
    except (OSError, ValueError):
        return False
    return any(s["name"] == name and "status" in s for s in rec["sections"])


def one_call(plan: Plan, n: int, copy: Path, venv_py: Path, out: Path, state: Path,
             extra: dict | None = None) -> list[str]:
    """Call ``n`` of ``plan`` as on the device; its failures (exit status, the tool's limits, files missing)."""
    failures = []
    rc, secs = run_call(plan, n, copy, venv_py, out, state, extra=extra)
    rec = json.loads((out / "lease.json").read_text())
    status = ", ".join(f"{s['name']} {s['status']} ({s.get('wall_s', 0):.0f} s)" for s in rec["sections"])
    print(f"   call {n}{' ' + str(extra) if extra else ''}: exit {rc} in {secs:.0f} s: {status}", flush=True)
    if rc:
        failures.append(f"{plan.name} call {n}: exit {rc} ({status}); see {out / 'log.txt'}")
    failures += [f"{plan.name} call {n}: {p}" for p in check_out(out)]
    for s in plan.calls[n - 1].sections:
        failures += [f"{plan.name} call {n}: {f} missing" for f in s.files if not (out / f).is_file()]
    return failures


REALM_CALLS = 5  # the calls a realm wave may take on the CPU: each must commit at least one of its five runs
PACED_PLAN = "realm-2"  # the plan whose rehearsal also plays a slow device's two leases (no sampler section)


def rehearse_slow_leases(plan: Plan, copy: Path, venv_py: Path, work: Path, state: Path,
                         first: list[Path]) -> list[str]:
    """Issue 49 on the CPU, before the plan's ordinary last call: a lease whose budget holds half a run (nothing
    fits: its record gives the pace, the budget one run needs and the smaller setting; nothing is committed),
    then one whose budget holds three runs run two at a time (the first two are committed, the others are
    left for the next call, which the caller makes)."""
    from status import missing_runs, plan_state

    failures, n = [], len(plan.calls)
    names = realm_run_names(plan.seed)
    for budget, want in (("0.5", 0), ("3", 2)):
        out = work / f"out-{plan.name}-{n}-budget-{budget}"
        failures += one_call(plan, n, copy, venv_py, out, state, extra={"ERFT_LEASE_BUDGET_RUNS": budget})
        wave = json.loads((out / "lease.json").read_text()).get("wave", {})
        collect(plan, [*first, out], root=copy, force=True)
        got = [x for x in names if x not in missing_runs(plan.seed, copy)]
        print(f"   budget of {budget} run(s): {wave.get('verdict')}; committed {got}", flush=True)
        if got != names[:want]:
            failures.append(f"{plan.name}, budget of {budget} run(s): committed {got}, not {names[:want]}")
        if want == 0 and not (wave.get("verdict") == "nothing fits" and wave.get("pace", {}).get("step_s")
                              and wave.get("needed_s", 0) > 0 and "proposal" in wave):
            failures.append(f"{plan.name}, budget of {budget} run(s): the record lacks the verdict, pace or "
                            f"proposal: {json.dumps(wave)[:400]}")
        if want == 2 and wave.get("verdict") != "partial":
            failures.append(f"{plan.name}, budget of {budget} run(s): verdict {wave.get('verdict')}, not partial")
        print("   kit.py next would add: " + " | ".join(plan_state(plan, copy)), flush=True)
    return failures


def rehearse(names: list[str], work: Path) -> list[str]:
    """Rehearse the plans ``names`` in ``work``; returns the failures (empty: every plan passed)."""
    from status import missing_runs

    failures: list[str] = []
    venv_py = build_venv(work / "venv")
    version = subprocess.run([str(venv_py), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    copy = work / "device"
    tree = device_copy(copy)
    print(f"rehearsal: working tree {tree / 2**20:.1f} MiB, Python {version}", flush=True)
    for name in names:
        plan = PLANS[name]
        sizes = pack(plan, root=copy, python_version=version, cache=ROOT / CARRY_DIR / "cache" / f"py{version}",
                     tree=tree)
        print(f"== {name}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()), flush=True)
        state = work / f"state-{name}"  # a fresh machine per lease, kept between its calls
        shutil.rmtree(state, ignore_errors=True)
        folders = []
        if name == "kernels":  # killed half-way: the finished section's files come back whole
            out = work / "out-killed"
            rc, secs = run_call(plan, 1, copy, venv_py, out, state, kill_after_section="env")
            rec = json.loads((out / "lease.json").read_text())
            env = json.loads((out / "env.json").read_text())
            if rec["sections"][0]["status"] != "ok" or not env.get("imports"):
                failures.append(f"{name} killed after env: env.json or lease.json incomplete")
            failures += [f"{name} killed: {p}" for p in check_out(out)]
            print(f"   killed after env ({secs:.0f} s): returned {sorted(p.name for p in out.iterdir())}", flush=True)
            shutil.rmtree(state, ignore_errors=True)
        for n in range(1, len(plan.calls) + 1):
            if name == PACED_PLAN and n == len(plan.calls):  # the slow device's leases first (issue 49)
                failures += rehearse_slow_leases(plan, copy, venv_py, work, state, folders[:1])
            out = work / f"out-{name}-{n}"
            left = missing_runs(plan.seed, copy) if plan.realm else []
            failures += one_call(plan, n, copy, venv_py, out, state)
            folders.append(out)
        written = collect(plan, folders, root=copy, force=True)
        if plan.realm and missing_runs(plan.seed, copy) == left:
            failures.append(f"{name}: call {len(plan.calls)} committed no run while {len(left)} were left (issue 49)")
        for again in range(2, REALM_CALLS + 1) if plan.realm else ():  # a wave the CPU could not finish at once
            before = missing_runs(plan.seed, copy)
            if not before:
                break
            print(f"   {len(before)} run(s) left: call {len(plan.calls)} again ({again} of {REALM_CALLS})", flush=True)
            out = work / f"out-{name}-{len(plan.calls)}-again-{again}"
            failures += one_call(plan, len(plan.calls), copy, venv_py, out, state)
            written += collect(plan, [folders[0], out], root=copy, force=True)
            if missing_runs(plan.seed, copy) == before:
                failures.append(f"{name}: a call committed no run while {len(before)} were left (issue 49)")
                break
        if plan.realm and missing_runs(plan.seed, copy):
            failures.append(f"{name}: {', '.join(missing_runs(plan.seed, copy))} not committed after "
                            f"{REALM_CALLS} calls")
        print("   collected: " + ", ".join(str(p.relative_to(copy)) for p in written), flush=True)
        if plan.realm and not any(p.parent.name == "smollm2-gpu" and p.is_dir() for p in written):
            failures.append(f"{name}: no finished run was collected")
        if not plan.realm and not any(p.suffix == ".md" for p in written):
            failures.append(f"{name}: no kernels table was collected")
    return failures
