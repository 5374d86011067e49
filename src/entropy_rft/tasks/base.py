"""The task interface: prompts, a verifier and a seeded train/validation split.

A task is everything the trainer needs to know about a problem family:

- ``split(seed)`` gives ``(train, validation)`` lists of :class:`Example`, seeded and disjoint;
- ``reward(response, example)`` is the verifier, 1.0 or 0.0, and never raises on garbage;
- ``canonical(response, example)`` normalises a response so that *distinct* correct answers can be
  counted (``None`` when the response is invalid).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer.

    ``answer`` is whatever the task's verifier needs (a target number, a reference solution string).
    ``meta`` carries task-specific extras (for Countdown: the digits and the number of solutions).
    """

    prompt: str
    answer: Any
    meta: dict = field(default_factory=dict)


class Task(ABC):
    """A verifiable task. Subclasses set ``name`` and implement the three methods below."""

    name: str = "task"
    #: A hint for the sampler: responses longer than this many tokens are never needed.
    max_response_tokens: int = 256
    #: What the task chose for the user (e.g. a default held-out split), said in a run's first lines.
    notes: tuple[str, ...] = ()

    @abstractmethod
    def split(self, seed: int) -> tuple[list[Example], list[Example]]:
        """Return ``(train, validation)``: seeded, deterministic per seed, and disjoint."""

    @abstractmethod
    def reward(self, response: str, example: Example) -> float:
        """Score ``response`` for ``example``: 1.0 if correct, else 0.0. Never raises."""

    @abstractmethod
    def canonical(self, response: str, example: Example) -> str | None:
        """A normalised form of a response for counting distinct answers, ``None`` if invalid."""

    def rewards(self, responses: list[str], examples: list[Example]) -> list[float]:
        """Score many responses at once (override to batch or parallelise, as math tasks do)."""
        return [self.reward(r, ex) for r, ex in zip(responses, examples)]

    def correct(self, response: str, example: Example) -> bool:
        """Whether ``response`` earns the full reward."""
        return self.reward(response, example) >= 1.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def int_param(task: str, name: str, value: Any) -> int:
    """A task parameter that must be an integer (a float with no fraction, ``2000.0``, counts as one), else a
    one-line :class:`~entropy_rft.common.errors.UserError` naming the task, the parameter and the expected type."""
    from entropy_rft.common.errors import UserError

    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"task {task!r}: param {name!r} must be an integer, got {value!r}")
    return value
