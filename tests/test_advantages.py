"""GRPO / Dr.GRPO / GAE / whiten against naive Python loops."""

import statistics

import pytest
import torch

from entropy_rft.core.advantages import gae, grpo_advantages, whiten


def _naive_grpo(rewards, g, eps, scale_std, unbiased):
    out = []
    for i in range(0, len(rewards), g):
        grp = rewards[i : i + g]
        mean = sum(grp) / g
        std = statistics.stdev(grp) if unbiased else statistics.pstdev(grp)
        out += [(r - mean) / (std + eps) if scale_std else r - mean for r in grp]
    return out


def test_grpo_golden():
    # group [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) = 0.57735 -> ±0.866025
    a = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    assert a.tolist() == pytest.approx([0.8660254, -0.8660254, -0.8660254, 0.8660254], rel=1e-6)
    # population std 0.5 -> ±1
    a = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0, unbiased=False)
    assert a.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # Dr.GRPO: mean only
    a = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, scale_std=False)
    assert a.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale_std", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_grpo_matches_naive(seed, scale_std, unbiased):
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 3, (24,), generator=g).to(torch.float64)
    for group in (2, 3, 8):
        got = grpo_advantages(r, group, eps=1e-6, scale_std=scale_std, unbiased=unbiased)
        want = _naive_grpo(r.tolist(), group, 1e-6, scale_std, unbiased)
        assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_grpo_equal_rewards_give_zero():
    a = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2)
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "args, name",
    [((torch.ones(6), 4), "group_size"), ((torch.ones(6), 1), "group_size"), ((torch.ones(2, 3), 3), "rewards")],
)
def test_grpo_validation(args, name):
    with pytest.raises(ValueError, match=name):
        grpo_advantages(*args)


def _naive_gae(rewards, values, mask, gamma, lam):
    """Per row: collect the valid positions, run the textbook backward recursion on them."""
    adv = [[0.0] * len(mask[0]) for _ in mask]
    for b, row in enumerate(mask):
        idx = [t for t, v in enumerate(row) if v]
        last = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            v_next = values[b][idx[j + 1]] if j + 1 < len(idx) else 0.0
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
    return adv


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_naive(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 7
    mask = torch.rand(b, t, generator=g) > 0.3  # gaps and left/right padding included
    r = torch.randn(b, t, generator=g, dtype=torch.float64) * mask
    v = torch.randn(b, t, generator=g, dtype=torch.float64)
    gamma, lam = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7), (1.0, 0.95)][seed]
    adv, ret = gae(r, v, mask, gamma, lam)
    want = _naive_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    assert adv.tolist() == [pytest.approx(row, rel=1e-10, abs=1e-12) for row in want]
    assert torch.allclose(ret, torch.where(mask, adv + v, torch.zeros_like(v)))


def test_gae_sequence_reward_at_last_valid_token_and_monte_carlo():
    # gamma = lam = 1 with one terminal reward R: A_t = R - V_t on every valid token.
    mask = torch.tensor([[True, True, True, False], [True, True, False, False], [False] * 4])
    v = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, -0.5, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    adv, ret = gae(torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64), v, mask, 1.0, 1.0)
    assert adv.tolist() == [
        pytest.approx([0.9, 0.8, 0.7, 0.0]),
        pytest.approx([-1.5, -0.5, 0.0, 0.0]),
        [0.0, 0.0, 0.0, 0.0],
    ]
    assert ret[0, :3].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    # valid 1,2,3,4: mean 2.5, population var 1.25
    w = whiten(x, m, eps=0.0)
    s = 1.25**0.5
    assert w.tolist() == [pytest.approx([-1.5 / s, -0.5 / s, 0.5 / s]), pytest.approx([1.5 / s, 0.0, 0.0])]
    w = whiten(x, m, shift_mean=False, eps=0.0)
    assert w[0].tolist() == pytest.approx([-1.5 / s + 2.5, -0.5 / s + 2.5, 0.5 / s + 2.5])


def test_token_advantages_by_hand():
    """GRPO broadcasts each sequence's group-normalised advantage over its valid tokens; PPO puts the reward on
    the last valid token (moved from the trainer, issue 26 item 2)."""
    from entropy_rft.core.advantages import sequence_reward_at_last_token, token_advantages, uniform_groups

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # one group of 4: mean 0.25, sample std 0.5
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv, ret = token_advantages(rewards, mask, None, algorithm="grpo", group_size=4, adv_eps=0.0, gamma=1.0,
                                lam=1.0)
    assert ret is None
    want = torch.tensor([1.5, -0.5, -0.5, -0.5])[:, None] * mask
    assert torch.allclose(adv, want)
    adv_dr, _ = token_advantages(rewards, mask, None, algorithm="dr_grpo", group_size=4, adv_eps=0.0, gamma=1.0,
                                 lam=1.0)
    assert torch.allclose(adv_dr, torch.tensor([0.75, -0.25, -0.25, -0.25])[:, None] * mask)
    tok = sequence_reward_at_last_token(torch.tensor([2.0, 3.0, 4.0, 5.0]), mask)
    assert tok.tolist() == [[0, 2, 0], [3, 0, 0], [0, 0, 4], [0, 5, 0]]
    assert uniform_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2).tolist() == [True, True, False, False]
