"""Advantage estimators: GRPO group normalisation, Dr.GRPO (no std), GAE for PPO with a critic.

- GRPO: Shao et al. 2024 (DeepSeekMath), arXiv 2402.03300, Sec. 4.1.2: A_i = (r_i − mean(r)) / std(r)
  over the G samples of one prompt. We use the *sample* std (Bessel-corrected, divide by G − 1) and add
  ``eps`` to it, as verl's ``compute_grpo_outcome_advantage`` (``torch.std``) and TRL's GRPOTrainer
  (``Tensor.std``) do, so numbers match those trainers. ``unbiased=False`` gives the population std.
- Dr.GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783: A_i = r_i − mean(r).
- GAE: Schulman et al. 2016, arXiv 1506.02438, Eq. 16: A_t = Σ_l (γλ)^l δ_{t+l},
  δ_t = r_t + γ V_{t+1} − V_t, with V = 0 after the last valid token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from entropy_rft.core.tensor_checks import as_mask, check_like, is_number

__all__ = ["grpo_advantages", "gae", "whiten"]


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    scale_std: bool = True,
    unbiased: bool = True,
) -> Tensor:
    """Group-normalised advantages, one per sample, shape ``[B]``.

    ``rewards`` is ``[B]`` with ``B = n_prompts · group_size`` and each prompt's samples contiguous.
    ``scale_std=True`` (GRPO): (r − mean_g) / (std_g + eps), std_g the sample std (``unbiased=True``,
    verl/TRL) or population std. ``scale_std=False`` (Dr.GRPO): r − mean_g. A group whose rewards are all
    equal gets advantage 0 in both forms.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [B], got {getattr(rewards, 'shape', type(rewards))}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"group_size {group_size} does not divide the number of rewards {rewards.numel()}")
    if not is_number(eps) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    dt = torch.promote_types(rewards.dtype, torch.float32)
    g = rewards.detach().to(dt).view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale_std:
        centred = centred / (g.std(dim=1, keepdim=True, unbiased=unbiased) + eps)
    return centred.reshape(-1)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each row (Schulman et al. 2016, Eq. 16).

    ``rewards`` is ``[B, T]`` token rewards, or ``[B]`` sequence rewards that are placed at the last valid
    token. ``values`` ``[B, T]`` are the critic's V(s_t). Padding positions are skipped: the successor of
    a valid token is the next valid token of its row, and V = 0 after the last one (terminal). Returns
    ``(advantages, returns)``, both ``[B, T]`` with ``returns = advantages + values`` and 0 on padding.
    """
    mask = as_mask(mask)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got {tuple(mask.shape)}")
    check_like(values, mask, "values")
    for v, name in ((gamma, "gamma"), (lam, "lam")):
        if not is_number(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
    dt = torch.promote_types(values.dtype, torch.float32)
    vals = values.detach().to(dt)
    if isinstance(rewards, Tensor) and rewards.shape == mask.shape[:1]:
        last = mask.shape[1] - 1 - mask.flip(-1).to(torch.int64).argmax(-1)
        tok_r = torch.zeros_like(vals)
        has = mask.any(-1)
        rows = torch.arange(mask.shape[0], device=mask.device)[has]
        tok_r[rows, last[has]] = rewards.detach().to(dt)[has]
    else:
        check_like(rewards, mask, "rewards")
        tok_r = rewards.detach().to(dt)
    adv = torch.zeros_like(vals)
    next_v = torch.zeros(mask.shape[0], dtype=dt, device=vals.device)
    next_a = torch.zeros_like(next_v)
    for t in range(mask.shape[1] - 1, -1, -1):
        valid = mask[:, t]
        delta = tok_r[:, t] + gamma * next_v - vals[:, t]
        a_t = delta + gamma * lam * next_a
        adv[:, t] = torch.where(valid, a_t, torch.zeros_like(a_t))
        next_v = torch.where(valid, vals[:, t], next_v)
        next_a = torch.where(valid, a_t, next_a)
    returns = torch.where(mask, adv + vals, torch.zeros_like(adv))
    return adv, returns


def whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x − mean) / sqrt(var + eps) over the valid tokens (population variance); 0 on padding.

    ``shift_mean=False`` only rescales (adds the mean back), as in verl's ``masked_whiten``.
    """
    mask = as_mask(mask)
    check_like(x, mask, "x")
    n = int(mask.sum())
    if n == 0:
        return torch.zeros_like(x)
    xd = x.detach()
    vals = xd[mask]
    mean = vals.mean()
    var = ((vals - mean) ** 2).mean()
    out = (xd - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros_like(out))


def sequence_reward_at_last_token(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards [B, R] for PPO: each sequence's reward on its last valid token, 0 elsewhere."""
    tok = torch.zeros_like(mask, dtype=torch.float32)
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    tok[last] = rewards.float().repeat_interleave(last.sum(-1))
    return tok


def token_advantages(rewards: Tensor, mask: Tensor, values: Tensor | None, *, algorithm: str, group_size: int,
                     adv_eps: float, gamma: float, lam: float) -> tuple[Tensor, Tensor | None]:
    """Per-token advantages [B, R] (zero off ``mask``) and, for PPO, the returns.

    ``ppo``: GAE(gamma, lambda) on the sequence reward placed at the last token, whitened over valid tokens.
    ``grpo`` / ``dr_grpo``: the group-normalised sequence advantage (``grpo_advantages``; Dr.GRPO does not
    divide by the group's std) broadcast over the sequence's tokens; returns None.
    """
    if algorithm == "ppo":
        adv, ret = gae(sequence_reward_at_last_token(rewards, mask), values, mask, gamma, lam)
        return whiten(adv, mask) * mask, ret
    seq = grpo_advantages(rewards.float(), group_size, eps=adv_eps, scale_std=algorithm == "grpo")
    return seq[:, None].expand_as(mask).float() * mask, None


def uniform_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Per sequence: True when its whole group got the same reward (DAPO's dynamic sampling drops them)."""
    g = rewards.view(-1, group_size)
    return (g == g[:, :1]).all(-1).repeat_interleave(group_size)
