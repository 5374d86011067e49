"""The README's library block runs as written, and the API edges it shows (issue 25, item 5): log-probs with
grad from logits (``loss.token_logprobs``), 0/1 integer masks, ``predicted_entropy_change``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from entropy_rft import control
from entropy_rft.core.dynamics import token_stats
from entropy_rft.core.loss import policy_loss, token_logprobs

README = Path(__file__).resolve().parents[1] / "README.md"


def library_block() -> str:
    section = README.read_text().split("\n## Library\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_library_block_runs(capsys):
    ns: dict = {}
    torch.manual_seed(0)
    exec(compile(library_block(), "README.md#library", "exec"), ns)
    logits, ids = ns["logits"], ns["token_ids"]
    ref = torch.log_softmax(logits.detach().double(), -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(ns["logp"].detach().double(), ref, atol=1e-6, rtol=1e-6)
    assert logits.grad is not None and logits.grad.abs().sum() > 0  # the loss reached the logits
    torch.testing.assert_close(ns["d_entropy"], -1e-3 * ns["advantages"][:, None] * ns["st"].s_centered)
    assert "predicted dH" in capsys.readouterr().out


def test_token_logprobs_value_and_grad_against_float64():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 17, generator=g) * 4
    logits[0, 0, 3] = 1e4  # a peaked row
    logits[1, 1, :8] = -float("inf")  # masked entries
    ids = torch.randint(8, 17, (3, 5), generator=g)
    z = logits.clone().requires_grad_(True)
    lp = token_logprobs(z, ids, temperature=0.7)
    ref = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=1e-6)
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(lp, token_stats(logits, ids, 0.7).logp, atol=1e-5, rtol=1e-6)
    lp.sum().backward()
    p = torch.softmax(logits.double() / 0.7, -1)
    want = (torch.nn.functional.one_hot(ids, 17).double() - p) / 0.7  # d log p_k / d logits = (e_k - p) / T
    torch.testing.assert_close(z.grad.double(), want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 16\]"):
        token_logprobs(logits, ids + 10)


def test_integer_masks_equal_bool_masks_and_bad_values_are_named():
    g = torch.Generator().manual_seed(2)
    logp, old = torch.randn(4, 6, generator=g) - 1, torch.randn(4, 6, generator=g) - 1
    adv, s_c = torch.randn(4, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.8
    keep_b = control.clip_v_mask(s_c, adv, mask, 0.5, None, "negative")
    keep_i = control.clip_v_mask(s_c, adv, mask.long(), 0.5, None, "negative")
    assert keep_i.dtype == torch.bool and torch.equal(keep_b, keep_i)
    loss_b, met_b = policy_loss(logp, old, adv, mask, keep=keep_b)
    loss_i, met_i = policy_loss(logp, old, adv, mask.long(), keep=keep_b.int())
    assert torch.equal(loss_b, loss_i) and met_b == met_i
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        policy_loss(logp, old, adv, mask.long() * 2)
    with pytest.raises(ValueError, match="keep must be a bool tensor or an integer tensor of 0/1"):
        policy_loss(logp, old, adv, mask, keep=keep_b.float())
