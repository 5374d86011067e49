"""Thread count on a shared machine: step time of the default policy, and token_stats, at 1 thread, 2 threads
and the automatic choice (``entropy_rft.common.threads.choose_threads``), each alone and next to one other busy
process (``python -c 'while True: pass'``), interleaved, side by side in one run.

    .venv/bin/python -m benchmarks.cpu.threads [--steps 6] [--rounds 2] [--threads 1,2,2p] [--skip-steps]
    .venv/bin/python -m benchmarks.cpu.threads --model smollm2-135m --skip-token-stats --rounds 1

A count with a "p" suffix (e.g. 2p) runs that many threads with OMP_WAIT_POLICY=PASSIVE in the child's
environment (libgomp reads it when torch loads it: it cannot be set from inside a running process).

Every measurement runs in a fresh subprocess with its thread count set before any work. Step time: the
native trainer (``launch.start``) on the built-in default policy for ``--steps`` steps, no evaluation, no
checkpoints; the median ``time/step`` of the steps after the first two (warm-up). token_stats: 1024 x
151,936 float32 logits (``--rows``), best of 3 in the child. Each (threads, neighbour) pair runs once per
round; the best of the rounds is kept. ``--model smollm2-135m`` times a SmolLM2 mini-step instead: sample 8
chat prompts x 16 new tokens with the static decoder, the packed policy forward and its backward (the GEMM-bound
work of a real step, best of 3). The automatic choice is what ``erft`` runs: ``choose_threads``'s count, with
``OMP_WAIT_POLICY=PASSIVE`` when it is above 1 (the CLI sets it before torch loads).
Target (issue 15): the automatic choice with a busy neighbour
<= 1.3x the best of 1 or 2 threads in the same conditions. "Alone" means no neighbour of ours: other
processes on the machine (the load average is printed) are not controlled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 1.3


def child_steps(threads: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from entropy_rft.config.loading import load_config
    from entropy_rft.launch.run import start
    from entropy_rft.rundir.files import read_jsonl

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(None, ["model.name=default", f"train.max_steps={steps}", "eval.every=0",
                                 "train.progress=false", f"train.threads={threads}",
                                 "train.checkpoint_every=100000", "probe.records_every=0",
                                 "train.samples_every=0", "train.tensorboard=false"])
        start(cfg, Path(d) / "run")
        rows = read_jsonl(Path(d) / "run" / "metrics.jsonl")
    times = [r["time/step"] for r in rows if "time/step" in r][2:]
    return {"time": statistics.median(times), "threads_in_effect": torch.get_num_threads()}


def child_smollm2(threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from entropy_rft.policy.forward import policy_forward
    from entropy_rft.policy.rollout import sample
    from entropy_rft.tasks.prompts import ChatPrompt
    from entropy_rft.training.policies import load_policy

    model, tok = load_policy("smollm2-135m")
    model.train().requires_grad_(True)
    prompts = [ChatPrompt(f"Solve the following multiplication: {a} * {a + 1}. Give only the result.")
               for a in range(8)]
    best = float("inf")
    for i in range(4):
        t0 = time.perf_counter()
        rb = sample(model, tok, prompts, max_new_tokens=16, generator=torch.Generator().manual_seed(i))
        out = policy_forward(model, rb, 1.0)
        (out.logp * rb.response_mask).sum().backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first is a warm-up
            best = min(best, time.perf_counter() - t0)
    return {"time": best, "threads_in_effect": torch.get_num_threads()}


def child_token_stats(threads: int, rows: int, vocab: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from entropy_rft.core.dynamics import token_stats

    g = torch.Generator().manual_seed(0)
    z = torch.randn(rows, vocab, generator=g) * 3
    ids = torch.randint(0, vocab, (rows,), generator=g)
    token_stats(z[:2], ids[:2])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        token_stats(z, ids)
        best = min(best, time.perf_counter() - t0)
    return {"time": best, "threads_in_effect": torch.get_num_threads()}


def measure(kind: str, threads: str, busy: bool, a: argparse.Namespace) -> float | None:
    cmd = [sys.executable, __file__, "--child", kind, "--child-threads", threads.rstrip("p"), "--steps",
           str(a.steps), "--rows", str(a.rows), "--vocab", str(a.vocab)]
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if threads.endswith("p"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800, env=env).stdout
        return float(json.loads(out.strip().splitlines()[-1])["time"])
    except (subprocess.SubprocessError, OSError, ValueError, KeyError) as e:
        print(f"{kind} at {threads} thread(s), busy={busy} failed: {e}", file=sys.stderr)
        return None
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def run_kind(kind: str, counts: list[str], auto: str, a: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """Interleaved rounds over (threads, neighbour); prints the figures, returns the verdict rows."""
    keys = [(k, busy) for busy in (False, True) for k in counts]
    best: dict[tuple[str, bool], float] = {}
    for r in range(a.rounds):
        for k, busy in keys:
            t = measure(kind, k, busy, a)
            if t is not None:
                best[(k, busy)] = min(best.get((k, busy), float("inf")), t)
            print(f"  round {r + 1}: {kind:11s} threads {k:3s} {'busy neighbour' if busy else 'alone':14s} "
                  f"{'failed' if t is None else f'{t:7.3f} s'}   (load {os.getloadavg()[0]:.2f})", flush=True)
    rows = []
    for busy in (False, True):
        cond = "busy neighbour" if busy else "alone"
        ref = min((best[(k, busy)] for k in counts if (k, busy) in best and k in ("1", "2")), default=None)
        if ref is None or (auto, busy) not in best:
            rows.append((f"{kind}, {cond}", "n/a", f"<= {TARGET}x", "MISS"))
            continue
        figs = ", ".join(f"{k} thr {best[(k, busy)]:.3f} s" for k in counts if (k, busy) in best)
        ratio = best[(auto, busy)] / ref
        ok = ratio <= TARGET
        rows.append((f"{kind}, {cond}: auto ({auto} thr) / best of 1, 2", f"{ratio:.2f}x  [{figs}]",
                     f"<= {TARGET}x", ("PASS" if ok else "MISS") if busy else ("PASS" if ok else "info")))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps per step-time child (first 2 skipped)")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", default="1,2,2p", help="comma list of thread counts to compare (2p: passive)")
    ap.add_argument("--model", default="default", choices=["default", "smollm2-135m"],
                    help="policy of the step-time part (smollm2-135m: a mini-step, see the docstring)")
    ap.add_argument("--skip-steps", action="store_true", help="token_stats only")
    ap.add_argument("--skip-token-stats", action="store_true", help="step time only")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "steps":
        print(json.dumps(child_steps(a.child_threads, a.steps)))
        return 0
    if a.child == "smollm2":
        print(json.dumps(child_smollm2(a.child_threads)))
        return 0
    if a.child == "token_stats":
        print(json.dumps(child_token_stats(a.child_threads, a.rows, a.vocab)))
        return 0

    from entropy_rft.common.threads import available_cores, choose_threads
    from entropy_rft.training.policies import load_policy

    model, _ = load_policy(a.model)
    n_params = sum(p.numel() for p in model.parameters())
    n = choose_threads(0, n_params, "cpu")
    auto = f"{n}p" if n > 1 else str(n)  # what erft runs: PASSIVE above one thread
    counts = sorted({x.strip() for x in a.threads.split(",")} | {auto})
    print(f"cores {available_cores()}, {a.model} policy {n_params / 1e6:.2f}M params -> automatic choice {auto} "
          f"thread(s); load average at start {os.getloadavg()[0]:.2f}")
    table = []
    if not a.skip_steps:
        table += run_kind("steps" if a.model == "default" else "smollm2", counts, auto, a)
    if not a.skip_token_stats:
        table += run_kind("token_stats", counts, auto, a)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    print(f"{'measure':60s} {'measured':>50s} {'target':>8s}  result")
    for what, value, target, res in table:
        print(f"{what:60s} {value:>50s} {target:>8s}  {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
