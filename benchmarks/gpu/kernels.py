"""Issue 23's figures in one command on a GPU machine (under 10 minutes on an H100), side by side in one run.

    python -m benchmarks.gpu.kernels [--device cuda|cpu] [--quick] [--parts stats,head,verl,trl] [--out DIR]
    python -m benchmarks.gpu.kernels --parts stats --json $OUT/kernels-stats.json     # one part, as the lease kit

Writes ``DIR/<device>-<date>.json`` and ``.md`` (default DIR: benchmarks/results) and prints the table. With
``--json FILE`` it writes only FILE, atomically, after every finished measurement (a process killed half-way
leaves valid JSON with what it finished); ``render_markdown`` turns such a dict (or several parts' merged) into
the markdown table. Every ratio compares functions timed in the same rounds (interleaved, CUDA events, medians
after warm-up).

1. stats: ``token_stats`` (backend auto: the Triton kernel on CUDA) vs ``torch.logsumexp`` and a device copy
   of the same logits, bf16 [16384 x 151,936] at T = 1 and 0.7 and fp32 [1024 x 151,936] (plus the torch
   path there); extra peak memory against the logits' bytes; host syncs per call
   (``torch.cuda.set_sync_debug_mode``) and kernel launches per call (the profiler); accuracy on 64 rows
   against float64; at a float temperature also TRL 1.16's own Triton kernel
   (``trl.kernels.selective_log_softmax_and_entropy``, log-prob + entropy) in the same rounds. Targets:
   <= 1.0x logsumexp, <= 1.1x TRL's kernel, extra peak <= 1% of the logits, <= 1 sync.
2. head: the fused LM head with statistics (``fused_logp``) forward + backward of ``logp.sum()`` on
   [16384 tokens, D 1536 and 3584, V 151,936] bf16, against ``h @ W.T`` + ``log_softmax`` + gather (no
   statistics), TRL 1.16's own fused head (``trl.kernels.chunked_logprob``, log-prob + entropy) and Liger's
   fused linear cross-entropy with entropy (``LigerFusedLinearScaledCrossEntropyFunction``; needs the
   ``liger-kernel`` wheel, carried: see benchmarks/README.md). Targets: <= 1.1x TRL and Liger, peak <= 1.05x.
3. verl: the statistics of one micro-batch's logits (bf16 [8192 x 151,936], per-token temperature 0.7)
   with the temperature applied in the kernel, against a verl-style entropy of the same logits (a
   ``logits / temperature`` copy, then per 2048-row chunk ``logsumexp - sum(softmax * z)`` in float32, as
   verl's ``entropy_from_logits_with_chunking``). Target: <= 1.1x.
4. trl: s/step and peak memory of ``EntropyControlGRPOTrainer`` (method ``none`` and ``clip_v``) against
   stock ``GRPOTrainer`` with the same ``GRPOConfig`` (TRL's defaults: bf16 on CUDA, gradient
   checkpointing), on a randomly initialised Qwen2.5-1.5B-shaped model (config written here, no download;
   ``--models smollm2-135m`` adds SmolLM2 where its GGUF file is carried). The trainers run in A-B-C-C-B-A
   order (stock, none, clip_v, clip_v, none, stock), each a fresh subprocess whose first step is warm-up;
   each trainer's timed steps of its two processes are pooled (median s/step). Targets: none <= 1.05x,
   clip_v <= 1.15x, peak <= 1.05x.

``--device cpu --quick`` is the smoke run at tiny sizes (kernels under ``TRITON_INTERPRET=1``, which this
script sets on CPU); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script (not imported for render_markdown / pool_trl_runs)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined

import torch  # noqa: E402

# ------------------------------------------------------------------------------------------------ timing
from benchmarks.gpu.kernels_report import (  # noqa: E402  (render_markdown, trl_rows: kept importable from here)
    mib,
    ms,
    render_markdown,  # noqa: F401
    table_rows,
    trl_rows,  # noqa: F401
    write_json_atomic,
    write_report,
)
from benchmarks.gpu.kernels_trl import TRL_ORDER, V_FULL, child_trl, pool_trl_runs, run_trl  # noqa: E402
from benchmarks.gpu.timing import extra_peak, median, sync, time_interleaved  # noqa: E402


def host_syncs(fn, dev: str) -> tuple[int | None, list[str]]:
    """(synchronising CUDA calls made by one warm call of ``fn``, where each was made) from torch's sync debug
    mode. ``fn`` runs once untimed first: a first call's one-off work (a compile, an allocation) is not the
    call's cost, and the 2026-11-27 lease counted 2 syncs on the first call only."""
    if not dev.startswith("cuda"):
        return None, []
    fn()
    sync(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return len(sites), sites


def kernel_launches(fn, dev: str) -> int | None:
    """Device kernels (and copies) launched by one call of ``fn``, from the profiler."""
    if not dev.startswith("cuda"):
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


# ---------------------------------------------------------------------------------------------- 1. stats


def accuracy(z, ids, temperature, stats) -> dict:
    """Worst error / bound on 64 rows against float64 on the dtype-rounded logits (issue 23's bounds)."""
    rows = torch.linspace(0, z.shape[0] - 1, min(64, z.shape[0])).long().to(z.device)
    t = temperature[rows].double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    y = z[rows].double() / t
    lp = torch.log_softmax(y, -1)
    p = lp.exp()
    h = -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)
    s = torch.where(p > 0, p * (h.unsqueeze(-1) + lp), torch.zeros_like(p))
    k = ids[rows].unsqueeze(-1)
    ref = {"entropy": h, "s_star": s.gather(-1, k).squeeze(-1), "s_expected": (p * s).sum(-1)}
    out = {}
    for f, r in ref.items():
        g = getattr(stats, f)[rows].double()
        bound = 1e-5 * (1 + r.abs()) if f == "entropy" else 1e-6 + 1e-4 * r.abs()
        out[f] = float(((g - r).abs() / bound).max())
    return out


