"""policy_loss, ppo_clipped_mask, aggregate: hand-computed goldens and a naive per-token reference."""

import math

import pytest
import torch

from entropy_rft.core.loss import AGG_MODES, aggregate, kl_estimate, policy_loss, ppo_clipped_mask, value_loss
from entropy_rft.core.metrics import approx_kl

T, F = True, False
LN = math.log


def _lp(ratios):
    """logp with old_logp = 0 so that r = the given ratios exactly (float64)."""
    return torch.tensor([LN(r) for r in ratios], dtype=torch.float64).unsqueeze(0).requires_grad_(True)


# Four tokens, old_logp = 0, eps 0.2:
#   r=1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped, no grad)
#   r=0.5, A=+1: max(-0.5, -0.8) = -0.5 (grad -A*r/4 = -0.125)
#   r=0.5, A=-1: max( 0.5,  0.8) =  0.8 (clipped, no grad)
#   r=1.5, A=-1: max( 1.5,  1.2) =  1.5 (grad 1.5/4 = 0.375)
# token-mean: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15
R4 = [1.5, 0.5, 0.5, 1.5]
A4 = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
M4 = torch.ones(1, 4, dtype=torch.bool)
OLD4 = torch.zeros(1, 4, dtype=torch.float64)


def test_ppo_clip_golden_loss_grad_and_metrics():
    lp = _lp(R4)
    loss, met = policy_loss(lp, OLD4, A4, M4)
    assert loss.item() == pytest.approx(0.15)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -0.125, 0.0, 0.375])
    assert met["loss/pg"] == pytest.approx(0.15)
    assert met["loss/total"] == pytest.approx(0.15)
    assert met["clip/ratio_high_frac"] == pytest.approx(0.25)
    assert met["clip/ratio_low_frac"] == pytest.approx(0.25)
    assert met["clip/ratio_frac"] == pytest.approx(0.5)
    assert met["ratio/mean"] == pytest.approx(1.0)
    assert met["ratio/max"] == pytest.approx(1.5)
    assert met["loss/counted_frac"] == 1.0
    for v in met.values():
        assert v is None or (isinstance(v, float) and not math.isnan(v))


def test_ppo_clipped_mask_golden():
    assert ppo_clipped_mask(_lp(R4), OLD4, A4, M4, 0.2, 0.2).tolist() == [[T, F, T, F]]
    assert ppo_clipped_mask(_lp(R4), OLD4, A4, M4, 0.2, None).tolist() == [[F, F, T, F]]
    assert ppo_clipped_mask(_lp(R4), OLD4, A4, M4, None, None).tolist() == [[F, F, F, F]]
    assert ppo_clipped_mask(_lp(R4), OLD4, A4, M4, 0.2, 0.2, dual_clip=1.4).tolist() == [[T, F, T, T]]


def test_clip_higher_and_no_clip():
    # r = 1.25, A = +1: eps_high 0.2 clips to -1.2; 0.28 leaves -1.25; None leaves -1.25.
    lp, old, a, m = _lp([1.25]), torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1), M4[:, :1]
    assert policy_loss(lp, old, a, m)[0].item() == pytest.approx(-1.2)
    assert policy_loss(lp, old, a, m, eps_high=0.28)[0].item() == pytest.approx(-1.25)
    loss, met = policy_loss(lp, old, a, m, eps_low=None, eps_high=None)
    assert loss.item() == pytest.approx(-1.25)
    assert met["clip/ratio_frac"] == 0.0


def test_dual_clip():
    # r = 4, A = -1: PPO loss max(4, 0.8) = 4; dual clip c = 3 bounds it by 3 (no grad).
    # r = 4, A = +1: clipped to -1.2, dual clip does not touch A > 0.
    lp = _lp([4.0, 4.0])
    a = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    old, m = torch.zeros(1, 2, dtype=torch.float64), M4[:, :2]
    loss, met = policy_loss(lp, old, a, m, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert met["clip/dual_frac"] == pytest.approx(0.5)
    loss.backward()
    assert lp.grad.tolist()[0] == [0.0, 0.0]
    assert policy_loss(_lp([4.0, 4.0]), old, a, m)[0].item() == pytest.approx((4.0 - 1.2) / 2)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, old, a, m, dual_clip=1.0)


