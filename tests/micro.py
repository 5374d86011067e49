"""Micro fixtures for trainer tests: a random tiny Llama policy and a task whose reward varies under it.

The Countdown base policy takes minutes to build; the trainer's mechanics need only a policy whose
samples get different rewards, so advantages are non-zero. The policy and the digit tasks live in the package
(``entropy_rft.models.micro``, ``entropy_rft.tasks.digits``: the benchmarks use them too); this module re-exports
them under the names the tests give (``micro:DigitTask``) and adds the tests' own.
"""

from __future__ import annotations

from pathlib import Path

from entropy_rft.models.micro import make_micro_policy  # noqa: F401  (re-exported: the tests' name)
from entropy_rft.models.micro import micro_overrides as _package_overrides
from entropy_rft.tasks.base import Example
from entropy_rft.tasks.digits import DigitTask, OverlapTask  # noqa: F401  (re-exported: micro:DigitTask)

# The task is imported by name in every CLI process that trains on it (``micro:DigitTask``); the model builder's
# imports (torch, transformers: ~5 s a process) stay in the builder, so a refused run pays none of them.


def micro_overrides(model_dir: Path, **extra) -> list[str]:
    """The package's micro settings (:func:`entropy_rft.models.micro.micro_overrides`) on ``micro:DigitTask``."""
    return _package_overrides(model_dir, **{"task.name": "micro:DigitTask", **extra})


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
