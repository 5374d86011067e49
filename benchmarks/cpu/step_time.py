"""Step time of the native trainer, split into generate / forward / backward / probe, and ClipV's overhead.

Two measurements, side by side in one run:

1. whole steps: ``--steps`` steps of GRPO (``none``) and of ``clip_v`` from the same policy and seed;
   per-stage means and steps/s. Response lengths drift apart as the policies diverge, so this ratio
   mixes the method's cost with its effect on the rollouts;
2. the method's own cost on identical work: the same rollout batch, then the step's stages after the
   rollout (old-policy pass, masks, updates, probe) for each method from the same parameters and
   optimizer state, repeated ``--repeats`` times, interleaved. Target: ClipV ≤ 1.03× of ``none``.
   ``--methods all`` times every registered method at its preset this way (the step-time column of
   ``erft compare --entropy-targets`` is taken inside a sweep that shares the CPU; this is the clean figure).

Usage: ``python -m benchmarks.cpu.step_time [--model default] [--steps 30] [--threads 2] [--methods all]
[--same-batch-only]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.training import stages
from entropy_rft.training.records import Scored, trained_mask
from entropy_rft.training.state import build_run, checkpoint_state, load_checkpoint_state

STAGES = ("time/generate", "time/forward", "time/backward", "time/probe", "time/step")


def whole_steps(model: str, method: str, steps: int, out: Path, threads: int) -> dict[str, float]:
    cfg = load_config(None, [f"model.name={model}", f"method.name={method}", f"train.max_steps={steps}",
                             "eval.every=0", "train.progress=false", f"train.threads={threads}",
                             "train.checkpoint_every=100000", "probe.records_every=0", "train.samples_every=0",
                             "train.tensorboard=false"])
    start(cfg, out / method)
    rows = read_jsonl(out / method / "metrics.jsonl")[2:]  # skip warm-up steps
    res = {k: statistics.mean(r[k] for r in rows) for k in STAGES}
    res["tokens/step"] = statistics.mean(r["response/length"] * 128 for r in rows)
    return res


def same_batch_overhead(model: str, repeats: int, out: Path, threads: int,
                        methods: tuple[str, ...] = ("none", "clip_v")) -> dict[str, float]:
    """Time the post-rollout part of a step for each method (``none`` first) on one fixed batch, interleaved."""
    sets = [f"model.name={model}", "eval.every=0", "train.progress=false", f"train.threads={threads}"]
    runs = {m: build_run(load_config(None, sets + [f"method.name={m}"]), out / f"sb-{m}") for m in methods}
    base = runs["none"]
    exs = stages.sample_prompts(base)
    group = [e for e in exs for _ in range(base.cfg.rollout.group_size)]
    rb = stages.rollout(base, [e.prompt for e in group])
    rewards = torch.tensor([base.task.reward(r, e) for r, e in zip(rb.responses, group)])
    state0 = copy.deepcopy(checkpoint_state(base))
    times: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(repeats):
        for m, run in runs.items():
            load_checkpoint_state(run, copy.deepcopy(state0))
            t0 = time.perf_counter()
            s = Scored(group, rb, rewards, rb.response_mask.clone())
            old = stages.old_policy(run, s)
            sel = stages.select(run, s, old)
            upd = stages.update(run, s, old, sel)
            stages.probe(run, s, old, trained_mask(s, sel, upd))
            times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(v) for m, v in times.items()}


def main() -> None:
    from entropy_rft.control import available_methods

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="none,clip_v", help="Methods for the same-batch timing ('all': every one).")
    ap.add_argument("--same-batch-only", action="store_true", help="Skip the whole-step runs.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = available_methods() if args.methods == "all" else args.methods.split(",")
    methods = ("none", *[m for m in names if m != "none"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        res = ({} if args.same_batch_only else
               {m: whole_steps(args.model, m, args.steps, out, args.threads) for m in ("none", "clip_v")})
        sb = same_batch_overhead(args.model, args.repeats, out, args.threads, methods)
    if res:
        print(f"\nWhole steps ({args.steps} steps each, first 2 dropped), seconds per step:")
        print("| stage | none | clip_v | ratio |\n|---|---|---|---|")
        for k in (*STAGES, "tokens/step"):
            a, b = res["none"][k], res["clip_v"][k]
            print(f"| {k} | {a:.4f} | {b:.4f} | {b / a:.3f} |")
        print(f"steps/s: none {1 / res['none']['time/step']:.2f}, clip_v {1 / res['clip_v']['time/step']:.2f}")
    print(f"\nSame batch, post-rollout stages (median of {args.repeats}, interleaved), seconds and ratio to none:")
    print("| method | s | × none |\n|---|---|---|")
    for m in methods:
        print(f"| {m} | {sb[m]:.4f} | {sb[m] / sb['none']:.3f} |")
    if "clip_v" in sb:
        ratio = sb["clip_v"] / sb["none"]
        print(f"clip_v: ratio {ratio:.3f} (target <= 1.03: {'PASS' if ratio <= 1.03 else 'MISS'})")
    if res:
        gen = res["none"]["time/generate"] / res["none"]["time/step"]
        print(f"generate share of a GRPO step: {gen:.0%}; full-step overhead incl. rollout: "
              f"{(sb['clip_v'] - sb['none']) / res['none']['time/step']:+.1%}")


if __name__ == "__main__":
    main()
