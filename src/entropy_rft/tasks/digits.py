"""The digit tasks: tiny tasks whose reward varies under a random policy (the micro policy,
:mod:`entropy_rft.models.micro`), so a few steps have non-zero advantages. The smoke tasks of the tests
(tests/micro.py re-exports them: ``micro:DigitTask``) and of the benchmarks
(``entropy_rft.tasks.digits:OverlapTask``). Not registered by name: a run names them by import path.
"""

from __future__ import annotations

import random

from entropy_rft.tasks.base import Example, Task


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


class OverlapTask(DigitTask):
    """Reward: the fraction of the response's characters that occur in the prompt. Dense, so a random
    policy's samples differ in reward within every group and every token gets a gradient."""

    name = "overlap"

    def reward(self, response: str, example: Example) -> float:
        return sum(ch in example.prompt for ch in response) / len(response) if response else 0.0
