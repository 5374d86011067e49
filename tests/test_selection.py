"""control.select_minibatch and control.microbatch_loss_scale on hand-computed cases (DESIGN.md, "Conventions":
Clip-Cov / KL-Cov select over the whole minibatch; the rollout keep of ClipB / ClipV is ANDed in)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from entropy_rft import control
from entropy_rft.control import Masks, Method, microbatch_loss_scale, select_minibatch
from entropy_rft.core.loss import agg_weights, policy_loss

T, F = True, False


def b(rows):
    return torch.tensor(rows, dtype=torch.bool)


# Two sequences of two valid tokens; sequence advantages +1 and -1 (token mean 0), so
# cov_t = (logp_t - mean logp) * A_t. logp = [[-1, -1.5], [-3, -2]], mean -1.875:
# cov = [[0.875, 0.375], [1.125, 0.125]].
LOGP = torch.tensor([[-1.0, -1.5], [-3.0, -2.0]])
ADV = torch.tensor([1.0, -1.0])
MASK = b([[T, T], [T, T]])
# old log-probs: token (0,0) has r = e^0.5 ≈ 1.65 with A > 0 and token (1,0) r = e^-0.5 ≈ 0.61 with A < 0, both
# clipped at eps 0.2; (0,1) and (1,1) have r = 1.
OLD = torch.tensor([[-1.5, -1.5], [-2.5, -2.0]])


def test_no_minibatch_method_passes_the_rollout_keep_through():
    mask = b([[T, T, F], [T, F, F]])
    keep = b([[T, F, T], [T, T, T]])
    sel = select_minibatch(None, torch.zeros(2, 3), torch.ones(2), mask, keep, control.build_method("clip_v"),
                           0.2, 0.2)
    assert torch.equal(sel.masks.keep, keep)
    assert torch.equal(sel.counted, b([[T, F, F], [T, F, F]]))
    assert sel.masks.zeroed is None and sel.masks.kl_cov_select is None
    assert sel.method == Masks()


def test_nothing_kept_away_leaves_keep_none_and_counts_the_mask():
    mask = b([[T, F], [T, T]])
    sel = select_minibatch(None, torch.zeros(2, 2), torch.ones(2), mask, None, control.build_method("none"), 0.2, 0.2)
    assert sel.masks.keep is None
    assert torch.equal(sel.counted, mask)


def test_kl_cov_selects_the_top_covariance_token_of_the_whole_minibatch():
    sel = select_minibatch(LOGP, OLD, ADV, MASK, None, control.build_method("kl_cov", ratio=0.01), None, None)
    assert torch.equal(sel.masks.kl_cov_select, b([[F, F], [T, F]]))  # cov 1.125 is the largest
    assert sel.masks.keep is None and torch.equal(sel.counted, MASK)


def test_clip_cov_never_picks_ppo_clipped_tokens_and_zeroed_tokens_still_count():
    method = control.build_method("clip_cov", ratio=0.01, lb=0.3, ub=5.0)  # k = max(int(0.01*4), 1) = 1
    rollout_keep = b([[T, T], [F, T]])
    for seed in range(5):
        sel = select_minibatch(LOGP, OLD, ADV, MASK, rollout_keep, method, 0.2, 0.2,
                               torch.Generator().manual_seed(seed))
        # candidates 0.3 < cov < 5: (0,0), (0,1), (1,0); (0,0) and (1,0) are PPO-clipped, so only (0,1)
        assert torch.equal(sel.masks.zeroed, b([[F, T], [F, F]]))
        assert torch.equal(sel.masks.keep, rollout_keep)
        assert torch.equal(sel.counted, b([[T, T], [F, T]]))


def test_clip_cov_uses_the_given_eps():
    method = control.build_method("clip_cov", ratio=0.01, lb=0.3, ub=5.0)
    picked = set()
    for seed in range(40):  # no ratio clip: all three candidates can be picked, one at a time
        sel = select_minibatch(LOGP, OLD, ADV, MASK, None, method, None, None, torch.Generator().manual_seed(seed))
        assert int(sel.masks.zeroed.sum()) == 1
        picked.add(tuple(sel.masks.zeroed.nonzero()[0].tolist()))
    assert picked == {(0, 0), (0, 1), (1, 0)}


@dataclass
class _DropFirstToken(Method):  # not registered: a minibatch-stage method that contributes a keep mask
    name: ClassVar[str] = "test_drop_first_token"
    stage: ClassVar[str] = "minibatch"
    masks: ClassVar[tuple[str, ...]] = ("keep",)

    def minibatch_masks(self, logp, old_logp, advantages, mask, *, clipped=None, generator=None):
        keep = torch.ones_like(mask)
        keep[:, 0] = False
        return Masks(keep=keep)


def test_method_keep_is_anded_with_the_rollout_keep():
    mask = b([[T, T, T], [T, T, F]])
    rollout_keep = b([[T, F, T], [T, T, T]])
    sel = select_minibatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), mask, rollout_keep,
                           _DropFirstToken(), 0.2, 0.2)
    assert torch.equal(sel.masks.keep, b([[F, F, T], [F, T, T]]))
    assert torch.equal(sel.counted, b([[F, F, T], [F, T, F]]))
    assert torch.equal(sel.method.keep, b([[F, T, T], [F, T, T]]))
    alone = select_minibatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), mask, None, _DropFirstToken(),
                             0.2, 0.2)
    assert torch.equal(alone.masks.keep, b([[F, T, T], [F, T, T]]))


def test_a_minibatch_method_needs_the_current_logp():
    with pytest.raises(ValueError, match="current log-probs"):
        select_minibatch(None, OLD, ADV, MASK, None, control.build_method("kl_cov"), None, None)


# ----------------------------------------------------------------------------- micro-batch loss scale


def test_token_mean_scale_is_the_share_of_counted_tokens():
    # minibatch: 4 counted tokens, weight 1/4 each; the micro-batch (row 0) holds 3 of them -> 3/4
    mb = b([[T, T, T], [T, F, F]])
    w = agg_weights(mb, "token-mean")
    assert microbatch_loss_scale(w[:1], mb[:1], "token-mean") == pytest.approx(0.75, abs=1e-7)
    assert microbatch_loss_scale(w[1:], mb[1:], "token-mean") == pytest.approx(0.25, abs=1e-7)


def test_seq_mean_scale_is_the_share_of_sequences():
    mb = b([[T, T, T], [T, F, F], [F, T, F], [F, F, F]])  # 3 sequences count
    w = agg_weights(mb, "seq-mean-token-mean")
    assert microbatch_loss_scale(w[:1], mb[:1], "seq-mean-token-mean") == pytest.approx(1 / 3, abs=1e-7)
    assert microbatch_loss_scale(w[1:], mb[1:], "seq-mean-token-mean") == pytest.approx(2 / 3, abs=1e-7)


def test_sum_norm_scale_uses_each_widths_constant():
    # minibatch: 2 sequences, T = 4: weight 1/8 per token; row 0 has 3 tokens -> 3/8.
    mb = b([[T, T, T, F], [T, F, F, F]])
    w = agg_weights(mb, "seq-mean-token-sum-norm")
    # at width 4 the micro-batch's own weights are 1/4 per token (sum 3/4): scale 1/2
    assert microbatch_loss_scale(w[:1], mb[:1], "seq-mean-token-sum-norm") == pytest.approx(0.5, abs=1e-7)
    # at width 3 its own weights are 1/3 per token (sum 1): scale 3/8
    assert microbatch_loss_scale(w[:1], mb[:1, :3], "seq-mean-token-sum-norm") == pytest.approx(0.375, abs=1e-7)


def test_empty_micro_batch_scale_is_zero():
    mb = b([[T, T], [F, F]])
    w = agg_weights(mb, "token-mean")
    assert microbatch_loss_scale(w[1:], mb[1:], "token-mean") == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_scaled_micro_batch_losses_sum_to_the_minibatch_loss(agg):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(5, 6, generator=g) * 0.3 - 1.0
    old = logp + 0.1 * torch.randn(5, 6, generator=g)
    adv = torch.randn(5, generator=g)
    mask = torch.rand(5, 6, generator=g) < 0.7
    w = agg_weights(mask, agg)
    parts = [slice(0, 2), slice(2, 5)]
    acc = sum(microbatch_loss_scale(w[r], mask[r], agg) * policy_loss(logp[r], old[r], adv[r], mask[r], agg=agg)[0]
              for r in parts)
    whole, _ = policy_loss(logp, old, adv, mask, agg=agg)
    torch.testing.assert_close(acc, whole, atol=1e-6, rtol=1e-5)