# Aggregation: token losses l = 1,2,3 | 4 (row 1 has one valid token) | nothing (row 2 empty).
# On-policy (r=1) with no clip effect and A = -l, the token loss is exactly l.
#   token-mean: 10/4 = 2.5
#   seq-mean-token-mean: (6/3 + 4/1) / 2 = 3
#   seq-mean-token-sum-norm: 10 / 2 / 3 = 5/3
AGG_MASK = torch.tensor([[T, T, T], [T, F, F], [F, F, F]])
AGG_L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]], dtype=torch.float64)
AGG_EXPECTED = {"token-mean": 2.5, "seq-mean-token-mean": 3.0, "seq-mean-token-sum-norm": 5 / 3}


@pytest.mark.parametrize("agg", AGG_MODES)
def test_aggregation_golden(agg):
    assert aggregate(AGG_L, AGG_MASK, agg).item() == pytest.approx(AGG_EXPECTED[agg])
    lp = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(3, 3, dtype=torch.float64), -AGG_L, AGG_MASK, agg=agg)
    assert loss.item() == pytest.approx(AGG_EXPECTED[agg])


def test_aggregate_ignores_nonfinite_padding():
    x = AGG_L.clone()
    x[2] = float("nan")
    x[1, 1] = float("inf")
    for agg in AGG_MODES:
        assert aggregate(x, AGG_MASK, agg).item() == pytest.approx(AGG_EXPECTED[agg])


# keep vs zeroed: token losses 1,2,3,4 (r = 1, A = -l).
L4 = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)


def _onpolicy(n=4):
    return torch.zeros(1, n, dtype=torch.float64, requires_grad=True), torch.zeros(1, n, dtype=torch.float64)


def test_keep_vs_zeroed_counts_and_gradients():
    lp, old = _onpolicy()
    drop_last = torch.tensor([[T, T, T, F]])
    loss, met = policy_loss(lp, old, -L4, M4, keep=drop_last)
    assert loss.item() == pytest.approx((1 + 2 + 3) / 3)  # token leaves the count
    assert met["loss/counted_frac"] == pytest.approx(0.75)
    loss.backward()
    # d/dlogp of -A*r = l (r = 1), divided by the count 3; 0 on the dropped token.
    assert lp.grad.tolist()[0] == pytest.approx([1 / 3, 2 / 3, 3 / 3, 0.0])

    lp, old = _onpolicy()
    loss, met = policy_loss(lp, old, -L4, M4, zeroed=~drop_last)
    assert loss.item() == pytest.approx((1 + 2 + 3 + 0) / 4)  # token still counts
    assert met["loss/zeroed_frac"] == pytest.approx(0.25)
    assert met["loss/counted_frac"] == 1.0
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([1 / 4, 2 / 4, 3 / 4, 0.0])


def test_all_true_keep_and_all_false_zeroed_are_vanilla_exactly():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, generator=g, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    a = torch.randn(3, 1, generator=g, dtype=torch.float64)
    m = torch.rand(3, 5, generator=g) > 0.3
    for agg in AGG_MODES:
        base, _ = policy_loss(lp, old, a, m, agg=agg)
        k, _ = policy_loss(lp, old, a, m, agg=agg, keep=torch.ones_like(m))
        z, _ = policy_loss(lp, old, a, m, agg=agg, zeroed=torch.zeros_like(m))
        assert torch.equal(base, k) and torch.equal(base, z)


def test_kl_cov_term_golden():
    # logp - old = 0.1, -0.3; A = 1; no ratio clip; token 2 selected with coef 2.
    # loss = (-e^0.1 - e^-0.3 + 2*0.3) / 2; grad token 2 = (-e^-0.3 + 2*sign(-0.3)) / 2.
    lp = torch.tensor([[0.1, -0.3]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    sel = torch.tensor([[F, T]])
    loss, met = policy_loss(lp, old, torch.ones(1, 2), M4[:, :2], eps_low=None, eps_high=None,
                            kl_cov_select=sel, kl_cov_coef=2.0)
    assert loss.item() == pytest.approx((-math.exp(0.1) - math.exp(-0.3) + 0.6) / 2)
    assert met["loss/kl_cov"] == pytest.approx(0.3)
    assert met["control/kl_cov_selected_frac"] == pytest.approx(0.5)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-math.exp(0.1) / 2, (-math.exp(-0.3) - 2) / 2])


def test_kl_cov_has_no_effect_on_policy():
    # logp == old_logp: |logp - old| has zero gradient at 0 (papers.md, KL-Cov step 4).
    lp, old = _onpolicy()
    sel = torch.tensor([[T, F, T, F]])
    loss, _ = policy_loss(lp, old, -L4, M4, eps_low=None, eps_high=None, kl_cov_select=sel, kl_cov_coef=1.0)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    with pytest.raises(ValueError, match="kl_cov_select"):
        policy_loss(lp, old, -L4, M4, kl_cov_coef=1.0)


