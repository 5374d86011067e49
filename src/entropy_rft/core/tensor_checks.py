"""Input checks on token tensors, shared by ``control``, ``loss`` and ``advantages``.

The lowest torch layer of the training path: it knows masks and advantages, nothing about methods or models.
"""

from __future__ import annotations

from typing import TypeGuard

import torch
from torch import Tensor

__all__ = ["as_mask", "broadcast_advantages", "check_bool_like", "check_like", "check_mask", "is_number"]


def check_mask(mask: Tensor, name: str = "mask") -> None:
    """Require a bool tensor (the response mask, or a keep/zeroed/exclude mask)."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")


def as_mask(mask: Tensor, name: str = "mask") -> Tensor:
    """``mask`` as a bool tensor: a bool tensor as it is, an integer tensor of 0/1 (TRL's ``completion_mask``
    is int64) as ``mask.bool()``. Anything else (floats, other integers) raises, naming ``name``."""
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        return mask
    if isinstance(mask, Tensor) and not mask.is_floating_point() and not mask.is_complex():
        if bool(((mask == 0) | (mask == 1)).all()):
            return mask.bool()
        raise ValueError(f"{name} must hold only 0 and 1 (or be a bool tensor), got other values")
    got = getattr(mask, "dtype", type(mask))
    raise ValueError(f"{name} must be a bool tensor or an integer tensor of 0/1, got {got}")


def check_like(x: Tensor, mask: Tensor, name: str) -> None:
    """Require ``x`` to have exactly the shape of ``mask``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.shape != mask.shape:
        raise ValueError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(x.shape)}")


def check_bool_like(x: Tensor | None, mask: Tensor, name: str) -> Tensor | None:
    """Optional mask shaped like ``mask``, returned as bool (``as_mask``: 0/1 integers accepted)."""
    if x is None:
        return None
    x = as_mask(x, name)
    check_like(x, mask, name)
    return x


def broadcast_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Expand advantages to ``mask.shape``: per-token (``mask.shape``), per-sequence (``mask.shape[:-1]``,
    e.g. ``[B]``, or ``mask.shape[:-1] + (1,)``, e.g. ``[B, 1]``), or a 0-d scalar. Other shapes, which
    would broadcast by accident (a ``[T]`` vector across rows), are rejected.
    """
    if not isinstance(advantages, Tensor):
        raise ValueError(f"advantages must be a tensor, got {type(advantages).__name__}")
    shape = tuple(advantages.shape)
    seq = tuple(mask.shape[:-1])
    if shape == tuple(mask.shape) or shape == ():
        return advantages.expand(mask.shape)
    if mask.dim() >= 1 and shape in (seq, seq + (1,)):
        return advantages.reshape(seq + (1,)).expand(mask.shape)
    raise ValueError(
        f"advantages must be shaped like mask {tuple(mask.shape)}, per sequence {seq} or {seq + (1,)}, "
        f"or a scalar; got {shape}"
    )


def is_number(value: object) -> TypeGuard[int | float]:
    """A real int or float (bools excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
