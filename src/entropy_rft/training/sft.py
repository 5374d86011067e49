"""The built-in base policy: a small Llama trained from scratch by SFT on Countdown, plus a quick eval.

Recipe (``RECIPE_VERSION`` names it in the cache folder; change the version when the recipe changes):

- task: :class:`~entropy_rft.tasks.countdown.CountdownTask`; SFT pairs come only from outside the
  validation pool, so validation numbers are clean for every split seed;
- target text per sample: with probability ``p_correct`` (0.4) a uniformly drawn correct expression,
  otherwise a uniformly drawn expression over the prompt's digits (usually wrong), so the base policy is
  imperfect on purpose and keeps entropy for RL to act on;
- model: Llama, hidden 192, 3 layers, 4 heads, MLP 512, tied embeddings (1.33M parameters), over the
  21-token character tokenizer of :func:`entropy_rft.models.loading.build_char_tokenizer`;
- AdamW (lr 2e-3, betas 0.9/0.95, no weight decay), 20 warmup steps then cosine to 10%, batch 256,
  690 steps, loss on the response and EOS only.

Everything is seeded from ``seed`` (model init via ``torch.manual_seed``, data via ``random.Random``),
so a build is deterministic per seed on CPU for a given thread count and instruction set: the build runs at
the training rule's thread count (1 here), and the cache folder without a suffix holds only builds made under
the CPU pin (:mod:`entropy_rft.common.numerics`: ATen's AVX2 paths and MKL's COMPATIBLE branch, the same on every
x86-64 CPU with AVX2, Intel or AMD, which ``erft`` sets); a build computed otherwise (torch imported before the
pin, ``ERFT_CPU_PIN=0``, a ``MKL_CBWR`` of the user's, aarch64) lands in a folder named after its instruction
set and MKL branch (``...-seed0-native-avx512-mkloff``), and every build records what it ran with
(``cpu_numerics`` in ``erft_build.json``). v3 is v2 under the pin (v2 was built with the machine's own
instruction set, and its bytes followed the CPU); v4 is v3 under the pin's MKL COMPATIBLE branch (v3's
``MKL_CBWR=AVX2`` ran Intel's AVX2 code on Intel CPUs and MKL's AUTO path on AMD ones: two builds).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from entropy_rft.common.numerics import isa_tag, numerics_record
from entropy_rft.common.threads import apply_threads
from entropy_rft.models.cache import write_progress
from entropy_rft.models.files import DEFAULT_NAME, STRONG_NAME
from entropy_rft.models.loading import (
    build_char_tokenizer,
    cached_build,
    count_parameters,
    llama_config,
    models_dir,
    save_policy,
    write_build_info,
)
from entropy_rft.policy.evaluation import evaluate_policy
from entropy_rft.tasks.base import Example, Task
from entropy_rft.tasks.countdown import CountdownTask, expressions, values
from entropy_rft.training.shipped import install, shipped_folder

RECIPE_VERSION = "v4"
PROGRESS_EVERY = 10  # SFT steps between the build's progress records (models.cache.write_progress)

#: The default build parameters: feasibility.md's study settings, except batch 128 and p_correct 0.5.
#: v1 (batch 256, p_correct 0.4) took ~5.2 min on an idle 2-core machine (~0.45 s/step, compute-bound)
#: and gave pass@1 0.069, pass@8 0.41; v2 halves the tokens and builds in ~2.1 min with pass@1 0.080,
#: pass@8 0.49, entropy 0.73 (validation, 256 prompts x 8 samples, T=1), within the 3-minute budget.
DEFAULT_BUILD: dict[str, Any] = {
    "steps": 690,
    "batch_size": 128,
    "lr": 2e-3,
    "warmup": 20,
    "d_model": 192,
    "layers": 3,
    "heads": 4,
    "mlp": 512,
    "p_correct": 0.5,
    "eval_prompts": 256,
    "eval_samples": 8,
}

#: The built-in SFT policies by ``--model`` name: their overrides of :data:`DEFAULT_BUILD`. ``default-strong`` is
#: the second regime (docs/results.md, "A second regime"): the same architecture, data and steps, every SFT
#: target a correct expression, so its base solves about 40% of the prompts.
BUILT_IN_RECIPES: dict[str, dict[str, Any]] = {
    DEFAULT_NAME: {},
    STRONG_NAME: {"p_correct": 1.0},
}


def default_policy_dir(cache_dir: str | os.PathLike | None = None, *, seed: int = 0, isa: str | None = None,
                       **params: Any) -> Path:
    """The cache folder of the base policy built with ``seed`` and ``params`` (defaults omitted).

    ``countdown-llama-v4-seed0`` for the default recipe; a non-default parameter adds a short hash, and a build
    outside the CPU pin its instruction set (``isa``: ``numerics.isa_tag()``'s name part, this process's when
    None; ``""`` under the pin).
    """
    unknown = set(params) - set(DEFAULT_BUILD)
    if unknown:
        raise TypeError(f"unknown build parameters: {sorted(unknown)}; known: {sorted(DEFAULT_BUILD)}")
    changed = {k: v for k, v in params.items() if v != DEFAULT_BUILD[k]}
    name = f"countdown-llama-{RECIPE_VERSION}-seed{seed}"
    if changed:
        digest = hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]
        name += f"-{digest}"
    tag = isa_tag() if isa is None else isa
    return models_dir(cache_dir) / (f"{name}-{tag}" if tag else name)


# ----------------------------------------------------------------------------- data


def sft_sample(digits: tuple[int, ...], target: int, rng: random.Random, p_correct: float) -> str:
    """One SFT response: a correct expression with probability ``p_correct``, else a random one."""
    if rng.random() < p_correct:
        return rng.choice(values(digits)[target])
    return rng.choice(expressions(digits))


def encode_sft_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], responses: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` (``<bos> prompt response <eos>``) and ``labels`` (-100 off the response).

    Right padding needs no attention mask: with causal attention a pad only follows the real tokens.
    Characters are mapped straight through the vocabulary (the char tokenizer has one token per
    character), which is much faster than calling the tokenizer per sample.
    """
    vocab = tokenizer.get_vocab()
    unk = tokenizer.unk_token_id
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    rows, labels = [], []
    for p, r in zip(prompts, responses, strict=True):
        p_ids = [bos] + [vocab.get(c, unk) for c in p]
        r_ids = [vocab.get(c, unk) for c in r] + [eos]
        rows.append(p_ids + r_ids)
        labels.append([-100] * len(p_ids) + r_ids)
    width = max(len(x) for x in rows)
    ids = torch.tensor([x + [pad] * (width - len(x)) for x in rows])
    lab = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
    return ids, lab


