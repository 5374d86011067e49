"""Where two CPUs part under the pin: a hash per operation of the default job's maths, to compare across machines.

The pin (``entropy_rft.common.numerics``) promises the same bytes on every x86-64 CPU, and ``make run`` printed
the README's table to the last digit on two Intel Xeons and an AMD EPYC; on an AMD EPYC of family 26 (Zen 5) it
prints another table from another base policy (issue 77). A run's last digits are the end of a long chain, so this
script hashes the chain's links, each in isolation, in a pinned process on one thread (the build's thread count):

- ``gemm``: 150 random float32 matrix products (MKL's SGEMM), and ``bmm``: 40 batched ones;
- ``elementwise``: ATen's unary and softmax kernels on fixed inputs;
- ``random``: torch's generators (``randn``, ``rand``, ``multinomial``) and the default policy's initial weights;
- ``batch``: the SFT batch itself (token ids and labels: Python's generator and the tokenizer, no float maths), so
  that a difference in ``forward`` is the maths', not its input's;
- ``forward``: the output of every module of the default policy (recipe architecture, seed 0) on one SFT batch
  of the build, in call order, then the loss; ``backward``: every parameter's gradient; ``adamw``: the weights
  after one step of the build's optimizer;
- ``sft``: the build's first ``--sft-steps`` SFT steps (the recipe's settings, its loss after each) and the
  weights after them.

Every entry is a SHA-256 prefix of the float32 bytes. ``--compare OTHER.json`` names, per section, the first entry
that differs (the forward section is in call order, so its first difference is the first module that computes
differently) and exits 1 when any does. Run it on two machines and compare::

    .venv/bin/python -m benchmarks.cpu.numerics_probe --out /tmp/here.json
    .venv/bin/python -m benchmarks.cpu.numerics_probe --out /tmp/here.json \
        --compare benchmarks/results/cpu-numerics-amd-epyc-f26m2-2026-12-06.json

About 10 s on one core (``--sft-steps 20``).
"""

from __future__ import annotations

from entropy_rft.common.numerics import choose_mkl_branch, numerics_record, pin_cpu_numerics

pin_cpu_numerics()  # before torch loads (it is read then)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

SECTIONS = ("gemm", "bmm", "elementwise", "random", "batch", "forward", "backward", "adamw", "sft")


def digest(t: torch.Tensor | float) -> str:
    """A 16-hex SHA-256 prefix of a tensor's float32 bytes (or of a float's repr)."""
    if isinstance(t, torch.Tensor):
        return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]
    return hashlib.sha256(repr(float(t)).encode()).hexdigest()[:16]


def cpu_description() -> dict[str, Any]:
    """The CPU as /proc/cpuinfo names it (vendor, family, model, model name), and the machine."""
    fields = {"vendor_id": "vendor", "cpu family": "family", "model": "model", "model name": "model_name"}
    out: dict[str, Any] = {"machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in fields and fields[key.strip()] not in out:
            out[fields[key.strip()]] = value.strip()
        if not line.strip() and len(out) > 1:
            break
    return out


def gemm_section() -> tuple[dict[str, str], dict[str, str]]:
    g = torch.Generator().manual_seed(0)
    mm, bmm = {}, {}
    for i in range(150):
        m, k, n = (int(x) for x in torch.randint(1, 300, (3,), generator=g))
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        mm[f"{i:03d} {m}x{k}x{n}"] = digest(a @ b)
    for i in range(40):
        bsz, m, k, n = (int(x) for x in torch.randint(1, 64, (4,), generator=g))
        a, b = torch.randn(bsz, m, k, generator=g), torch.randn(bsz, k, n, generator=g)
        bmm[f"{i:02d} {bsz}x{m}x{k}x{n}"] = digest(torch.bmm(a, b))
    return mm, bmm


def elementwise_section() -> dict[str, str]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 257, generator=g) * 3
    pos = torch.rand(4096, 257, generator=g) + 1e-3
    ops = {
        "exp": lambda: x.exp(), "log": lambda: pos.log(), "sqrt": lambda: pos.sqrt(), "rsqrt": lambda: pos.rsqrt(),
        "cos": lambda: x.cos(), "sin": lambda: x.sin(), "tanh": lambda: x.tanh(), "sigmoid": lambda: x.sigmoid(),
        "silu": lambda: torch.nn.functional.silu(x), "pow": lambda: pos.pow(-0.5), "mean_sq": lambda: x.pow(2).mean(-1),
        "softmax": lambda: x.softmax(-1), "log_softmax": lambda: x.log_softmax(-1),
        "logsumexp": lambda: x.logsumexp(-1),
        "sum": lambda: x.sum(-1), "cumsum": lambda: x.cumsum(-1), "norm": lambda: torch.linalg.vector_norm(x),
        "cross_entropy": lambda: torch.nn.functional.cross_entropy(x, torch.arange(4096) % 257),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            x[:64, :192].reshape(1, 4, 16, 192), x[64:128, :192].reshape(1, 4, 16, 192),
            x[128:192, :192].reshape(1, 4, 16, 192), is_causal=True),
    }
    return {name: digest(fn()) for name, fn in ops.items()}


def random_section() -> dict[str, str]:
    from transformers import LlamaForCausalLM

    from entropy_rft.models.scratch import build_char_tokenizer, llama_config
    from entropy_rft.training.sft import DEFAULT_BUILD

    g = torch.Generator().manual_seed(2)
    out = {"randn": digest(torch.randn(10000, generator=g)), "rand": digest(torch.rand(10000, generator=g))}
    probs = torch.rand(64, 50, generator=g).softmax(-1)
    out["multinomial"] = digest(torch.multinomial(probs, 8, replacement=True, generator=g).float())
    torch.manual_seed(0)
    arch = {k: DEFAULT_BUILD[k] for k in ("d_model", "layers", "heads", "mlp")}
    model = LlamaForCausalLM(llama_config(build_char_tokenizer(), **arch))
    out.update({f"init {n}": digest(p) for n, p in model.named_parameters()})
    return out


