"""Issue 27's GPU figures for the sampler and the precision, side by side in one run (CUDA, or the CPU to smoke).

    python -m benchmarks.gpu.sampler [--device cuda|cpu] [--quick] [--json FILE]

1. Sampler: SmolLM2-135M in bfloat16, 64 rows (8 prompts x 8, a GRPO batch) x 128 new tokens, EOS never ending
   a row early (every method generates all 128 tokens, so all do the same work):
   - ``static``: today's static decoder (``rollout.sample_static``, eager: one host read per token);
   - ``graph``: the same decoder through ``graph_decode`` with ``cuda_graphs=True`` (CUDA-graph replays, ``done``
     read every 8 steps);
   - ``hf``: transformers' ``generate`` with a static cache (``cache_implementation="static"``) and its own
     ``torch.compile`` of the forward (``CompileConfig(fullgraph=True, mode="reduce-overhead")``: CUDA graphs too).
   Median wall time over rounds after a warm-up (compilation and graph capture are in the warm-up; the graph
   path captures again on every call, and that is timed). Targets: graph >= 3x faster than static, and no
   slower than hf. ``graph`` must draw the same tokens as ``static`` from the same generator (reported).
   A second pair, ``static-eos`` / ``graph-eos``, lets rows end at EOS (as in training: compaction and the
   ``done`` checks at work).
2. Update norm (item 2): one batch sampled from SmolLM2, fixed advantages (+-1 per row), the token-mean
   policy-gradient surrogate, AdamW at lr 2e-5, ``--steps`` steps from the same weights under three precisions:
   float32; float32 master weights with bf16 autocast (``model.autocast_bf16``); bf16 weights
   (``model.dtype=bfloat16``). Per step ||theta_after - theta_before|| (float64). Target: the autocast run's
   within 5% of float32's at every step. The bf16-weights run shows what rounding loses.

``--device cpu --quick`` is a smoke run: the micro policy (``entropy_rft.models.micro``), 8 rows x 16 tokens, no
torch.compile (generate with a static cache only), 2 update steps. On CPU the graph row runs the same loop
eagerly (no CUDA graph).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

PROMPTS = ["Find the greatest common divisor of 12 and 18.", "What is 7 * 8?", "Count the letters in 'banana'.",
           "Solve 15 + 27.", "What is the gcd of 9 and 6?", "Compute 100 - 37.", "What is 3 * 14?",
           "Find the gcd of 20 and 8."]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, rounds: int) -> tuple[float, object]:
    fn()  # warm-up: compilation, graph capture, allocator
    times, out = [], None
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def load(model_name: str, device: str, dtype: torch.dtype):
    from entropy_rft.training.policies import load_policy

    model, tok = load_policy(model_name, device=device, dtype=dtype)
    return model.eval(), tok


def sampler_bench(model, tok, *, rows: int, new_tokens: int, rounds: int, compile_hf: bool, hf: bool = True) -> dict:
    from entropy_rft.policy.rollout import sample_static, tokenize_prompts

    device = next(model.parameters()).device
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(rows // 8 or 1) for _ in range(min(8, rows))][:rows]
    ids, mask = tokenize_prompts(tok, prompts, device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: dict = {"rows": rows, "new_tokens": new_tokens, "prompt_width": ids.shape[1]}

    def ours(graph: bool, eos: int):
        gen = torch.Generator(device=device).manual_seed(0)
        return sample_static(model, ids, mask, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, eos_id=eos,
                             pad_id=pad, generator=gen, cuda_graphs=graph, check_every=8)

    for name, graph, eos in (("static", False, -1), ("graph", True, -1), ("static-eos", False, tok.eos_token_id),
                             ("graph-eos", True, tok.eos_token_id)):
        t, res = _timed(lambda g=graph, e=eos: ours(g, e), device, rounds)
        out[name] = {"s": t, "tokens": int(res[1].sum()), "tok_per_s": int(res[1].sum()) / t, "ids": res[0]}
    for a, b in (("static", "graph"), ("static-eos", "graph-eos")):
        out[f"{b}_same_tokens"] = bool(torch.equal(out[a].pop("ids"), out[b].pop("ids")))

    # generate compiles the forward itself when the cache is static and the device is CUDA (its compile_config:
    # fullgraph, mode reduce-overhead); it is passed explicitly so that the row says what ran.
    extra: dict = {}
    if not hf:  # the lease's check: the two samplers only (HF's compile warm-up takes minutes)
        out["hf"] = {"error": "not run (--no-hf)"}
        s, g = out["static"]["s"], out["graph"]["s"]
        out.update(graph_speedup_vs_static=s / g, graph_vs_hf=None, pass_3x=s / g >= 3.0, pass_vs_hf=None)
        return out
    if compile_hf:
        from transformers import CompileConfig

        extra["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
    try:
        def hf():
            torch.manual_seed(0)
            return model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=pad, cache_implementation="static", **extra)
        t, res = _timed(hf, device, rounds)
        out["hf"] = {"s": t, "tokens": rows * new_tokens, "tok_per_s": rows * new_tokens / t,
                     "compiled": compile_hf, "shape": list(res.shape)}
    except Exception as e:  # reported, not fatal: the other figures stand
        out["hf"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    s, g, h = out["static"]["s"], out["graph"]["s"], out["hf"].get("s")
    out["graph_speedup_vs_static"] = s / g
    out["graph_vs_hf"] = h / g if h else None  # > 1: graph faster
    out["pass_3x"] = s / g >= 3.0
    out["pass_vs_hf"] = h is not None and g <= h
    return out


def update_norms(model_name: str, device: str, *, steps: int, lr: float, rows: int, new_tokens: int) -> dict:
    """Per-step parameter-update norms under float32, float32 + bf16 autocast, and bf16 weights (same batch)."""
    from entropy_rft.policy.forward import policy_forward
    from entropy_rft.policy.rollout import sample

    base, tok = load(model_name, device, torch.float32)
    gen = torch.Generator(device=device).manual_seed(1)
    prompts = [PROMPTS[i // 8 % len(PROMPTS)] for i in range(rows)]
    batch = sample(base, tok, prompts, max_new_tokens=new_tokens, temperature=1.0, generator=gen)
    adv = torch.where(torch.arange(rows, device=device) % 2 == 0, 1.0, -1.0)[:, None]
    start = {k: v.detach().clone() for k, v in base.state_dict().items()}
    runs: dict = {}
    for name, dtype, autocast in (("float32", torch.float32, False), ("fp32_master_bf16_autocast", torch.float32, True),
                                  ("bf16_weights", torch.bfloat16, False)):
        model, _ = load(model_name, device, dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in start.items()})
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        norms = []
        for _ in range(steps):
            before = [p.detach().double().clone() for p in params]
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
                logp = policy_forward(model, batch, 1.0).logp
            m = batch.response_mask.float()
            loss = -(adv * logp.float() * m).sum() / m.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            norms.append(float(sum(((p.detach().double() - b) ** 2).sum() for p, b in zip(params, before)) ** 0.5))
        runs[name] = norms
        del model, opt
    ref = runs["float32"]
    ratios = {k: [v / r if r else float("nan") for v, r in zip(vals, ref)] for k, vals in runs.items()}
    ok = all(abs(x - 1) <= 0.05 for x in ratios["fp32_master_bf16_autocast"])
    return {"lr": lr, "steps": steps, "response_tokens": int(batch.response_mask.sum()), "norms": runs,
            "ratio_to_float32": ratios, "pass_within_5pct": ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="Smoke sizes (with --device cpu: the micro test policy).")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="Update-norm steps (default 5; quick: 2).")
    p.add_argument("--json", help="Write the figures here.")
    p.add_argument("--no-hf", action="store_true", help="Leave out HF generate (its torch.compile warm-up takes "
                   "minutes): the static and graph samplers and the update norms only, as the realm lease's first "
                   "call 2 runs it.")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gpu_sampler: --device cuda but no CUDA GPU here; pass --device cpu --quick for a smoke run",
              file=sys.stderr)
        return 2
    tmp = tempfile.TemporaryDirectory()
    if a.quick and not cuda:
        from entropy_rft.models.micro import make_micro_policy

        model_name = str(make_micro_policy(Path(tmp.name) / "micro"))
        rows, new_tokens, lr = 8, 16, 1e-3
    else:
        model_name = "smollm2-135m"
        rows, new_tokens, lr = (16, 32, 2e-5) if a.quick else (64, 128, 2e-5)
    rounds = a.rounds or (1 if a.quick else 5)
    steps = a.steps or (2 if a.quick else 5)
    dev = torch.device(a.device)
    env = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "model": "micro" if "micro" in model_name else model_name}
    print(f"device: {env['device']}, torch {env['torch']}, model {env['model']}", flush=True)
    model, tok = load(model_name, a.device, torch.bfloat16)
    samp = sampler_bench(model, tok, rows=rows, new_tokens=new_tokens, rounds=rounds, compile_hf=cuda, hf=not a.no_hf)
    del model
    print(f"\nsampler, {rows} rows x {new_tokens} new tokens, bf16 weights, median of {rounds}:")
    print("| method | s | tokens | tokens/s |\n|---|---|---|---|")
    for name in ("static", "graph", "hf", "static-eos", "graph-eos"):
        r = samp[name]
        if "error" in r:
            print(f"| {name} | error: {r['error']} | | |")
        else:
            print(f"| {name} | {r['s']:.3f} | {r['tokens']} | {r['tok_per_s']:.0f} |")
    hf_ratio = f"{samp['graph_vs_hf']:.2f}x" if samp["graph_vs_hf"] else "n/a"
    print(f"graph vs static: {samp['graph_speedup_vs_static']:.2f}x (target >= 3x: "
          f"{'PASS' if samp['pass_3x'] else 'MISS'}); graph vs hf: {hf_ratio} (target >= 1: "
          f"{'n/a' if samp['pass_vs_hf'] is None else 'PASS' if samp['pass_vs_hf'] else 'MISS'}); "
          f"same tokens as static: {samp['graph_same_tokens']} "
          f"(with EOS: {samp['graph-eos_same_tokens']})")
    upd = update_norms(model_name, a.device, steps=steps, lr=lr, rows=rows, new_tokens=min(new_tokens, 32))
    print(f"\nparameter-update norm per step, lr {lr:g}, {upd['response_tokens']} response tokens, same batch:")
    print("| precision | " + " | ".join(f"step {i + 1}" for i in range(steps)) + " |")
    print("|---|" + "---|" * steps)
    for k, vals in upd["norms"].items():
        rat = upd["ratio_to_float32"][k]
        print(f"| {k} | " + " | ".join(f"{v:.3g} ({r:.3f}x)" for v, r in zip(vals, rat)) + " |")
    print(f"fp32 master + bf16 autocast within 5% of float32 at every step: "
          f"{'PASS' if upd['pass_within_5pct'] else 'MISS'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"environment": env, "sampler": samp, "update_norm": upd}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
