"""What the CPU pin costs: step time of ``erft train`` pinned (the default: ATen's AVX2 paths, and MKL's COMPATIBLE
branch for the built-in policies, its fast AVX2 one for a pretrained model) against the machine's own instruction set
(``ERFT_CPU_PIN=0``), on the built-in default policy and on SmolLM2-135M, ratios in one run; ``--exact`` adds a
third setting, the pin with ``model.cpu_gemm=exact`` (MKL's COMPATIBLE branch for SmolLM2 too).

The pin (``entropy_rft.common.numerics``) is read when torch loads, so every measurement is a fresh ``erft train``
process; the two settings run in turn (pinned, native, native, pinned, ...) ``--rounds`` times, on the same
policy weights (the pinned default policy's folder, SmolLM2's converted folder), the same seed and settings,
evaluation, probes and checkpoints off. A step is ``time/step`` of metrics.jsonl; the first ``--warmup`` steps of
each run are not counted. Printed: the median step time of each setting and the ratio pinned / native per model
(above 1: the pin is slower). Both settings train the same work only as long as their rollouts agree, and they
drift apart after a few steps (the bytes differ: that is the point of the pin), so keep ``--steps`` short.
On a machine without AVX-512 both settings are the same and the ratio is 1 up to noise.

Usage: ``.venv/bin/python -m benchmarks.cpu.pin_cost [--models default,smollm2] [--steps 8] [--rounds 2] [--exact]``
(on a quiet machine: other processes on the cores move step times more than the pin does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from entropy_rft.common.numerics import PIN_ENV, PIN_SET_ENV, PIN_VARIABLES

WORKLOADS: dict[str, dict[str, object]] = {
    "default": {"task.name": "countdown"},
    "smollm2": {"model.name": "smollm2-135m", "task.name": "rg:products",
                "task.params": "{params: {max_digits: 1}, answer_format: number}", "rollout.prompts_per_step": 8,
                "rollout.group_size": 8, "rollout.max_new_tokens": 64, "optim.lr": 1e-6, "tuned_for": ""},
}
COMMON = {"eval.every": 0, "train.progress": False, "train.checkpoints": False, "probe.records_every": 0,
          "probe.jvp_every": 0, "probe.counterfactual_every": 0, "train.samples_every": 0, "train.report_to": "[]"}


def settings_env(pinned: bool) -> dict[str, str]:
    """This process's environment without the pin's variables, and with ``ERFT_CPU_PIN=0`` for the native run."""
    env = {k: v for k, v in os.environ.items() if k not in PIN_VARIABLES and k not in (PIN_ENV, PIN_SET_ENV)}
    if not pinned:
        env[PIN_ENV] = "0"
    return env


def default_policy_folder() -> str:
    """The pinned default policy's folder, built first (in a pinned process) when the cache lacks it."""
    code = ("from entropy_rft.common.numerics import pin_cpu_numerics; pin_cpu_numerics(); "
            "from entropy_rft.training.sft import build_default_policy; print(build_default_policy())")
    done = subprocess.run([sys.executable, "-c", code], env=settings_env(True), capture_output=True, text=True,
                          check=True)
    return done.stdout.strip().splitlines()[-1]


def step_times(sets: dict[str, object], steps: int, warmup: int, pinned: bool, out: Path) -> tuple[list[float], dict]:
    """One fresh ``erft train`` run; its step times after the warm-up and run.json's numerics record."""
    args = [sys.executable, "-m", "entropy_rft.cli", "train", "--out", str(out)]
    for k, v in {**COMMON, **sets, "train.max_steps": steps}.items():
        args += ["--set", f"{k}={v}"]
    done = subprocess.run(args, env=settings_env(pinned), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"pin_cost: erft train failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    record = json.loads((out / "run.json").read_text()).get("cpu_numerics", {})
    return [float(r["time/step"]) for r in rows[warmup:] if "time/step" in r], record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,smollm2", help="comma list of: " + ", ".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=8, help="steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run not counted")
    ap.add_argument("--rounds", type=int, default=2, help="pairs (or triples) per model, in alternating order")
    ap.add_argument("--exact", action="store_true", help="also time the pin with model.cpu_gemm=exact")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in WORKLOADS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {sorted(WORKLOADS)}")
    settings = ["pinned", "native", *(["exact"] if args.exact else [])]
    lines = []
    with tempfile.TemporaryDirectory(prefix="erft-pin-") as tmp:
        for name in names:
            sets = dict(WORKLOADS[name])
            if name == "default":
                sets["model.name"] = default_policy_folder()
            times: dict[str, list[float]] = {s: [] for s in settings}
            said: dict[str, str] = {}
            for r in range(args.rounds):
                for setting in (settings if r % 2 == 0 else settings[::-1]):
                    out = Path(tmp) / f"{name}-{r}-{setting}"
                    extra = {"model.cpu_gemm": "exact"} if setting == "exact" else {}
                    got, record = step_times({**sets, **extra}, args.steps, args.warmup, setting != "native", out)
                    times[setting] += got
                    said[setting] = f"{record.get('cpu_capability')}, MKL {record.get('mkl_branch')}"
                    print(f"{name} round {r + 1} {setting} ({said[setting]}): "
                          f"median {statistics.median(got):.3f} s/step", flush=True)
            med = {k: statistics.median(v) for k, v in times.items()}
            lines.append(f"{name}: " + ", ".join(f"{k} ({said[k]}) {med[k]:.3f} s/step" for k in settings)
                         + f"; ratio pinned/native {med['pinned'] / med['native']:.3f}"
                         + (f", exact/pinned {med['exact'] / med['pinned']:.3f}" if args.exact else "")
                         + f" ({', '.join(str(len(times[k])) for k in settings)} steps)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