def model_sections(sft_steps: int) -> dict[str, dict[str, str]]:
    """The build's first batch, forward/backward/adamw on it, then ``sft_steps`` SFT steps of the recipe."""
    from transformers import LlamaForCausalLM

    from entropy_rft.models.scratch import build_char_tokenizer, llama_config
    from entropy_rft.tasks.countdown import CountdownTask
    from entropy_rft.training.sft import DEFAULT_BUILD, encode_sft_batch, sft_sample, train_sft

    arch = {k: DEFAULT_BUILD[k] for k in ("d_model", "layers", "heads", "mlp")}
    tokenizer, task = build_char_tokenizer(), CountdownTask()

    def fresh() -> LlamaForCausalLM:
        torch.manual_seed(0)
        return LlamaForCausalLM(llama_config(tokenizer, **arch))

    model = fresh()
    rng = random.Random(0)
    pairs = task.sft_pairs()
    batch = [rng.choice(pairs) for _ in range(DEFAULT_BUILD["batch_size"])]
    prompts = [f"{''.join(map(str, d))}>{t:02d}:" for d, t in batch]
    responses = [sft_sample(d, t, rng, DEFAULT_BUILD["p_correct"]) for d, t in batch]
    ids, labels = encode_sft_batch(tokenizer, prompts, responses)
    forward: dict[str, str] = {}
    order = [0]

    def hook(name: str):
        def record(_module: Any, _inp: Any, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
            if isinstance(t, torch.Tensor):
                forward[f"{order[0]:03d} {name or 'model'}"] = digest(t)
                order[0] += 1
        return record

    batch = {"input ids": digest(ids.float()), "labels": digest(labels.float()), "shape": "x".join(map(str, ids.shape))}
    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    for h in handles:
        h.remove()
    forward["loss"] = digest(loss)
    loss.backward()
    backward = {n: digest(p.grad) for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    backward["after clip_grad_norm"] = digest(torch.cat([p.grad.flatten() for p in model.parameters()]))
    opt = torch.optim.AdamW(model.parameters(), lr=DEFAULT_BUILD["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    opt.step()
    adamw = {n: digest(p) for n, p in model.named_parameters()}

    model = fresh()
    recipe = {k: DEFAULT_BUILD[k] for k in ("batch_size", "lr", "warmup", "p_correct")}
    losses = train_sft(model, tokenizer, task, seed=0, steps=sft_steps, progress=False, **recipe)
    sft = {f"loss {i:03d}": digest(v) for i, v in enumerate(losses)}
    sft["weights"] = digest(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return {"batch": batch, "forward": forward, "backward": backward, "adamw": adamw, "sft": sft}


def probe(sft_steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # the build's thread count for the default policy (threads.choose_threads)
    choose_mkl_branch(exact=True)  # before the first matrix multiply: MKL's COMPATIBLE branch
    mm, bmm = gemm_section()
    sections = {"gemm": mm, "bmm": bmm, "elementwise": elementwise_section(), "random": random_section(),
                **model_sections(sft_steps)}
    libraries = [line.strip() for line in torch.__config__.show().splitlines()
                 if any(w in line for w in ("Math Kernel", "MKL-DNN", "oneDNN", "CPU capability"))]
    return {"cpu": cpu_description(), "torch": torch.__version__, "libraries": libraries,
            "cpu_numerics": numerics_record(),
            "sft_steps": sft_steps, "sections": sections}


def compare(here: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """One line per section: the number of entries that differ and the first one (in the section's order)."""
    lines = []
    for name in SECTIONS:
        a, b = here["sections"].get(name, {}), other["sections"].get(name, {})
        keys = [k for k in a if k in b]
        differ = [k for k in keys if a[k] != b[k]]
        missing = len(set(a) ^ set(b))
        words = f"{len(differ)} of {len(keys)} differ" + (f", first: {differ[0]}" if differ else "")
        lines.append(f"  {name:<12} {words}" + (f" ({missing} entries in one file only)" if missing else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write this machine's hashes (JSON)")
    ap.add_argument("--compare", type=Path, help="another machine's JSON: name the first difference per section")
    ap.add_argument("--sft-steps", type=int, default=20, help="SFT steps of the build's recipe to hash (default 20)")
    args = ap.parse_args(argv)
    if args.sft_steps < 1:
        ap.error("--sft-steps must be at least 1")
    other = None
    if args.compare is not None:
        try:
            other = json.loads(args.compare.read_text())
            other["sections"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"--compare {args.compare}: not a numerics probe's JSON ({e})", file=sys.stderr)
            return 2
    rec = probe(args.sft_steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    cpu = rec["cpu"]
    print(f"{cpu.get('model_name', '?')} (family {cpu.get('family', '?')} model {cpu.get('model', '?')}), "
          f"pinned: {rec['cpu_numerics']['pinned']}, written to {args.out}")
    if other is None:
        return 0
    if other.get("sft_steps") != rec["sft_steps"]:
        print(f"note: {args.compare} hashed {other.get('sft_steps')} SFT steps, this run {rec['sft_steps']}")
    ocpu = other.get("cpu", {})
    print(f"against {ocpu.get('model_name', '?')} (family {ocpu.get('family', '?')} model {ocpu.get('model', '?')}):")
    lines = compare(rec, other)
    print("\n".join(lines))
    return 1 if any(" 0 of " not in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