@pytest.mark.parametrize(
    "est, value, grad",
    [
        # logp = -1, ref = -1.5: x = ref - logp = -0.5.
        ("k1", 0.5, 1.0),  # k1 = logp - ref; d/dlogp = 1
        ("k2", 0.125, 0.5),  # x^2/2; d/dlogp = -x = 0.5
        ("k3", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),  # e^x - x - 1; d/dlogp = 1 - e^x
    ],
)
def test_ref_kl_estimators(est, value, grad):
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5]], dtype=torch.float64)
    assert kl_estimate(lp, ref, est).item() == pytest.approx(value)
    loss, met = policy_loss(lp, lp.detach(), torch.zeros(1, 1), M4[:, :1], ref_logp=ref, ref_kl_coef=0.1,
                            ref_kl_estimator=est)
    assert loss.item() == pytest.approx(0.1 * value)
    assert met["kl/ref"] == pytest.approx(value)
    assert met["loss/kl_ref"] == pytest.approx(0.1 * value)
    loss.backward()
    assert lp.grad.item() == pytest.approx(0.1 * grad)


def test_value_loss_is_the_masked_mean_squared_error():
    """(V - R)^2 over the valid tokens only: (0.5^2 + 2^2) / 2; padding (a huge error) does not count; no valid
    token gives 0, not NaN."""
    v = torch.tensor([[1.0, 3.0, 100.0]])
    ret = torch.tensor([[0.5, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    assert value_loss(v, ret, mask).item() == pytest.approx((0.25 + 4.0) / 2)
    assert value_loss(v, ret, torch.zeros_like(mask)).item() == 0.0


def test_approx_kl_is_k3_of_old_against_new():
    """k3 with log r = log pi - log pi_old: r - 1 - log r per token, averaged over the mask (null when empty)."""
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    new = torch.tensor([[-0.5, -2.5, 0.0]])
    mask = torch.tensor([[True, True, False]])
    want = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-0.5) - 1 + 0.5)) / 2
    assert approx_kl(new, old, mask) == pytest.approx(want, rel=1e-12)
    assert approx_kl(new, old, torch.zeros_like(mask)) is None


def test_entropy_bonus_gradient():
    lp, old = _onpolicy()
    ent = torch.tensor([[0.5, 1.0, 1.5, 2.0]], dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[T, T, T, F]])
    zeroed = torch.tensor([[F, T, F, F]])
    loss, met = policy_loss(lp, old, torch.zeros(1, 4), M4, keep=keep, zeroed=zeroed, entropy=ent,
                            entropy_coef=0.1)
    # counted tokens 0,1,2 (count 3); token 1 zeroed. Bonus = -0.1 * (0.5 + 1.5) / 3.
    assert loss.item() == pytest.approx(-0.1 * 2.0 / 3)
    assert met["loss/entropy_bonus"] == pytest.approx(-0.1 * 2.0 / 3)
    loss.backward()
    assert ent.grad.tolist()[0] == pytest.approx([-0.1 / 3, 0.0, -0.1 / 3, 0.0])


def test_nonfinite_padding_does_not_leak():
    lp = torch.tensor([[-1.0, float("nan")]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, float("-inf")]], dtype=torch.float64)
    ref = torch.tensor([[-0.8, float("inf")]], dtype=torch.float64)
    ent = torch.tensor([[0.7, float("nan")]], dtype=torch.float64, requires_grad=True)
    m = torch.tensor([[T, F]])
    loss, met = policy_loss(lp, old, torch.ones(1, 1), m, ref_logp=ref, ref_kl_coef=0.1, entropy=ent,
                            entropy_coef=0.01, kl_cov_select=m, kl_cov_coef=1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and torch.isfinite(ent.grad).all()
    assert lp.grad[0, 1] == 0 and ent.grad[0, 1] == 0
    assert all(v is None or math.isfinite(v) for v in met.values())


def test_empty_mask_gives_zero_loss_and_none_metrics():
    lp, old = _onpolicy()
    loss, met = policy_loss(lp, old, torch.ones(1, 4), torch.zeros(1, 4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum() == 0
    assert met["loss/pg"] is None and met["ratio/mean"] is None and met["clip/ratio_frac"] is None


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"agg": "mean"}, "agg"),
        ({"eps_low": -0.1}, "eps_low"),
        ({"eps_high": "x"}, "eps_high"),
        ({"keep": torch.ones(1, 3, dtype=torch.bool)}, "keep"),
        ({"zeroed": torch.ones(1, 4)}, "zeroed"),
        ({"ref_kl_coef": 0.1}, "ref_logp"),
        ({"ref_logp": torch.zeros(1, 4), "ref_kl_estimator": "k4"}, "ref_kl_estimator"),
        ({"entropy_coef": 0.1}, "entropy"),
    ],
)
def test_policy_loss_validation(kwargs, name):
    lp, old = _onpolicy()
    with pytest.raises(ValueError, match=name):
        policy_loss(lp, old, torch.ones(1, 4), M4, **kwargs)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, torch.ones(4), M4)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(lp, old[:, :2], torch.ones(1, 4), M4)


