"""Micro fixtures for trainer tests: a random tiny Llama policy and a task whose reward varies under it.

The Countdown base policy takes minutes to build; the trainer's mechanics need only a policy whose
samples get different rewards, so advantages are non-zero.
"""

from __future__ import annotations

import random
from pathlib import Path

from entropy_rft.tasks.base import Example, Task

# The task is imported by name in every CLI process that trains on it (``micro:DigitTask``); the model builder's
# imports (torch, transformers: ~5 s a process) stay in the builder, so a refused run pays none of them.


class DigitTask(Task):
    """Prompt 'abc>TT:'; reward 1 when the response's first character is the prompt's first digit."""

    name = "digit"

    def split(self, seed: int):
        rng = random.Random(seed)
        exs = [Example(f"{a}{b}{c}>{t}:", str(a)) for a in range(1, 10) for b in range(1, 10) for c in (1, 5)
               for t in (7, 42)]
        rng.shuffle(exs)
        return exs[:200], exs[200:]

    def reward(self, response: str, example: Example) -> float:
        return 1.0 if response[:1] == example.answer else 0.0

    def canonical(self, response: str, example: Example) -> str | None:
        return response or None


def make_micro_policy(folder: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    from entropy_rft.models.loading import build_char_tokenizer, llama_config, save_policy

    torch.manual_seed(seed)
    tok = build_char_tokenizer()
    model = LlamaForCausalLM(llama_config(tok, d_model=32, layers=1, heads=2, mlp=64))
    with torch.no_grad():  # make the first digit likely enough for rewards to vary
        model.lm_head.weight.mul_(4.0)
    save_policy(folder, model, tok)
    return folder


def micro_overrides(model_dir: Path, **extra) -> list[str]:
    sets = {
        "model.name": str(model_dir),
        "task.name": "micro:DigitTask",
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "eval.every": 2,
        "eval.prompts": 8,
        "eval.samples": 4,
        "train.max_steps": 4,
        "train.checkpoint_every": 2,
        "train.samples_every": 2,
        "probe.records_every": 2,
        "probe.records_per_step": 16,
        "train.progress": False,
        "train.threads": 1,
        "optim.lr": 1e-2,
        "tuned_for": "",  # settings made for this micro policy: no "tuned for another model" warning
    }
    sets.update(extra)
    return [f"{k}={v}" for k, v in sets.items()]


class OverlapTask(DigitTask):
    """Reward: the fraction of the response's characters that occur in the prompt. Dense, so a random
    policy's samples differ in reward within every group and every token gets a gradient."""

    name = "overlap"

    def reward(self, response: str, example: Example) -> float:
        return sum(ch in example.prompt for ch in response) / len(response) if response else 0.0


class ChatDigitTask(DigitTask):
    """DigitTask with chat prompts; the verifier insists on receiving plain text."""

    name = "chat_digit"

    def split(self, seed: int):
        from entropy_rft.tasks.prompts import ChatPrompt

        train, val = super().split(seed)
        return ([Example(ChatPrompt(e.prompt), e.answer) for e in train],
                [Example(ChatPrompt(e.prompt), e.answer) for e in val])

    def reward(self, response, example):
        if not isinstance(response, str):
            raise TypeError(f"reward got {type(response).__name__}, expected the response text")
        return super().reward(response, example)


# Renders only the user's text, so every character stays in the micro tokenizer's vocabulary.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def again(run) -> list[str]:
    """``--task PATH`` when a run's recorded task is an import path (a micro task): a resume names the code again,
    since erft imports no code that a run folder names. Empty when the run has no readable config."""
    import yaml

    try:
        name = yaml.safe_load((Path(run) / "config.yaml").read_text())["task"]["name"]
    except (OSError, TypeError, KeyError, yaml.YAMLError):
        return []
    return ["--task", name] if isinstance(name, str) and ":" in name and not name.startswith("rg:") else []
