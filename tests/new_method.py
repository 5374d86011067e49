"""A method added as one module and one registration (issue 66): a per-token variant of the drop rules, which
drops the A < 0 tokens the old policy was nearly sure of (entropy below ``h_min``), in the spirit of ClipB's
"penalties of likely tokens". Nothing else in the package names it: the native engine, TRL's subclass and
verl's loss find it through the registry, and the distributed selections through its ``exchange``.

``registered()`` is the one registration (``control.register_method``), undone afterwards, so that the suite's
other files see only the built-in methods (they list the registry).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from entropy_rft import control
from entropy_rft.control import registry


@dataclass
class LowEntropyNegatives(control.Method):
    """Drop (leave loss and count) the A < 0 tokens whose old-policy entropy is below ``h_min``."""

    name: ClassVar[str] = "test_low_entropy_negatives"
    paper: ClassVar[str] = "none (a test of the method interface)"
    summary: ClassVar[str] = "drop A<0 tokens with H < h_min"
    stage: ClassVar[str] = "rollout"
    exchange: ClassVar[str | None] = "local"  # each token alone: every rank selects on its own rows
    masks: ClassVar[tuple[str, ...]] = ("keep",)  # what rollout_masks sets (control.carriage)
    reads: ClassVar[tuple[str, ...] | None] = ("entropy",)  # what it reads of the old policy's statistics
    quadrants: ClassVar[dict[str, str]] = {"neg_spos": "drops (H < h_min)", "neg_sneg": "drops (H < h_min)"}

    h_min: float = control.param(0.5, "entropy (nats) below which an A<0 token is dropped", ge=0)

    def rollout_masks(self, stats, advantages: Tensor, mask: Tensor) -> control.Masks:
        adv = advantages if advantages.dim() == mask.dim() else advantages[:, None]  # per token or per sequence
        return control.Masks(keep=mask.bool() & ~((adv < 0) & (stats.entropy < self.h_min)))


@contextlib.contextmanager
def registered() -> Iterator[str]:
    """The method registered for the block (its name); unregistered afterwards."""
    control.register_method(LowEntropyNegatives)
    try:
        yield LowEntropyNegatives.name
    finally:
        registry._REGISTRY.pop(LowEntropyNegatives.name, None)