def error_text(e: BaseException) -> str:
    """A short one-line record of an exception, for the JSON and the table."""
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def trl_stats_fn(z: torch.Tensor, ids: torch.Tensor, temperature: float | torch.Tensor):
    """(fn, error): TRL 1.16's own Triton log-prob + entropy kernel on the same logits, tried once, or (None,
    why not). It takes one float temperature: (None, None) for a per-row temperature, nothing to compare."""
    if not isinstance(temperature, float):
        return None, None
    try:
        from trl.kernels import selective_log_softmax_and_entropy
    except Exception as e:  # noqa: BLE001 (a missing or broken package must not end the part)
        return None, error_text(e)

    def fn():
        return selective_log_softmax_and_entropy(z, ids, temperature)

    try:
        fn()  # the interpreter (or an old GPU) may refuse it: a recorded error, not a failed part
    except Exception as e:  # noqa: BLE001
        return None, error_text(e)
    return fn, None


def bench_stats(a, dtype: torch.dtype, rows: int, vocab: int, temperature: float | str) -> dict:
    """token_stats against logsumexp, a device copy and TRL's kernel on one logits shape and temperature."""
    from entropy_rft.core.dynamics import token_stats

    dev = a.device
    g = torch.Generator(device=dev).manual_seed(0)
    z = (torch.randn(rows, vocab, generator=g, device=dev, dtype=dtype) * 3)
    ids = torch.randint(0, vocab, (rows,), generator=g, device=dev)
    t = torch.full((rows,), 0.7, device=dev) if temperature == "per_row" else temperature
    nbytes = z.numel() * z.element_size()
    fns = {"copy": lambda: z.clone(), "logsumexp": lambda: torch.logsumexp(z, dim=-1),
           "token_stats": lambda: token_stats(z, ids, t)}
    if dtype == torch.float32 and temperature == 1.0:
        fns["token_stats_torch"] = lambda: token_stats(z, ids, t, backend="torch")
    errors = {}
    trl_fn, err = trl_stats_fn(z, ids, t)
    if trl_fn is not None:
        fns["trl_logp_entropy"] = trl_fn
    elif err:
        errors["trl_logp_entropy"] = err
        print(f"[stats] TRL's selective_log_softmax_and_entropy not run: {err}", flush=True)
    tm = time_interleaved(fns, dev, a.reps)
    st = token_stats(z, ids, t)
    res = {"dtype": str(dtype).removeprefix("torch."), "shape": [rows, vocab], "temperature": temperature,
           "bytes": nbytes, "t": tm, "ratio": tm["token_stats"] / tm["logsumexp"], "errors": errors,
           "bw_stats": nbytes / tm["token_stats"], "bw_copy": 2 * nbytes / tm["copy"],
           "extra_peak": extra_peak(lambda: token_stats(z, ids, t), dev),
           "syncs": None, "sync_sites": [],
           "launches": kernel_launches(lambda: token_stats(z, ids, t), dev),
           "launches_logsumexp": kernel_launches(lambda: torch.logsumexp(z, dim=-1), dev),
           "error_over_bound": accuracy(z, ids, t, st)}
    res["syncs"], res["sync_sites"] = host_syncs(lambda: token_stats(z, ids, t), dev)
    res["copy_bw_fraction"] = res["bw_stats"] / res["bw_copy"]
    if "trl_logp_entropy" in tm:
        res["ratio_trl"] = tm["token_stats"] / tm["trl_logp_entropy"]
    return res


