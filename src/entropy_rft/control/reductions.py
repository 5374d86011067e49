"""The batch reductions a selection rule needs, as one value the rule takes: over this process's tokens (``LOCAL``)
or over the tokens of every data-parallel rank (``integrations.dist_select.GLOBAL``), so that each of the papers'
rules has one home (``control.masks``) whichever engine runs it (issue 78, item 3).

A rule reads the batch through five reductions: the number of valid tokens (``count``: ClipV's cap warning), a
population mean and std over them (``mean_std``: ClipB's m and s, ClipV's s_c), the k largest of a score
(``top_k``: ClipV's cap, KL-Cov's selection), the token covariance of log p and A with its token count
(``covariance``: Clip-Cov, KL-Cov), and a uniform random pick of k among n candidates (``pick``: Clip-Cov). The
global ones exchange sums, counts and candidates and return what the local ones return on the concatenation of
the ranks' rows (``integrations.dist_select``'s docstring says how, ties included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from entropy_rft.control._common import broadcast_advantages, masked_mean_std, token_covariance

__all__ = ["LOCAL", "Reductions", "local_pick", "local_top_k"]


def local_top_k(score: Tensor, k: int) -> Tensor:
    """Indices of the k largest values of the 1-D ``score``, ties to the earlier position (all of them when
    there are at most k)."""
    return torch.sort(score, descending=True, stable=True).indices[:k]


def local_pick(n: int, k: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """k of n candidates uniformly at random, ``torch.randperm(n, generator)[:k]`` (on the generator's device), or
    all of them, in order, when n <= k (no number drawn)."""
    if n <= k:
        return torch.arange(n, device=device)
    dev = generator.device if generator is not None else torch.device("cpu")
    return torch.randperm(n, generator=generator, device=dev).to(device)[:k]


def local_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, int]:
    """``token_covariance`` (float64, 0 on padding) and the number of valid tokens."""
    return token_covariance(logp, broadcast_advantages(advantages, mask), mask), int(mask.sum())


@dataclass(frozen=True)
class Reductions:
    """How a rule reduces over its batch (the module docstring)."""

    count: Callable[[Tensor], int]  # valid tokens of a bool mask
    mean_std: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, int]]  # (x, mask) -> float64 mean, std, n
    top_k: Callable[[Tensor, int], Tensor]  # (1-D score, k) -> the k largest: indices or a bool mask
    covariance: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, int]]  # (logp, adv, mask) -> (cov, n)
    pick: Callable[[int, int, torch.Generator | None, torch.device], Tensor]  # (n, k, generator, device) -> idx


LOCAL = Reductions(count=lambda mask: int(mask.sum()), mean_std=masked_mean_std, top_k=local_top_k,
                   covariance=local_covariance, pick=local_pick)
