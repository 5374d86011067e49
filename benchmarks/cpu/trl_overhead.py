"""TRL integration overhead, measured side by side in one run (CPU, one process, ``--threads`` threads, default 1).

1. Step time: stock ``trl.GRPOTrainer`` vs ``EntropyControlGRPOTrainer`` with ``none`` and with ClipV, on the
   same tiny model and settings (target: ClipV / stock <= 1.05).
2. Peak memory of one old-policy pass: the plug-in's (TRL's fused head, plus the full TokenStats from the same
   backbone pass: ``stats_forward.captured_hidden`` + ``stats_from_hidden``) vs TRL's fused head alone with
   ``("log_probs", "entropy")``, each in a fresh subprocess (peak RSS
   above the process's baseline), on a wider model (vocab 32k) so that logits would dominate.
3. Our native trainer's steps/s vs stock ``GRPOTrainer`` (issue C's ">= 2x TRL" target), 16 prompts x 8
   samples, max 12 new tokens, one optimizer update per rollout batch for both, lr 2e-4: on the micro test
   policy (overhead-bound) and on the built-in default policy with Countdown (the feasibility study's
   settings; built on first use).

4. ``--smollm2``: the plug-in's cost on SmolLM2-135M-Instruct (issue 35, item 7) instead of 1-3: stock
   ``GRPOTrainer`` against the plug-in with ``none``, ``none`` with ``dynamics_metrics=False`` and ``clip_v``,
   4 prompts x 4 samples of ``rg:products``, up to 32 new tokens, interleaved rounds.

Usage: ``.venv/bin/python -m benchmarks.cpu.trl_overhead [--steps 6] [--rounds 2] [--skip-default] [--smollm2]``.
Prints a ratio table.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]

import torch  # noqa: E402

PROMPTS, GROUP, NEW_TOKENS, LR = 16, 8, 12, 2e-4


class Setup:
    """A policy, its task and the reward TRL sees, for one comparison."""

    def __init__(self, name: str, policy: str, task: str, prompts: int = PROMPTS, group: int = GROUP,
                 new_tokens: int = NEW_TOKENS, **task_params):
        from entropy_rft.tasks import build_task

        self.name, self.policy, self.task_name = name, policy, task
        self.prompts, self.group, self.new_tokens = prompts, group, new_tokens
        self.task = build_task(task, **task_params)
        self.train, _ = self.task.split(0)

    def dataset(self):
        from datasets import Dataset

        return Dataset.from_dict({"prompt": [str(ex.prompt) for ex in self.train],
                                  "idx": list(range(len(self.train)))})

    def reward(self, prompts, completions, idx, **_kw):
        return [float(self.task.reward(c, self.train[i])) for c, i in zip(completions, idx)]


def trl_step_times(setup: Setup, out: Path, steps: int, method: str | None, **trainer_kw) -> list[float]:
    """Per-optimizer-step wall times of stock GRPOTrainer (method None) or ours (``trainer_kw``: e.g.
    ``dynamics_metrics=False``), first step excluded."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer
    from entropy_rft.training.policies import load_policy

    model, tok = load_policy(setup.policy)
    if setup.policy in ("default", "smollm2-135m"):  # TRL rebuilds its reference from config._name_or_path
        from entropy_rft.training.policies import resolve_policy

        model.config._name_or_path = str(resolve_policy(setup.policy))
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False,
                      per_device_train_batch_size=setup.prompts * setup.group, num_generations=setup.group,
                      max_completion_length=setup.new_tokens, max_steps=steps, report_to=[],
                      save_strategy="no", disable_tqdm=True, logging_steps=10_000, seed=0, learning_rate=LR)
    kw = dict(model=model, reward_funcs=setup.reward, args=args, train_dataset=setup.dataset(), processing_class=tok)
    if method is None:
        trainer = GRPOTrainer(**kw)
    else:
        params = {"mu": 2.0, "max_frac": None} if method == "clip_v" else {}
        trainer = EntropyControlGRPOTrainer(**kw, method=method, method_params=params, **trainer_kw)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_train_end(self, *a, **k):
            stamps.append(time.perf_counter())

    trainer.add_callback(Stamp())
    trainer.train()
    return [b - a for a, b in zip(stamps[1:-1], stamps[2:])]


