"""ClipV in your TRL script: your model, your dataset, your reward; one line changes (docs/trl_your_script.md).

A plain TRL GRPO script. The dataset and the reward are the script's own (no erft task): prompts "abc>TT:"
from 64 random digit triples, reward 1 when the completion is an arithmetic expression equal to the target,
0.1 when it at least parses, else 0. The only erft line is the trainer:

    trainer = GRPOTrainer(...)                                          # stock TRL
    trainer = EntropyControlGRPOTrainer(..., method="clip_v", ...)      # ClipV, S*, S_c and the covariances logged

    python examples/trl_your_reward.py --out runs/mine                      # erft's built-in policy, ClipV
    python examples/trl_your_reward.py --out runs/stock --trainer stock     # the same run on stock GRPOTrainer
    python examples/trl_your_reward.py --out runs/none --method none        # erft with no method: trains as stock
    python examples/trl_your_reward.py --model /models/qwen2.5-1.5b --out runs/q --report-to tensorboard

It prints TRL's log line per step (`entropy`, `clip_ratio/*`, `grad_norm` and erft's `dynamics/*`,
`control/*`); with --report-to tensorboard (or wandb) the same keys go to <out>/runs (or your W&B project).
"""

from __future__ import annotations

import argparse
import ast
import json
import random

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from entropy_rft.integrations.trl import EntropyControlGRPOTrainer
from entropy_rft.training.policies import resolve_policy


def my_dataset(n: int = 64, seed: int = 0) -> Dataset:
    """Your data: any ``datasets.Dataset`` with a ``prompt`` column; extra columns reach the reward function."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:  # a target reachable with + - * from the three digits, in 1..99
        a, b, c = (rng.randint(1, 9) for _ in range(3))
        t = eval(f"{a}{rng.choice('+-*')}{b}{rng.choice('+-*')}{c}")  # digits and operators only
        if 1 <= t <= 99:
            rows.append((a, b, c, t))
    return Dataset.from_dict({"prompt": [f"{a}{b}{c}>{t:02d}:" for a, b, c, t in rows],
                              "target": [t for *_, t in rows]})


def _value(node: ast.AST) -> float:
    """The value of an expression made of integers, + - * / and brackets; anything else raises ValueError."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ValueError("division by zero")
            return a / b
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    raise ValueError("not an arithmetic expression")


def my_reward(completions: list[str], target: list[int], **_kw) -> list[float]:
    """Your reward, as TRL calls it: the completions and the dataset's other columns (here ``target``)."""
    out = []
    for text, t in zip(completions, target):
        try:
            value = _value(ast.parse(text.strip(), mode="eval"))
        except (SyntaxError, ValueError, RecursionError):
            out.append(0.0)
            continue
        out.append(1.0 if abs(value - t) < 1e-9 else 0.1)
    return out


class PrintLogs(TrainerCallback):
    """One line "log {json}" per logged step (what TensorBoard/W&B would show), for scripts and tests to read."""

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "train_runtime" not in logs:
            print("log " + json.dumps({"step": state.global_step, **logs}), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="policy folder or hub id; 'default': erft's built-in "
                                                      "Countdown policy (built and cached on first use)")
    p.add_argument("--out", required=True, help="TRL output_dir")
    p.add_argument("--trainer", choices=("erft", "stock"), default="erft",
                   help="erft: EntropyControlGRPOTrainer; stock: trl.GRPOTrainer")
    p.add_argument("--method", default="clip_v", help="an erft method (`erft methods`); none = stock training")
    p.add_argument("--method-params", default="{}", help='JSON, e.g. \'{"mu": 2.0, "max_frac": null}\'')
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=12)
    p.add_argument("--no-bf16", action="store_true", help="fp32 (GRPOConfig's default is bf16 autocast)")
    p.add_argument("--report-to", default="none", help="TRL's report_to: none, tensorboard, wandb, ...")
    args = p.parse_args(argv)

    folder = resolve_policy(args.model) if args.model == "default" else args.model
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    config = GRPOConfig(
        output_dir=args.out, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=args.max_completion_length, loss_type="dapo", beta=0.0, learning_rate=2e-4,
        seed=0, max_steps=args.max_steps, use_cpu=not torch.cuda.is_available(), bf16=not args.no_bf16, logging_steps=1,
        report_to=args.report_to, save_strategy="no", disable_tqdm=True,
    )
    common = dict(model=model, reward_funcs=my_reward, args=config, train_dataset=my_dataset(),
                  processing_class=tok, callbacks=[PrintLogs()])
    if args.trainer == "stock":
        trainer = GRPOTrainer(**common)
    else:  # the one line that changes
        trainer = EntropyControlGRPOTrainer(**common, method=args.method,
                                            method_params=json.loads(args.method_params))
    trainer.train()


if __name__ == "__main__":
    main()
