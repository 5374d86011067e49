"""entropy-rft: reinforcement fine-tuning with policy entropy at the centre.

Measure entropy dynamics (``dynamics``), control them (``control``, ``loss``), and train
and compare methods (``trainer``, ``cli``). docs/architecture.md maps the package.

The public names below are importable from the top level, the short path the docs use
(``from entropy_rft import token_stats``). They load lazily, so ``import entropy_rft`` stays free of torch
(``erft --help`` and the cheap refusals of bad input run before torch is imported). A refactor that moves
one keeps it here; tests/test_public_api.py imports every name the docs and examples show.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
PUBLIC = {
    "token_stats": "entropy_rft.core.dynamics",
    "TokenStats": "entropy_rft.core.dynamics",
    "predicted_entropy_change": "entropy_rft.core.theory",
    "first_order_entropy_change": "entropy_rft.core.theory",
    "NonFiniteLogits": "entropy_rft.core.dynamics",
    "fused_logp": "entropy_rft.core.fused",
    "policy_loss": "entropy_rft.core.loss",
    "compute_policy_loss": "entropy_rft.core.loss",
    "LossInputs": "entropy_rft.core.loss_types",
    "LossSettings": "entropy_rft.core.loss_types",
    "LossOutputs": "entropy_rft.core.loss_types",
    "Masks": "entropy_rft.core.loss_types",
    "token_logprobs": "entropy_rft.core.loss",
    "build_method": "entropy_rft.control",
    "available_methods": "entropy_rft.control",
    "Method": "entropy_rft.control",
}

__all__ = ["PUBLIC", "__version__", *PUBLIC]


def __getattr__(name: str) -> Any:
    if name in PUBLIC:
        value = getattr(importlib.import_module(PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'entropy_rft' has no attribute {name!r}")
