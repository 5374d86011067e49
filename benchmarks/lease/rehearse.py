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
- What came back is collected into the copy as it would be here (so each realm lease keeps the runs the earlier
  ones committed), and the collected files checked.
- The realm plan under a slow device and a small one (:func:`rehearse_realm_leases`, issues 49 and 64).
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

from benchmarks.lease.carry import image_packages, pack, tree_bytes, tree_files
from benchmarks.lease.collect import collect
from benchmarks.lease.plans import (
    CALL_DEADLINE_S,
    CARRY_DIR,
    OUT_MAX_DEPTH,
    OUT_MAX_FILE,
    OUT_MAX_FILES,
    OUT_MAX_TOTAL,
    PLANS,
    REALM_RESULTS,
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
    skipped = {s["name"] for s in rec["sections"] if s.get("skipped")}
    for s in plan.calls[n - 1].sections:
        failures += [f"{plan.name} call {n}: {f} missing" for f in s.files
                     if s.name not in skipped and not (out / f).is_file()]
    return failures


REALM_CALLS = 5  # the ordinary calls a realm plan may take on the CPU: each must commit at least one run
SLOW, SMALL = 7.5, 3  # the slow device's budget (runs: seven fit, not eight); the small device's memory (runs)


def rehearse_realm_leases(plan: Plan, copy: Path, venv_py: Path, work: Path, state: Path,
                          first: list[Path]) -> list[str]:
    """Issues 49 and 64 on the CPU, each a lease's last call with the folders of the calls before it, ``first``: a
    budget of 7.5 runs (the first lease that trains: its first run starts alone until its peak memory is read;
    seeds first, exactly seed 0's five and seed 1's ``none`` and ``clip_b`` are committed); a budget of half a run
    (nothing fits: the record gives the pace, the budget one run needs and the smaller setting; nothing more is
    committed); then a device whose memory holds three runs, with five allowed at once (the runs start together at
    the peak the earlier leases measured, never more than three run at once, and this one call commits the
    remaining eight)."""
    from benchmarks.lease.status import missing_runs, plan_state

    failures, n = [], len(plan.calls)
    names = realm_run_names()
    for label, extra, want in ((f"budget of {SLOW} runs", {"ERFT_LEASE_BUDGET_RUNS": str(SLOW)}, int(SLOW)),
                               ("budget of 0.5 run", {"ERFT_LEASE_BUDGET_RUNS": "0.5"}, int(SLOW)),
                               (f"memory for {SMALL} runs, 5 at once",
                                {"ERFT_LEASE_MEMORY_RUNS": str(SMALL), "ERFT_LEASE_AT_ONCE": "5"}, len(names))):
        out = work / f"out-{plan.name}-{n}-{label.split()[0]}-{want}"
        failures += one_call(plan, n, copy, venv_py, out, state, extra=extra)
        wave = json.loads((out / "lease.json").read_text()).get("wave", {})
        collect(plan, [*first, out], root=copy, force=True)
        got = [x for x in names if x not in missing_runs(copy)]
        print(f"   {label}: {wave.get('verdict')}; at most {wave.get('most_at_once')} at once; memory "
              f"{wave.get('memory')}; committed {len(got)}: {got}", flush=True)
        if got != names[:want]:
            failures.append(f"{plan.name}, {label}: committed {got}, not {names[:want]}")
        if "0.5" in label and not (wave.get("verdict") == "nothing fits" and wave.get("pace", {}).get("step_s")
                              and wave.get("needed_s", 0) > 0 and "proposal" in wave):
            failures.append(f"{plan.name}, {label}: the record lacks the verdict, pace or proposal: "
                            f"{json.dumps(wave)[:400]}")
        if str(SLOW) in label and wave.get("verdict") != "partial":
            failures.append(f"{plan.name}, {label}: verdict {wave.get('verdict')}, not partial")
        if "ERFT_LEASE_MEMORY_RUNS" in extra and (wave.get("most_at_once") != SMALL
                                                  or (wave.get("memory") or {}).get("runs_it_holds") != SMALL):
            failures.append(f"{plan.name}, {label}: {wave.get('most_at_once')} ran at once, the record says the "
                            f"memory holds {(wave.get('memory') or {}).get('runs_it_holds')}: not {SMALL}")
        print("   kit.py next would add: " + " | ".join(plan_state(plan, copy)), flush=True)
    return failures


def rehearse(names: list[str], work: Path) -> list[str]:
    """Rehearse the plans ``names`` in ``work``; returns the failures (empty: every plan passed)."""
    from benchmarks.lease.status import missing_runs

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
        if plan.realm:  # the calls that stage the GGUF, then the slow and small devices' leases, then ordinary
            # last calls while runs are left
            for k in range(1, len(plan.calls)):
                out = work / f"out-{name}-{k}"
                failures += one_call(plan, k, copy, venv_py, out, state)
                folders.append(out)
            failures += rehearse_realm_leases(plan, copy, venv_py, work, state, folders)
            written = [copy / REALM_RESULTS / n for n in realm_run_names() if (copy / REALM_RESULTS / n).is_dir()]
            for again in range(1, REALM_CALLS + 1):
                before = missing_runs(copy)
                if not before:
                    break
                print(f"   {len(before)} run(s) left: call {len(plan.calls)} again ({again} of {REALM_CALLS})",
                      flush=True)
                out = work / f"out-{name}-{len(plan.calls)}-again-{again}"
                failures += one_call(plan, len(plan.calls), copy, venv_py, out, state)
                written += collect(plan, [*folders, out], root=copy, force=True)
                if missing_runs(copy) == before:
                    failures.append(f"{name}: a call committed no run while {len(before)} were left (issue 49)")
                    break
            if missing_runs(copy):
                failures.append(f"{name}: {', '.join(missing_runs(copy))} not committed after {REALM_CALLS} "
                                "more calls")
        else:
            for n in range(1, len(plan.calls) + 1):
                out = work / f"out-{name}-{n}"
                failures += one_call(plan, n, copy, venv_py, out, state)
                folders.append(out)
            written = collect(plan, folders, root=copy, force=True)
        print("   collected: " + ", ".join(str(p.relative_to(copy)) for p in written), flush=True)
        if plan.realm and not any(p.parent.name == "smollm2-gpu" and p.is_dir() for p in written):
            failures.append(f"{name}: no finished run was collected")
        if not plan.realm and not any(p.suffix == ".md" for p in written):
            failures.append(f"{name}: no kernels table was collected")
    return failures