SWEEP = ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16))  # (block, warps) tried


def bench_sweep(a, rows: int) -> dict:
    """The statistics kernel at each (block, warps) of ``SWEEP`` on bf16 [rows, V] logits at T 0.7, timed in the
    same rounds as TRL's kernel: the data for ``kernels.stats.default_block`` / ``default_warps``."""
    from entropy_rft.core.kernels.stats import row_stats

    dev = a.device
    g = torch.Generator(device=dev).manual_seed(0)
    z = torch.randn(rows, a.vocab, generator=g, device=dev, dtype=torch.bfloat16) * 3
    ids = torch.randint(0, a.vocab, (rows,), generator=g, device=dev)
    configs = SWEEP[:1] if a.quick else SWEEP  # the interpreter: one, to keep the smoke run short
    fns = {f"{b}x{w}": (lambda b=b, w=w: row_stats(z, ids, 0.7, block=b, warps=w)) for b, w in configs}
    trl_fn, err = trl_stats_fn(z, ids, 0.7)
    if trl_fn is not None:
        fns["trl"] = trl_fn
    res = {"shape": [rows, a.vocab], "t": time_interleaved(fns, dev, a.reps), "bytes": z.numel() * 2}
    if err:
        res["error"] = err
    return res


# ----------------------------------------------------------------------------------------------- 2. head


def head_fns(h, w, ids) -> dict:
    """name -> fn running forward + backward of logp.sum() (entropy computed, without grad)."""
    from entropy_rft.core.fused import fused_logp

    def ours():
        fused_logp(h, w, ids).logp.sum().backward()

    def baseline():  # what a log-prob costs without any statistics: materialised logits
        lp = torch.log_softmax((h @ w.T).float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        lp.sum().backward()

    fns = {"ours": ours, "baseline": baseline}
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def trl_head():
            logp, _ent, *_ = ChunkedLogProbFunction.apply(h, w, None, ids, 1.0, 4096, None, 1.0, ("entropy",))
            logp.sum().backward()

        fns["trl"] = trl_head
    except ImportError as e:
        print(f"[head] TRL's fused head not importable: {e}", flush=True)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def liger():  # Liger's Triton head, per-token loss (reduction "none": an RL loss weights each token)
            nll, *_ = LigerFusedLinearCrossEntropyFunction.apply(h, w, ids, None, None, -100, 0.0, 0.0, "none")
            nll.sum().backward()

        fns["liger"] = liger
    except ImportError as e:
        print(f"[head] Liger not installed ({e}): carry the liger-kernel wheel (benchmarks/README.md)", flush=True)
    try:  # Liger's head with entropy; on sm_90 it needs the CuTe DSL (nvidia-cutlass-dsl, ~95 MB: not carried)
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

        def liger_entropy():
            nll, _ent = LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, ids, 1.0, -100, 1, True)
            nll.sum().backward()

        fns["liger_entropy"] = liger_entropy
    except ImportError:
        pass
    return fns