# ----------------------------------------------------------- independent naive per-token reference
def _naive(lp, old, adv, mask, keep, zeroed, eps_low, eps_high, dual, agg, sel, kcoef, ref, rcoef, ent, ecoef):
    """Python-float loop over tokens, written from DESIGN.md's text, with its own aggregation."""
    b_n, t_n = len(mask), len(mask[0])
    rows = []
    for b in range(b_n):
        row = []
        for t in range(t_n):
            if not mask[b][t] or not keep[b][t]:
                continue
            a = adv[b][t]
            r = math.exp(lp[b][t] - old[b][t])
            lo = -math.inf if eps_low is None else 1 - eps_low
            hi = math.inf if eps_high is None else 1 + eps_high
            loss = max(-a * r, -a * min(max(r, lo), hi))
            if dual is not None and a < 0:
                loss = min(loss, -a * dual)
            if sel[b][t]:
                loss += kcoef * abs(lp[b][t] - old[b][t])
            x = ref[b][t] - lp[b][t]
            loss += rcoef * (math.exp(x) - x - 1)
            loss -= ecoef * ent[b][t]
            row.append(0.0 if zeroed[b][t] else loss)
        rows.append(row)
    allv = [v for row in rows for v in row]
    if agg == "token-mean":
        return sum(allv) / len(allv)
    nonempty = [row for row in rows if row]
    if agg == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in nonempty) / len(nonempty)
    return sum(allv) / len(nonempty) / t_n


@pytest.mark.parametrize("seed", range(12))
def test_matches_naive_reference(seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 3, 5
    dd = torch.float64

    def rnd(scale=1.0):
        return scale * torch.randn(b, t, generator=g, dtype=dd)

    lp = rnd() - 1.0
    old = lp + rnd(0.4)
    adv = rnd() if seed % 2 else torch.randn(b, 1, generator=g, dtype=dd).expand(b, t)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0, 0] = True
    keep = torch.rand(b, t, generator=g) > 0.2
    keep[0, 0] = True
    zeroed = torch.rand(b, t, generator=g) > 0.8
    sel = torch.rand(b, t, generator=g) > 0.7
    ref = lp + rnd(0.3)
    ent = rnd().abs()
    eps_low, eps_high = [(0.2, 0.2), (0.2, 0.28), (None, None), (0.1, None)][seed % 4]
    dual = 3.0 if seed % 3 == 0 else None
    agg = AGG_MODES[seed % 3]
    kw = dict(keep=keep, zeroed=zeroed, eps_low=eps_low, eps_high=eps_high, dual_clip=dual, agg=agg,
              kl_cov_select=sel, kl_cov_coef=0.5, ref_logp=ref, ref_kl_coef=0.05, ref_kl_estimator="k3",
              entropy=ent, entropy_coef=0.01)
    loss, _ = policy_loss(lp, old, adv, mask, **kw)
    expected = _naive(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), keep.tolist(), zeroed.tolist(),
                      eps_low, eps_high, dual, agg, sel.tolist(), 0.5, ref.tolist(), 0.05, ent.tolist(), 0.01)
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_gradient_zero_exactly_on_clipped_dropped_zeroed(seed):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(4, 6, generator=g, dtype=torch.float64) - 1).requires_grad_(True)
    old = lp.detach() + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.2
    keep = torch.rand(4, 6, generator=g) > 0.3
    zeroed = torch.rand(4, 6, generator=g) > 0.7
    loss, _ = policy_loss(lp, old, adv, mask, keep=keep, zeroed=zeroed)
    loss.backward()
    clipped = ppo_clipped_mask(lp, old, adv, mask, 0.2, 0.2)
    dead = ~mask | ~keep | zeroed | clipped
    assert (lp.grad[dead] == 0).all()
    assert (lp.grad[~dead] != 0).all()
