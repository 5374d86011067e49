"""The token view's records (``token_view.jsonl``): some groups of a step, response by response, token by token.

One row per group: the step, the group's index in the batch, its prompt, and each response with its reward, its
advantage and, per token, the token's text, log p, H, S* and S_c (``core.dynamics.TokenStats``, the old policy's,
as the method saw them), and the method's **mark**:

- ``dropped``: the method's rollout-stage rule took the token out of the loss (ClipB, ClipV, the 80/20 rule,
  grad-mask: ``Masks.keep`` false);
- ``zeroed``: a minibatch rule zeroed its advantage (Clip-Cov);
- ``adjusted``: a rule re-weighted it (EntroPIC's chosen tokens: ``Masks.weight_select``);
- ``clipped``: after the update its ratio lies past PPO's clip on the side its advantage pushes (A > 0 and
  r > 1 + eps_high, or A < 0 and r < 1 − eps_low): the clip bound it, at least by the last minibatch;
- ``kept``: trained as GRPO trains it.

and ``shift``, the advantage shaping's ψ where a method adds one (entropy-advantage: ``Masks.adv_shift``).
Engine-neutral: the native engine records what its stages computed; the TRL plug-in what it sees at its
rollout stage (``integrations.trl``: dropped or kept). Which groups: the first ``probe.view_groups`` of the
batch, so that runs of one seed show the same prompts at the same step (a comparison view) and no random
number is drawn. Token text is data: the report escapes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from entropy_rft.core.dynamics import TokenStats

MARKS = ("kept", "dropped", "zeroed", "adjusted", "clipped")
DIGITS = 5  # the floats' decimals: the file stays small (a response of 64 tokens is about 3 kB)


def token_marks(mask: Tensor, keep: Tensor | None = None, zeroed: Tensor | None = None,
                adjusted: Tensor | None = None, clipped: Tensor | None = None) -> Tensor:
    """[B, R] int8: the index in ``MARKS`` of each valid token's mark (the first that holds, in the order dropped,
    zeroed, adjusted, clipped; else kept); -1 on padding."""
    out = torch.zeros(mask.shape, dtype=torch.int8)
    for name, m in (("clipped", clipped), ("adjusted", adjusted), ("zeroed", zeroed)):
        if m is not None:
            out[m.cpu().bool()] = MARKS.index(name)
    if keep is not None:
        out[~keep.cpu().bool()] = MARKS.index("dropped")
    out[~mask.cpu().bool()] = -1
    return out


def clipped_after(ratio: Tensor, adv: Tensor, eps_low: float | None, eps_high: float | None) -> Tensor:
    """Tokens whose ratio r after the update lies past PPO's clip on the side their advantage pushes:
    A > 0 and r > 1 + eps_high, or A < 0 and r < 1 − eps_low (a side without a clip: never)."""
    r = ratio.double()
    high = (adv > 0) & (r > 1 + eps_high) if eps_high is not None else torch.zeros_like(adv, dtype=torch.bool)
    low = (adv < 0) & (r < 1 - eps_low) if eps_low is not None else torch.zeros_like(adv, dtype=torch.bool)
    return high | low


def _round(xs: Sequence[float]) -> list[float | None]:
    return [None if x != x else round(float(x), DIGITS) for x in xs]  # NaN: null


def group_rows(step: int, engine: str, prompts: Sequence[str], token_text: Sequence[Sequence[str]],
               mask: Tensor, stats: TokenStats, adv: Tensor, rewards: Sequence[float | None], marks: Tensor,
               group_size: int, groups: int, shift: Tensor | None = None) -> list[dict[str, Any]]:
    """The view's rows for the first ``groups`` groups (``group_size`` consecutive sequences each) of a batch.
    ``token_text[b][t]``: the text of response token t of sequence b; ``adv``: [B, R] per-token advantages (a
    response's advantage is its first valid token's); ``marks``: ``token_marks``'s."""
    rows = []
    n = min(groups, mask.shape[0] // max(group_size, 1))
    cpu = {k: getattr(stats, k).detach().float().cpu() for k in ("logp", "entropy", "s_star", "s_centered")}
    adv_c, mask_c = adv.detach().float().cpu(), mask.detach().cpu().bool()
    shift_c = None if shift is None else shift.detach().float().cpu()
    for g in range(n):
        responses = []
        for b in range(g * group_size, (g + 1) * group_size):
            valid = int(mask_c[b].sum())  # a response's valid tokens come first (right padding)
            first = adv_c[b, 0].item() if valid else 0.0
            resp = {"reward": rewards[b], "adv": round(first, DIGITS), "tokens": list(token_text[b][:valid]),
                    "logp": _round(cpu["logp"][b, :valid].tolist()), "h": _round(cpu["entropy"][b, :valid].tolist()),
                    "s": _round(cpu["s_star"][b, :valid].tolist()),
                    "sc": _round(cpu["s_centered"][b, :valid].tolist()),
                    "mark": [MARKS[i] for i in marks[b, :valid].tolist()]}
            if shift_c is not None and bool((shift_c[b, :valid] != 0).any()):
                resp["shift"] = _round(shift_c[b, :valid].tolist())
            responses.append(resp)
        rows.append({"step": step, "group": g, "engine": engine, "prompt": prompts[g * group_size],
                     "responses": responses})
    return rows


def token_texts(tok: Any, ids: Tensor, mask: Tensor) -> list[list[str]]:
    """Each valid token's own text (``tok.decode`` of the one id; special tokens such as EOS shown by name)."""
    out = []
    for row, m in zip(ids.tolist(), mask.bool().tolist()):
        out.append([tok.decode([i], skip_special_tokens=False) for i, v in zip(row, m) if v])
    return out


def native_rows(step: int, tok: Any, s: Any, old: Any, sel: Any, upd: Any, probed: Any, settings: Any,
                group_size: int, groups: int) -> list[dict[str, Any]]:
    """The native engine's view rows of a step, from its records (``training.records``: ``Scored``,
    ``OldPolicy``, ``Selection``, ``Update``, ``Probed``) and the loss's ``LossSettings`` (the ratio clip)."""
    rb = s.rollout
    n = min(groups * group_size, rb.response_ids.shape[0])
    mask = rb.response_mask[:n]
    adv = old.adv[:n]
    marks = token_marks(mask, None if sel.keep is None else sel.keep[:n], upd.zeroed[:n],
                        None if sel.weight_select is None else sel.weight_select[:n],
                        clipped_after(probed.ratio[:n].cpu(), adv.cpu(), settings.eps_low, settings.eps_high))
    return group_rows(step, "native", [ex.prompt for ex in s.group[:n]], token_texts(tok, rb.response_ids[:n], mask),
                      mask, old.stats, adv, s.rewards[:n].tolist(), marks,
                      group_size, groups, None if sel.adv_shift is None else sel.adv_shift[:n])