def bench_head(a, dim: int) -> dict:
    from entropy_rft.core.fused import fused_logp

    dev = a.device
    g = torch.Generator(device=dev).manual_seed(1)
    n, vocab = a.head_tokens, a.vocab
    h = torch.randn(n, dim, generator=g, device=dev).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, dim, generator=g, device=dev) / dim**0.5).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab, (n,), generator=g, device=dev)

    def clear(_name=None):
        h.grad = None
        w.grad = None

    fns = head_fns(h, w, ids)
    res: dict = {"shape": [n, dim, vocab], "t": {}, "peak": {}, "errors": {}}
    for name, fn in fns.items():  # a failing comparison is reported, not fatal
        try:
            clear()
            fn()
        except Exception as e:  # noqa: BLE001
            res["errors"][name] = f"{type(e).__name__}: {e}"[:300]
    fns = {k: v for k, v in fns.items() if k not in res["errors"]}
    res["t"] = time_interleaved(fns, dev, max(3, a.reps // 2), before=clear)
    res["peak"] = {k: extra_peak(fn, dev, before=clear) for k, fn in fns.items()}
    clear()
    with torch.no_grad():
        ref = torch.log_softmax((h @ w.T).float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        res["max_abs_logp_err"] = float((fused_logp(h, w, ids).logp - ref).abs().max())
    res["syncs"], res["sync_sites"] = host_syncs(lambda: fns["ours"](), dev)
    clear()
    return res


# ----------------------------------------------------------------------------------------------- 3. verl


def verl_style_entropy(logits: torch.Tensor, temperature: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """verl's path: a ``logits / temperature`` copy, then entropy per 2048-row chunk in float32."""
    z = logits / temperature.to(logits.dtype).unsqueeze(-1)
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    for i in range(0, z.shape[0], chunk):
        c = z[i : i + chunk].float()
        out[i : i + chunk] = torch.logsumexp(c, -1) - (torch.softmax(c, -1) * c).sum(-1)
    return out


def bench_verl(a) -> dict:
    from entropy_rft.core.dynamics import token_stats

    dev = a.device
    g = torch.Generator(device=dev).manual_seed(2)
    z = torch.randn(a.verl_tokens, a.vocab, generator=g, device=dev, dtype=torch.bfloat16) * 3
    ids = torch.randint(0, a.vocab, (a.verl_tokens,), generator=g, device=dev)
    t = torch.full((a.verl_tokens,), 0.7, device=dev)
    fns = {"verl_entropy": lambda: verl_style_entropy(z, t), "ours": lambda: token_stats(z, ids, t)}
    tm = time_interleaved(fns, dev, a.reps)
    return {"shape": [a.verl_tokens, a.vocab], "t": tm, "ratio": tm["ours"] / tm["verl_entropy"],
            "peak": {k: extra_peak(fn, dev) for k, fn in fns.items()}}


# ------------------------------------------------------------------------------------------------ 4. trl


# ------------------------------------------------------------------------------------------------ report


def empty_cache(dev: str) -> None:
    """Hand cached device memory back between measurements (a no-op on the CPU)."""
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()


def part_stats(a, res: dict, save) -> None:
    """Part 1: each logits configuration, saved as it finishes."""
    res["stats"] = []
    big = 64 if a.quick else 16384
    for dtype, rows, temp in ((torch.bfloat16, big, 1.0), (torch.bfloat16, big, 0.7),
                              (torch.bfloat16, big, "per_row"), (torch.float32, 16 if a.quick else 1024, 1.0)):
        r = bench_stats(a, dtype, rows, a.vocab, temp)
        res["stats"].append(r)
        save()
        trl = f", {r['ratio_trl']:.2f}x TRL's kernel" if "ratio_trl" in r else ""
        print(f"[stats] {r['dtype']} {rows}x{a.vocab} T={temp}: {r['ratio']:.2f}x logsumexp{trl}", flush=True)
        empty_cache(a.device)
    res["stats_sweep"] = bench_sweep(a, big)
    save()
    print("[stats] sweep: " + ", ".join(f"{k} {ms(v)}" for k, v in res["stats_sweep"]["t"].items()), flush=True)
    empty_cache(a.device)


def part_head(a, res: dict, save) -> None:
    """Part 2: each hidden size, saved as it finishes."""
    res["head"] = []
    for dim in ((64,) if a.quick else (1536, 3584)):
        r = bench_head(a, dim)
        res["head"].append(r)
        save()
        print(f"[head] D {dim}: " + ", ".join(f"{k} {ms(v)}" for k, v in r["t"].items()), flush=True)
        empty_cache(a.device)


def part_verl(a, res: dict, save) -> None:
    """Part 3: the verl-style comparison, saved when it finishes."""
    res["verl"] = bench_verl(a)
    save()
    print(f"[verl] ours / verl-style: {res['verl']['ratio']:.2f}x", flush=True)


def part_trl(a, res: dict, save) -> None:
    """Part 4: per model the trainers in A-B-C-C-B-A order, each a fresh process, pooled and saved after each."""
    res["trl"] = {}
    models = (a.models or ("micro" if a.quick else "qwen1.5b-random")).split(",")
    tmp = Path(os.environ.get("ERFT_BENCH_TMP", "/tmp")) / "erft-bench-trl"
    for model in models:
        runs: list[tuple[str, dict]] = []
        for i, trainer in enumerate(TRL_ORDER):
            r = run_trl(a, model, trainer, tmp / f"{model}-{trainer}-{i}")
            runs.append((trainer, r))
            res["trl"][model] = pool_trl_runs(runs)
            save()
            print(f"[trl] {model} {trainer} (run {i + 1}/{len(TRL_ORDER)}): " +
                  (r["error"].splitlines()[-1] if "error" in r else
                   f"{median(r['steps'][1:] or r['steps']):.3f} s/step, peak {mib(r['peak'])}"), flush=True)


PARTS = {"stats": part_stats, "head": part_head, "verl": part_verl, "trl": part_trl}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults that depend on --quick filled in."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run whose figures mean nothing")
    ap.add_argument("--parts", default="stats,head,verl,trl", help="comma-separated parts to run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the JSON and md")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results only to FILE, atomically "
                    "after every finished measurement (no .md, nothing in --out)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds (median; default 10, quick 2)")
    ap.add_argument("--models", default=None, help="TRL part: comma-separated (default qwen1.5b-random; quick: "
                    "micro; smollm2-135m needs its GGUF file)")
    ap.add_argument("--trl-steps", type=int, default=None, help="TRL steps per run, the first one warm-up "
                    "(default 5; quick 2)")
    ap.add_argument("--trl-batch", type=int, default=None, help="per-device batch (default 16; quick 4)")
    ap.add_argument("--trl-group", type=int, default=None, help="num_generations (default 8; quick 2)")
    ap.add_argument("--trl-tokens", type=int, default=None, help="max_completion_length (default 64; quick 4)")
    ap.add_argument("--child-timeout", type=int, default=240)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for k, full, quick in (("reps", 10, 2), ("trl_steps", 5, 2), ("trl_batch", 16, 4), ("trl_group", 8, 2),
                           ("trl_tokens", 64, 4)):
        if getattr(a, k) is None:
            setattr(a, k, quick if a.quick else full)
    return a


def main() -> int:
    a = parse_args()
    if a.child:
        child_trl(a)
        return 0
    # a kit's timeout (SIGTERM) unwinds: subprocess.run then kills a running TRL child rather than orphan it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu --quick)", file=sys.stderr)
        return 2
    q = a.quick
    a.vocab = 1000 if q else V_FULL
    a.head_tokens = 64 if q else 16384
    a.verl_tokens = 32 if q else 8192
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = sorted(set(parts) - set(PARTS))
    if bad:
        print(f"--parts: unknown part(s) {', '.join(bad)}; choose from stats, head, verl, trl", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu"
    import triton

    res: dict = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                 "date": datetime.date.today().isoformat(), "quick": q, "args": {k: v for k, v in vars(a).items()}}
    t_start = time.perf_counter()
    json_path = Path(a.json) if a.json else None

    def save() -> None:  # with --json: the results so far, after every finished measurement
        if json_path is not None:
            res["wall_s"] = time.perf_counter() - t_start
            write_json_atomic(json_path, res)

    save()
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for part in PARTS:
        if part in parts:
            PARTS[part](a, res, save)
    res["wall_s"] = time.perf_counter() - t_start
    rows = table_rows(res)
    res["table"] = rows
    w = max((len(r[0]) for r in rows), default=10)
    print()
    for m, v, t, r in rows:
        print(f"{m:{w}s}  {v:40s}  {t:18s} {r}")
    if json_path is not None:
        write_json_atomic(json_path, res)
        print(f"\nwrote {json_path} ({res['wall_s']:.0f} s)")
    else:
        stem = write_report(res, Path(a.out))
        print(f"\nwrote {stem}.json and .md ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