def native_step_times(setup: Setup, out: Path, steps: int) -> list[float]:
    """Per-step wall times of ``erft``'s own trainer (method none, its per-step probe on) on the same settings,
    first step excluded. The JVP and counterfactual probes run every 10th step by default; they are off here
    and cost extra on those steps (see step_time.py)."""
    from entropy_rft.config.loading import load_config
    from entropy_rft.training.trainer import train

    sets = {"model.name": setup.policy, "task.name": setup.task_name, "method.name": "none",
            "rollout.prompts_per_step": PROMPTS, "rollout.group_size": GROUP, "rollout.max_new_tokens": NEW_TOKENS,
            "algo.minibatches": 1, "eval.every": 0, "train.max_steps": steps, "train.checkpoint_every": steps,
            "train.tensorboard": "false", "train.progress": "false", "train.threads": torch.get_num_threads(),
            "optim.lr": LR,
            "probe.jvp_every": 0, "probe.counterfactual_every": 0}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    stamps: list[float] = [time.perf_counter()]
    train(cfg, out, on_step=lambda run, row: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps[1:-1], stamps[2:])]


_MEM_CHILD = r"""
import os, resource, sys, json, torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
which = sys.argv[1]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4)
model = LlamaForCausalLM(cfg).eval()
B, P, C = 64, 16, 64
ids = torch.randint(0, 32000, (B, P + C)); am = torch.ones_like(ids)
from trl.trainer.utils import add_fused_lm_head
add_fused_lm_head(model, outputs=("log_probs", "entropy"))
labels = ids.clone(); labels[:, :P] = -100
trl_pass = lambda: model(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
if which == "trl":
    run = trl_pass
else:
    from entropy_rft.integrations.stats_forward import captured_hidden, stats_from_hidden
    def run():
        with captured_hidden(model) as hs:
            trl_pass()
        return stats_from_hidden(model, torch.cat(hs), ids, C, 1.0)
with torch.no_grad():
    hidden = model.base_model(input_ids=ids, attention_mask=am).last_hidden_state  # warm the backbone
    del hidden
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_above_base_mib": (peak - base) / 1024}))
"""