def lr_factor(step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``floor`` (step counts from 0)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: CountdownTask,
    *,
    seed: int,
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    p_correct: float,
    progress: bool = True,
    on_step: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Fine-tune ``model`` on generated Countdown solutions; returns the per-step losses. ``on_step(step, steps,
    started)`` is told how far it is (at the start and every ``PROGRESS_EVERY`` steps; ``started``: the wall clock
    it began at); it reads nothing of the training, so no number moves."""
    rng = random.Random(seed)
    pairs = task.sft_pairs()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup))
    model.train()
    losses: list[float] = []
    console = Console(stderr=True)
    with _progress(console, progress) as bar:
        job = bar.add_task("SFT base policy", total=steps, loss="-")
        log_every = max(1, steps // 10) if progress and not console.is_terminal else 0
        if log_every:
            console.print(f"building the base policy: {steps} SFT steps (once: cached for every later run)")
        t0, started = time.perf_counter(), time.time()
        if on_step is not None:
            on_step(0, steps, started)
        for step in range(steps):
            batch = [rng.choice(pairs) for _ in range(batch_size)]
            prompts = [f"{''.join(map(str, d))}>{t:02d}:" for d, t in batch]
            responses = [sft_sample(d, t, rng, p_correct) for d, t in batch]
            ids, labels = encode_sft_batch(tokenizer, prompts, responses)
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(job, advance=1, loss=f"{losses[-1]:.3f}")
            if on_step is not None and ((step + 1) % PROGRESS_EVERY == 0 or step + 1 == steps):
                on_step(step + 1, steps, started)
            if log_every and (step + 1) % log_every == 0:  # no live bar without a terminal
                took = time.perf_counter() - t0
                rate = (step + 1) / took
                console.print(f"SFT step {step + 1}/{steps} loss {losses[-1]:.3f} {took:.0f}s, {rate:.1f} steps/s, "
                              f"about {(steps - step - 1) / rate / 60:.1f} min left")
    model.eval()
    return losses


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def quick_eval(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: Sequence[Example],
    *,
    n_samples: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    batch_size: int = 1024,
    seed: int | None = 0,
) -> dict[str, Any]:
    """Sample ``n_samples`` responses per example (``evaluation.evaluate_policy``, KV cache) and score them.

    Pure sampling (no top-k/top-p) at ``temperature``; ``temperature == 0`` means greedy. Sampling uses its
    own generator seeded with ``seed``, so the caller's random stream is untouched. Returns:

    - ``pass@1`` (mean accuracy) and ``pass@{n_samples}`` (unbiased estimator);
    - ``entropy``: token-mean entropy (nats) of the sampling distribution over generated tokens,
      EOS included, padding excluded;
    - ``distinct_correct``: mean number of distinct ``task.canonical`` forms among correct samples;
    - ``response_tokens``: mean generated length (EOS included); ``seconds``; ``samples`` (a few).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    m = evaluate_policy(model, tokenizer, task, list(examples), n_samples=n_samples, temperature=temperature,
                        max_new_tokens=max_new_tokens or getattr(task, "max_response_tokens", 64),
                        generator=gen, batch_size=batch_size, prefix="")
    return {
        "pass@1": m["pass@1"],
        f"pass@{n_samples}": m[f"pass@{n_samples}"],
        "entropy": m["entropy"],
        "distinct_correct": m["distinct_correct"],
        "response_tokens": m["response_tokens"],
        "n_prompts": len(examples),
        "n_samples": n_samples,
        "temperature": temperature,
        "seconds": round(m["seconds"], 2),
        "samples": m["samples"],
    }


# ----------------------------------------------------------------------------- the build


def recipe_name(settings: dict[str, Any], otherwise: str) -> str:
    """The built-in policy (``BUILT_IN_RECIPES``) whose recipe ``settings`` are, else ``otherwise``."""
    return next((n for n, r in BUILT_IN_RECIPES.items() if {**DEFAULT_BUILD, **r} == settings), otherwise)


def _build(out: Path, *, seed: int, progress: bool, settings: dict[str, Any],
           on_step: Callable[[int, int, float], None] | None = None) -> None:
    """Train the base policy with ``settings`` (every key of :data:`DEFAULT_BUILD`) into ``out``; ``on_step``:
    see ``train_sft``."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    task = CountdownTask()
    arch = {k: settings[k] for k in ("d_model", "layers", "heads", "mlp")}
    model = LlamaForCausalLM(llama_config(tokenizer, **arch))
    recipe = {k: settings[k] for k in ("steps", "batch_size", "lr", "warmup", "p_correct")}
    # The training rule for this model's size (threads.choose_threads, 1 thread for the default policy), not
    # the caller's setting: float sums depend on the thread count, and the cache must hold the same bytes
    # whoever builds it (a fresh `make run` built at torch's default 2 threads and printed other figures).
    caller_threads = torch.get_num_threads()
    build_threads = apply_threads(0, model)
    try:
        _train_and_save(out, model, tokenizer, task, seed=seed, progress=progress, settings=settings,
                        recipe=recipe, t0=t0, threads=build_threads, on_step=on_step)
    finally:
        torch.set_num_threads(caller_threads)


def _train_and_save(out: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: CountdownTask, *,
                    seed: int, progress: bool, settings: dict[str, Any], recipe: dict[str, Any], t0: float,
                    threads: int, on_step: Callable[[int, int, float], None] | None = None) -> None:
    """SFT, save, evaluate and record the build (``_build``'s body, at the build's thread count)."""
    losses = train_sft(model, tokenizer, task, seed=seed, progress=progress, on_step=on_step, **recipe)
    train_s = time.perf_counter() - t0
    save_policy(out, model, tokenizer)
    info: dict[str, Any] = {
        "name": recipe_name(settings, DEFAULT_NAME),
        "recipe": RECIPE_VERSION,
        "task": task.name,
        "seed": seed,
        "build": {k: v for k, v in settings.items() if not k.startswith("eval_")},
        "params": count_parameters(model),
        "train_seconds": round(train_s, 2),
        "final_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
        "threads": threads,
        "cpu_numerics": numerics_record(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pid": os.getpid(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    eval_prompts, eval_samples = settings["eval_prompts"], settings["eval_samples"]
    if eval_prompts > 0 and eval_samples > 0:
        _, val = task.split(0)
        metrics = quick_eval(model, tokenizer, task, val[:eval_prompts], n_samples=eval_samples, seed=seed)
        info["eval"] = {"split_seed": 0, **{k: v for k, v in metrics.items() if k != "samples"}}
    info["build_seconds"] = round(time.perf_counter() - t0, 2)
    write_build_info(out, info)


def build_default_policy(
    cache_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    progress: bool = True,
    **params: Any,
) -> Path:
    """Build (or reuse) the Countdown base policy; return its cached HF folder.

    ``params`` override :data:`DEFAULT_BUILD` (``steps``, ``batch_size``, ``lr``, ``warmup``,
    ``d_model``, ``layers``, ``heads``, ``mlp``, ``p_correct``, ``eval_prompts``, ``eval_samples``);
    any override gives its own cache folder. The build runs atomically under a file lock: concurrent
    callers build once and all get the finished folder.
    """
    folder = default_policy_dir(cache_dir, seed=seed, **params)
    settings = {**DEFAULT_BUILD, **params}
    shipped = shipped_folder(folder.name)  # the pinned default's bytes, shipped with the package (shipped.py)
    if shipped is not None:
        return cached_build(folder, lambda tmp: install(shipped, tmp))
    name = recipe_name(settings, folder.name)

    def on_step(step: int, steps: int, started: float) -> None:  # what `erft compare` shows while it waits
        write_progress(folder, f"the base policy {name}", step, steps, started)

    return cached_build(folder, lambda tmp: _build(tmp, seed=seed, progress=progress, settings=settings,
                                                   on_step=on_step))
