"""The TRL part of benchmarks/gpu/kernels.py (issue 23, part 4): each trainer (stock ``GRPOTrainer``, the plug-in
with ``none`` and ``clip_v``) in a fresh subprocess of kernels.py (``--child``), in A-B-C-C-B-A order, and the
pooled s/step and peak memory of each."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu.timing_math import median

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "benchmarks.gpu.kernels"  # a child is python -m benchmarks.gpu.kernels --child TRAINER, from ROOT
V_FULL = 151936
QWEN15_SHAPE = {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                "num_key_value_heads": 2, "vocab_size": V_FULL, "max_position_embeddings": 4096,
                "tie_word_embeddings": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6}


def child_trl(a) -> None:
    """One TRL run in this fresh process: prints a JSON line with s/step and peak memory."""
    import torch
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
    import torch
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
    if name.startswith("micro"):  # the smoke run's policy
        from entropy_rft.models.micro import make_micro_policy

        folder = make_micro_policy(Path(os.environ.get("ERFT_BENCH_TMP", "/tmp")) / "bench-micro")
        return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), {}
    from entropy_rft.training.policies import load_policy

    model, tok = load_policy(name, device="cpu")
    return model, tok, {}


TRL_ORDER = ("stock", "none", "clip_v", "clip_v", "none", "stock")  # A-B-C-C-B-A: a drift lands on all alike


def run_trl(a, model: str, trainer: str, out: Path) -> dict:
    """One trainer's run in a fresh subprocess: its JSON line (``steps`` includes the warm-up step) or
    ``{"error": the output's last lines}``."""
    cmd = [sys.executable, "-m", SCRIPT, "--child", trainer, "--model", model, "--out", str(out), "--device", a.device,
           *sum(([f"--{k.replace('_', '-')}", str(getattr(a, k))] for k in
                 ("trl_steps", "trl_batch", "trl_group", "trl_tokens")), [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.child_timeout, cwd=ROOT)
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