def peak_memory(which: str) -> float:
    res = subprocess.run([sys.executable, "-c", _MEM_CHILD, which], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_above_base_mib"]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def print_ratios(med: dict[str, float], rows, width: int = 34, steps_per_s: bool = True) -> None:
    """One line per (key, label): s/step, optionally steps/s, and the ratio to stock TRL's."""
    print(f"{'engine':<{width}}{'s/step':>10}" + (f"{'steps/s':>10}" if steps_per_s else "") + f"{'ratio vs TRL':>14}")
    for k, label in rows:
        print(f"{label:<{width}}{med[k]:>10.3f}" + (f"{1 / med[k]:>10.2f}" if steps_per_s else "")
              + f"{med[k] / med['trl']:>14.3f}")


def _interleaved(engines: dict, rounds: int, tmp: Path) -> dict[str, float]:
    """Median step time per engine, the engines run in turn ``rounds`` times (machine noise spread over all)."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in engines.items():
            out = Path(tempfile.mkdtemp(dir=tmp))
            times.setdefault(name, []).extend(fn(out / "run"))
    return {k: _median(v) for k, v in times.items()}


def main() -> None:
    from entropy_rft.models.micro import make_micro_policy

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="steps per engine and round (the first is excluded)")
    p.add_argument("--rounds", type=int, default=2, help="times each engine runs, interleaved")
    p.add_argument("--threads", type=int, default=1, help="torch threads for every engine")
    p.add_argument("--smollm2", action="store_true",
                   help="only the plug-in's cost on SmolLM2-135M-Instruct (stock, none, none without dynamics "
                        "metrics, clip_v)")
    p.add_argument("--skip-default", action="store_true",
                   help="skip the comparison on the built-in default policy (built on first use, ~2 min)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if a.smollm2:
        return smollm2_cost(a)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        micro = Setup("micro", str(make_micro_policy(tmp / "policy")), "entropy_rft.tasks.digits:DigitTask")
        med = _interleaved({
            "trl": lambda o: trl_step_times(micro, o, a.steps, None),
            "erft_none": lambda o: trl_step_times(micro, o, a.steps, "none"),
            "erft_clip_v": lambda o: trl_step_times(micro, o, a.steps, "clip_v"),
            "native": lambda o: native_step_times(micro, o, a.steps)}, a.rounds, tmp)
        study = None
        if not a.skip_default:
            default = Setup("default", "default", "countdown")
            study = _interleaved({"trl": lambda o: trl_step_times(default, o, a.steps, None),
                                  "native": lambda o: native_step_times(default, o, a.steps)}, a.rounds, tmp)
        mem = {w: peak_memory(w) for w in ("trl", "erft")}
    n = (a.steps - 1) * a.rounds
    print(f"\nmicro policy (d 32, 1 layer): step time, median of {n} steps each (16 prompts x 8 samples, "
          f"<=12 new tokens, one update per batch, 1 process, {a.threads} thread(s))")
    print_ratios(med, (("trl", "TRL GRPOTrainer (stock)"), ("erft_none", "EntropyControlGRPOTrainer none"),
                       ("erft_clip_v", "EntropyControlGRPOTrainer clip_v"), ("native", "erft native trainer")))
    print(f"\nClipV overhead (time ratio clip_v / stock TRL): {med['erft_clip_v'] / med['trl']:.3f}  (target <= 1.05)")
    print(f"native speed-up, micro policy (steps/s native / stock TRL): {med['trl'] / med['native']:.2f}x  "
          "(issue C target >= 2x)")
    if study is not None:
        print(f"\nbuilt-in default policy (1.33M params, Countdown; the feasibility study's settings), median of {n}")
        print(f"  TRL GRPOTrainer (stock) {study['trl']:.3f} s/step, erft native {study['native']:.3f} s/step: "
              f"speed-up {study['trl'] / study['native']:.2f}x  (issue C target >= 2x)")
    print("\npeak RSS above baseline, one old-policy pass, 64 x 64 tokens, vocab 32000 (logits would be 500 MiB)")
    print(f"  TRL fused head (log p, entropy): {mem['trl']:8.1f} MiB")
    ratio = mem["erft"] / max(mem["trl"], 1e-9)
    print(f"  ours (log p + full TokenStats):  {mem['erft']:8.1f} MiB   ratio {ratio:.2f}")


def smollm2_cost(a: argparse.Namespace) -> None:
    """Issue 35, item 7: the plug-in's step time against stock GRPOTrainer on SmolLM2-135M-Instruct."""
    smol = Setup("smollm2", "smollm2-135m", "rg:products", prompts=4, group=4, new_tokens=32,
                 params={"max_digits": 1}, answer_format="number")
    with tempfile.TemporaryDirectory() as tmp:
        med = _interleaved({
            "trl": lambda o: trl_step_times(smol, o, a.steps, None),
            "erft_none": lambda o: trl_step_times(smol, o, a.steps, "none"),
            "erft_none_nodyn": lambda o: trl_step_times(smol, o, a.steps, "none", dynamics_metrics=False),
            "erft_clip_v": lambda o: trl_step_times(smol, o, a.steps, "clip_v")}, a.rounds, Path(tmp))
    n = (a.steps - 1) * a.rounds
    print(f"\nSmolLM2-135M-Instruct: step time, median of {n} steps each (4 prompts x 4 samples, <=32 new tokens, "
          f"fp32, one update per batch, 1 process, {a.threads} thread(s))")
    print_ratios(med, (("trl", "TRL GRPOTrainer (stock)"), ("erft_none", "plug-in none"),
                       ("erft_none_nodyn", "plug-in none, dynamics_metrics=False"),
                       ("erft_clip_v", "plug-in clip_v")), width=44, steps_per_s=False)
    print(json.dumps({"smollm2_step_s": med}))


if __name__ == "__main__":
    main()
