"""SmolLM2-135M on CPU: the native engine's step rate and peak memory against stock TRL ``GRPOTrainer``.

The workload of issue 15's real demonstration: ``rg:products`` (one-digit products, short chat prompts of
~40 tokens), 8 prompts x 8 samples, responses up to 64 new tokens, one optimizer update per rollout batch for
both engines (``algo.minibatches=1``; TRL: ``steps_per_generation=1``), no reference model, lr 1e-6. TRL's
arguments come from the same erft config through ``integrations.trl.grpo_config`` (what ``--engine trl``
runs), but with TRL's own ``GRPOTrainer``. The native trainer runs with its per-step probe (the tabular
entropy prediction, one extra no-grad forward), JVP and counterfactual probes off, no evaluation.

Each engine runs in a fresh subprocess, the engines in turn, ``--rounds`` times. A step is timed from its
start to its end (rollout, scoring, forward, backward, optimizer; no checkpoint saving); the first step of each
run is a warm-up and is not timed. Peak memory is the process's peak RSS (``VmHWM``: model, optimizer state,
activations) read at the end of the last step, before anything is saved. Targets (issue 15, item 5): native
>= 1.5x TRL's steps/s, native peak RSS <= TRL's.

Usage: ``.venv/bin/python -m benchmarks.cpu.smollm2_speed [--steps 2] [--rounds 1] [--threads 1]``
(about 10-15 min at the defaults on a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, GROUP, NEW_TOKENS, LR = 8, 8, 64, 1e-6


def erft_config(steps: int, threads: int):
    from entropy_rft.config.loading import load_config

    sets = {"model.name": "smollm2-135m", "task.name": "rg:products",
            "task.params": "{params: {max_digits: 1}, answer_format: number}", "method.name": "none",
            "rollout.prompts_per_step": PROMPTS, "rollout.group_size": GROUP, "rollout.max_new_tokens": NEW_TOKENS,
            "algo.minibatches": 1, "eval.every": 0, "train.max_steps": steps, "train.checkpoint_every": 10**6,
            "train.tensorboard": "false", "train.progress": "false", "train.threads": threads, "optim.lr": LR,
            "probe.jvp_every": 0, "probe.counterfactual_every": 0, "probe.records_every": 0,
            "train.samples_every": 10**6}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux ``VmHWM``), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def native_times(cfg, out: Path) -> tuple[list[float], float]:
    from entropy_rft.launch.run import train_native

    stamps, peak = [time.perf_counter()], [0.0]

    def on_step(run, row):
        stamps.append(time.perf_counter())
        peak[0] = peak_rss_mib()

    train_native(cfg, out, on_step=on_step)
    return [b - a for a, b in zip(stamps[1:-1], stamps[2:])], peak[0]


def trl_times(cfg, out: Path) -> tuple[list[float], float]:
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from entropy_rft.integrations.trl import grpo_config
    from entropy_rft.integrations.trl_task import prompt_dataset
    from entropy_rft.tasks import build_task
    from entropy_rft.training.policies import load_policy

    task = build_task(cfg.task.name, **cfg.task.params)
    train_set, _ = task.split(cfg.train.seed)
    model, tok = load_policy(cfg.model.name, device="cpu")

    def reward(prompts, completions, erft_index, **_kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(task.reward(c, train_set[i])) for c, i in zip(texts, erft_index)]

    begin, times, peak = [0.0], [], [0.0]

    class Stamp(TrainerCallback):  # generation runs inside the step (training_step -> _prepare_inputs)
        def on_step_begin(self, *a, **k):
            begin[0] = time.perf_counter()

        def on_step_end(self, *a, **k):  # before the Trainer logs or saves
            times.append(time.perf_counter() - begin[0])
            peak[0] = peak_rss_mib()

    args = grpo_config(cfg, out, 1)
    args.save_strategy = "no"  # no checkpoint (the Trainer would save one after the last step)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompt_dataset(train_set, tok),
                          processing_class=tok, callbacks=[Stamp()])
    trainer.train()
    return times[1:], peak[0]


def child(engine: str, steps: int, threads: int) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    cfg = erft_config(steps, threads)
    with tempfile.TemporaryDirectory() as tmp:
        times, rss = (native_times if engine == "native" else trl_times)(cfg, Path(tmp) / "run")
    print("RESULT " + json.dumps({"engine": engine, "times": times, "peak_rss_mib": rss,
                                  "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2, help="steps per engine and round (the first is a warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="times each engine runs, in turn")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both engines")
    p.add_argument("--engines", default="native,trl", help="comma-separated subset of native,trl")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.threads)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    res: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for engine in a.engines.split(","):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", engine, "--steps", str(a.steps),
                                   "--threads", str(a.threads)], capture_output=True, text=True, env=env, cwd=ROOT)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{engine} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            row = json.loads(line[-1][7:])
            res.setdefault(engine, []).append(row)
            print(f"round {r + 1} {engine}: steps {[round(t, 1) for t in row['times']]} s, peak RSS "
                  f"{row['peak_rss_mib']:.0f} MiB, load {row['load']:.2f}, wall {time.perf_counter() - t0:.0f} s",
                  flush=True)
    print(f"\nSmolLM2-135M, rg:products, {PROMPTS} prompts x {GROUP} samples, <= {NEW_TOKENS} new tokens, "
          f"{a.threads} thread(s), {a.steps - 1} timed step(s) per run x {a.rounds} round(s)")
    summary = {}
    for engine, rows in res.items():
        times = sorted(t for row in rows for t in row["times"])
        med = times[len(times) // 2] if len(times) % 2 else 0.5 * (times[len(times) // 2 - 1] + times[len(times) // 2])
        summary[engine] = (med, max(row["peak_rss_mib"] for row in rows))
        print(f"  {engine:<8} {med:8.1f} s/step  {1 / med:.4f} steps/s  peak RSS {summary[engine][1]:.0f} MiB")
    if {"native", "trl"} <= summary.keys():
        speed = summary["trl"][0] / summary["native"][0]
        mem = summary["native"][1] / summary["trl"][1]
        print(f"  native / TRL steps/s: {speed:.2f}x (target >= 1.5x: {'PASS' if speed >= 1.5 else 'MISS'})")
        print(f"  native / TRL peak RSS: {mem:.2f} (target <= 1: {'PASS' if mem <= 1 else 'MISS'})")


if __name__ == "__main__":
    main()
