"""Issue 23's figures in one command on a GPU machine (under 10 minutes on an H100), side by side in one run.

    python benchmarks/gpu/kernels.py [--device cuda|cpu] [--quick] [--parts stats,head,verl,trl] [--out DIR]
    python benchmarks/gpu/kernels.py --parts stats --json $OUT/kernels-stats.json     # one part, as the lease kit

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
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
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

V_FULL = 151936
QWEN15_SHAPE = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                "num_key_value_heads": 2, "vocab_size": V_FULL, "max_position_embeddings": 4096,
                "tie_word_embeddings": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6}


# ------------------------------------------------------------------------------------------------ timing


if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import extra_peak, median, sync, time_interleaved  # noqa: E402


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


def child_trl(a) -> None:
    """One TRL run in this fresh process: prints a JSON line with s/step and peak memory."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok, extra = build_model(a.model, a.device)
    # every step the same shapes: prompts of one length, and (below) no end-of-sequence token, so completions
    # run to max_completion_length; in the 2026-11-27 lease the third step took twice the others in every run
    prompts = [f"{i % 10}{(3 * i) % 10}{(7 * i) % 10}>{i % 50:02d}:" for i in range(256)]
    data = Dataset.from_dict({"prompt": prompts})

    def reward(completions, **_):
        return [float(len(c) % 3 == 0) for c in completions]

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *args, **kw):
            stamps.append(time.perf_counter())

    cfg = GRPOConfig(output_dir=a.out, max_steps=a.trl_steps, per_device_train_batch_size=a.trl_batch,
                     num_generations=a.trl_group, max_completion_length=a.trl_tokens, learning_rate=1e-6,
                     logging_steps=1, save_strategy="no", report_to="none", seed=0,
                     use_cpu=not a.device.startswith("cuda"), **extra)
    kw = dict(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
              callbacks=[Stamp()])
    if a.child == "stock":
        trainer = GRPOTrainer(**kw)
    else:
        from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

        trainer = EntropyControlGRPOTrainer(method=a.child, **kw)
    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    stamps.append(time.perf_counter())
    trainer.train()
    steps = [b - x for x, b in zip(stamps, stamps[1:])]
    print(json.dumps({"s_step": median(steps[1:] or steps), "steps": steps,
                      "peak": torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else None,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def build_model(name: str, device: str):
    """(model, tokenizer, extra GRPOConfig fields) for a benchmark model name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "qwen1.5b-random":  # Qwen2.5-1.5B's shape, random weights, erft's character tokenizer
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from entropy_rft.models.loading import build_char_tokenizer

        tok = build_char_tokenizer()
        torch.manual_seed(0)
        # initialised where it trains: 1.5B random weights take ~15 s on the host, a fraction of a second on a GPU
        # (the same weights for every trainer process: the same seed on the same device)
        with torch.device(device if device.startswith("cuda") else "cpu"):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN15_SHAPE, pad_token_id=tok.pad_token_id,
                                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
        # the tokenizer covers the first ids only: never sample the others (same for every trainer)
        # and no end of sequence: every completion is max_completion_length tokens, every step the same shapes
        extra = {"generation_kwargs": {"suppress_tokens": [tok.eos_token_id, *range(len(tok),
                                                                                   QWEN15_SHAPE["vocab_size"])]}}
        return model, tok, extra
    if name.startswith("micro"):  # the smoke run's policy (tests/micro.py)
        sys.path.insert(0, str(ROOT / "tests"))
        from micro import make_micro_policy

        folder = make_micro_policy(Path(os.environ.get("ERFT_BENCH_TMP", "/tmp")) / "bench-micro")
        return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), {}
    from entropy_rft.training.policies import load_policy

    model, tok = load_policy(name, device="cpu")
    return model, tok, {}


TRL_ORDER = ("stock", "none", "clip_v", "clip_v", "none", "stock")  # A-B-C-C-B-A: a drift lands on all alike


def run_trl(a, model: str, trainer: str, out: Path) -> dict:
    """One trainer's run in a fresh subprocess: its JSON line (``steps`` includes the warm-up step) or
    ``{"error": the output's last lines}``."""
    cmd = [sys.executable, __file__, "--child", trainer, "--model", model, "--out", str(out), "--device", a.device,
           *sum(([f"--{k.replace('_', '-')}", str(getattr(a, k))] for k in
                 ("trl_steps", "trl_batch", "trl_group", "trl_tokens")), [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.child_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.child_timeout} s (--child-timeout)"}
    tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-12:])
    if r.returncode:
        return {"error": f"{tail}\nexit code {r.returncode}"}
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"{tail}\nno JSON line in the child's output"}


def pool_trl_runs(runs: list[tuple[str, dict]]) -> dict:
    """trainer -> pooled figures of its runs, from ``(trainer, child result)`` pairs in run order.

    A child's ``steps`` are all its steps, the first being warm-up (compilation, allocator): the timed steps
    are the rest (all of them for a one-step run). Per trainer: ``s_step`` the median of the pooled timed
    steps, ``min``/``max``, ``n`` their count, ``peak`` the largest of its runs' peaks (None on the CPU),
    ``steps`` the pooled timed steps and ``runs`` the raw child results; ``error`` (the failed runs' errors)
    when any of its runs failed, with the figures of the others."""
    out: dict = {}
    for trainer in dict.fromkeys(name for name, _ in runs):
        mine = [r for name, r in runs if name == trainer]
        ok = [r for r in mine if "error" not in r]
        steps = [x for r in ok for x in (r["steps"][1:] or r["steps"])]
        peaks = [r["peak"] for r in ok if r.get("peak") is not None]
        entry: dict = {"s_step": median(steps) if steps else None, "min": min(steps, default=None),
                       "max": max(steps, default=None), "n": len(steps), "steps": steps,
                       "peak": max(peaks, default=None), "runs": mine}
        if len(ok) < len(mine):
            entry["error"] = "\n---\n".join(r["error"] for r in mine if "error" in r)
        out[trainer] = entry
    return out


# ------------------------------------------------------------------------------------------------ report


def ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.0f} MiB"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "MISS"


def table_rows(res: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in res.get("stats", []):
        label = f"token_stats {r['dtype']} {r['shape'][0]}x{r['shape'][1]} T={r['temperature']}"
        rows.append((f"{label} / logsumexp", f"{r['ratio']:.2f}x ({ms(r['t']['token_stats'])} / "
                     f"{ms(r['t']['logsumexp'])})", "<= 1.0x", verdict(r["ratio"] <= 1.0)))
        rows.append(("  bandwidth / device copy", f"{r['copy_bw_fraction']:.0%}", ">= 60% (moonshot)",
                     verdict(r["copy_bw_fraction"] >= 0.6)))
        if "trl_logp_entropy" in r["t"]:
            ratio = r["t"]["token_stats"] / r["t"]["trl_logp_entropy"]
            rows.append(("  token_stats / TRL selective_log_softmax_and_entropy", f"{ratio:.2f}x "
                         f"({ms(r['t']['token_stats'])} / {ms(r['t']['trl_logp_entropy'])})", "<= 1.1x",
                         verdict(ratio <= 1.1)))
        elif "trl_logp_entropy" in r.get("errors", {}):
            rows.append(("  token_stats / TRL selective_log_softmax_and_entropy", r["errors"]["trl_logp_entropy"],
                         "<= 1.1x", "n/a"))
        if "token_stats_torch" in r["t"]:
            rows.append(("  torch path / logsumexp", f"{r['t']['token_stats_torch'] / r['t']['logsumexp']:.1f}x",
                         "", "info"))
        if r["extra_peak"] is not None:
            rows.append(("  extra peak / logits", f"{r['extra_peak'] / r['bytes']:.3%} ({mib(r['extra_peak'])})",
                         "<= 1%", verdict(r["extra_peak"] <= 0.01 * r["bytes"])))
            rows.append(("  host syncs | kernel launches per call (logsumexp's launches)",
                         f"{r['syncs']} | {r['launches']} ({r['launches_logsumexp']})", "<= 1 sync",
                         verdict(r["syncs"] <= 1)))
        worst = max(r["error_over_bound"].values())
        rows.append(("  worst error / bound vs float64 (H, S*, E_p[S])", f"{worst:.3f}", "<= 1", verdict(worst <= 1)))
    sweep = res.get("stats_sweep")
    if sweep:
        n, v = sweep["shape"]
        for cfg, sec in sweep["t"].items():
            if cfg == "trl":
                continue
            vs = f" = {sec / sweep['t']['trl']:.2f}x TRL's kernel" if "trl" in sweep["t"] else ""
            rows.append((f"  token_stats bf16 {n}x{v} T=0.7, block x warps {cfg}", f"{ms(sec)}{vs}, "
                         f"{sweep['bytes'] / sec / 1e12:.2f} TB/s", "", "info"))
    for r in res.get("head", []):
        n, d, v = r["shape"]
        t, p = r["t"], r["peak"]
        for other, target in (("trl", 1.1), ("liger", 1.1), ("liger_entropy", 1.1), ("baseline", None)):
            if other not in t:
                rows.append((f"head N{n} D{d} V{v}: ours / {other}", r["errors"].get(other, "not installed"), "",
                             "n/a"))
                continue
            ratio = t["ours"] / t[other]
            rows.append((f"head N{n} D{d} V{v}: ours / {other} (fwd+bwd)",
                         f"{ratio:.2f}x ({ms(t['ours'])} / {ms(t[other])})",
                         f"<= {target}x" if target else "", verdict(ratio <= target) if target else "info"))
            if p.get("ours") is not None and p.get(other):
                pr = p["ours"] / p[other]
                rows.append((f"  peak ours / {other}", f"{pr:.2f}x ({mib(p['ours'])} / {mib(p[other])})",
                             "<= 1.05x" if target else "", verdict(pr <= 1.05) if target else "info"))
        rows.append(("  max |log p - materialised|", f"{r['max_abs_logp_err']:.1e}", "", "info"))
    if "verl" in res:
        r = res["verl"]
        rows.append((f"verl micro-batch {r['shape'][0]}x{r['shape'][1]} bf16, T 0.7 per token: ours / verl-style",
                     f"{r['ratio']:.2f}x ({ms(r['t']['ours'])} / {ms(r['t']['verl_entropy'])})", "<= 1.1x",
                     verdict(r["ratio"] <= 1.1)))
    for model, runs in res.get("trl", {}).items():
        rows += trl_rows(model, runs)
    return rows


def trl_rows(model: str, runs: dict) -> list[tuple[str, str, str, str]]:
    """The TRL part's rows for one model: each trainer's pooled s/step, then none and clip_v against stock."""
    rows = []
    for trainer in ("stock", "none", "clip_v"):
        r = runs.get(trainer)
        if r and r.get("s_step") is not None:
            k = sum("error" not in x for x in r["runs"])
            rows.append((f"TRL {model}: {trainer} s/step (median of {r['n']} steps, {k} runs pooled)",
                         f"{r['s_step']:.3f} s ({r['min']:.3f} to {r['max']:.3f}), peak {mib(r['peak'])}", "",
                         "info"))
    stock = runs.get("stock")
    own = [median(x["steps"][1:] or x["steps"]) for x in (stock or {}).get("runs", []) if "error" not in x]
    if len(own) >= 2:  # the first and last run of the A-B-C-C-B-A order: the noise floor of the ratios below
        spread = (max(own) - min(own)) / (sum(own) / len(own))
        rows.append((f"TRL {model}: stock against itself (runs 1 and {len(TRL_ORDER)})", f"{spread:.1%} "
                     f"({' / '.join(f'{x:.3f}' for x in own)} s)", "< 5%", verdict(spread < 0.05)))
    for method, target in (("none", 1.05), ("clip_v", 1.15)):
        r = runs.get(method)
        if r is None or stock is None:  # a part killed before these runs
            rows.append((f"TRL {model}: {method} / stock", "not run", f"<= {target}x", "n/a"))
            continue
        if "error" in r or "error" in stock:
            rows.append((f"TRL {model}: {method} / stock", "FAILED", f"<= {target}x", "MISS"))
            continue
        ratio = r["s_step"] / stock["s_step"]
        rows.append((f"TRL {model}: {method} / stock s/step", f"{ratio:.2f}x ({r['s_step']:.3f} / "
                     f"{stock['s_step']:.3f} s)", f"<= {target}x", verdict(ratio <= target)))
        if r.get("peak") and stock.get("peak"):
            pr = r["peak"] / stock["peak"]
            rows.append((f"  peak {method} / stock", f"{pr:.2f}x ({mib(r['peak'])})", "<= 1.05x",
                         verdict(pr <= 1.05)))
    return rows


def md_cell(x: object) -> str:
    """A table cell: one line, its pipes escaped."""
    return str(x).replace("\r", " ").replace("\n", " ").replace("|", "\\|")


def render_markdown(res: dict) -> str:
    """The results' markdown: a title line, the table of ``table_rows`` and the wall time (where recorded).
    Works on one run's dict, a partial one (a killed part) or several parts' entries merged into one dict."""
    title = f"# {res.get('device', '?')}, {res.get('date', '?')} (torch {res.get('torch', '?')}, " \
            f"triton {res.get('triton', '?')})"
    md = [title, "", "| measure | measured | target | result |", "|---|---|---|---|"]
    md += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in table_rows(res)]
    if res.get("wall_s") is not None:
        md += ["", f"Wall time {res['wall_s']:.0f} s."]
    return "\n".join(md) + "\n"


def write_json_atomic(path: Path, res: dict) -> None:
    """Write ``res`` to ``path`` through a temporary file in the same folder and ``os.replace``: a reader (or a
    process killed mid-write) never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from the kit's other readers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def write_report(res: dict, out: Path) -> Path:
    """Without --json: ``<device>-<date>[-quick].json`` and ``.md`` in ``out``; returns the path without suffix."""
    out.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() else "-" for c in res["device"].lower()).strip("-") + f"-{res['date']}"
    if res["quick"]:
        stem += "-quick"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{stem}.md").write_text(render_markdown(res))
    return out / stem


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
