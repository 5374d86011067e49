"""Whether low-precision weights can hold an optimizer's updates.

``model.dtype=bfloat16`` loads the weights in bf16 and AdamW updates them in place, in bf16: a weight w moves
only when its update is at least half the spacing of bf16 numbers around w (round to nearest). bf16 keeps
8 significant bits, so that spacing is 2^(floor(log2|w|) - 7), between 0.4% and 0.8% of |w|. AdamW's step
is about lr per weight, so at lr 2e-5 on weights of |w| ~ 0.03 (spacing 2^-13 = 1.2e-4) most updates round
away. ``model.dtype=float32`` with ``model.autocast_bf16=true`` keeps float32 master weights and runs the
forwards in bf16 instead.
"""

from __future__ import annotations

import math

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def smallest_kept_update(dtype: torch.dtype, magnitude: float) -> float:
    """Half the spacing of ``dtype`` numbers at ``magnitude`` (> 0): an update of smaller size leaves a weight of
    that magnitude unchanged under round-to-nearest. ``finfo.eps`` is the spacing at 1.0."""
    if magnitude <= 0:
        raise ValueError(f"magnitude: must be > 0, got {magnitude}")
    return 2.0 ** math.floor(math.log2(magnitude)) * torch.finfo(dtype).eps / 2


@torch.no_grad()
def typical_weight(model, stride: int = 101) -> float:
    """The median |w| over the model's matrices (every ``stride``-th element: a 135M model reads ~1.3M)."""
    parts = [p.detach().reshape(-1)[::stride].float().abs() for p in model.parameters() if p.dim() >= 2]
    if not parts:
        raise ValueError("model: has no weight matrices")
    return float(torch.cat(parts).median())


def lr_warning(model, lr: float) -> str | None:
    """One line when the model's weights are bf16/fp16 and an update of about ``lr`` is below half their spacing
    at the median weight (most updates would round away); None otherwise."""
    dtype = next(model.parameters()).dtype
    if dtype not in LOW_PRECISION:
        return None
    w = typical_weight(model)
    floor = smallest_kept_update(dtype, w) if w > 0 else 0.0
    if lr >= floor:
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"model.dtype={name} keeps the weights and AdamW's updates in {name}: an update of about optim.lr="
            f"{lr:g} is below half the {name} spacing at the median weight (|w| {w:.3g}: {floor:.2g}), so most "
            "updates round away; use model.dtype=float32 with model.autocast_bf16=true (float32 master weights, "
            "bf16 compute)")
