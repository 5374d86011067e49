"""Golden, hand-computed cases for the mask functions and the quadrant lens (entropy_rft.control).

Every expected value below was worked out by hand in the comments; none is produced by the code under test.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from entropy_rft import control

T, F = True, False

# Shared 2x3 batch, last token of row 1 is padding (its value must never matter).
MASK = torch.tensor([[T, T, T], [T, T, F]])


def _b(rows):
    return torch.tensor(rows, dtype=torch.bool)


# --------------------------------------------------------------------------------------------- ClipB
# Valid S: 1, 2, 3, 4, 10 -> mean 4, deviations -3,-2,-1,0,6, squares 9+4+1+0+36 = 50,
# population var 10, std sqrt(10) = 3.1623. mu_low = 0.5 -> threshold -1.581: 1 and 2 violate.
# mu_high = 1.5 -> threshold 4.743: 10 violates.
S_B = torch.tensor([[1.0, 2.0, 3.0], [4.0, 10.0, 100.0]])
A_B = torch.tensor([[0.0, 1.0, 0.0], [-1.0, -1.0, 5.0]])


@pytest.mark.parametrize(
    "sign, expected",
    [
        ("any", [[F, F, T], [T, F, F]]),  # A == 0 token droppable under "any"
        ("negative", [[T, T, T], [T, F, F]]),  # only the A<0 violator (value 10) goes
        ("positive", [[T, F, T], [T, T, F]]),  # only the A>0 violator (value 2) goes
    ],
)
def test_clip_b_golden_two_sided(sign, expected):
    keep = control.clip_b_mask(S_B, A_B, MASK, 0.5, 1.5, sign)
    assert keep.dtype == torch.bool and keep.shape == MASK.shape
    assert keep.tolist() == expected


def test_clip_b_one_sided_and_unbounded_sides():
    assert control.clip_b_mask(S_B, A_B, MASK, None, 1.5, "any").tolist() == [[T, T, T], [T, F, F]]
    assert control.clip_b_mask(S_B, A_B, MASK, 0.5, None, "any").tolist() == [[F, F, T], [T, T, F]]
    assert control.clip_b_mask(S_B, A_B, MASK, None, None, "any").tolist() == MASK.tolist()


@pytest.mark.parametrize("adv", [torch.tensor([-1.0, 1.0]), torch.tensor([[-1.0], [1.0]])])
def test_clip_b_per_sequence_advantages(adv):
    # Row 0 negative: its violators 1 and 2 go. Row 1 positive: 10 is protected under "negative".
    keep = control.clip_b_mask(S_B, adv, MASK, 0.5, 1.5, "negative")
    assert keep.tolist() == [[F, F, T], [T, T, F]]


def test_clip_b_padding_never_enters_statistics():
    other = S_B.clone()
    other[1, 2] = -1e6
    a = control.clip_b_mask(S_B, A_B, MASK, 0.5, 1.5, "any")
    b = control.clip_b_mask(other, A_B, MASK, 0.5, 1.5, "any")
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------- ClipV
# Valid S_c: -3, 1, 2, 2, 3 -> mean 1, deviations -4,0,1,1,2, squares 16+0+1+1+4 = 22, var 4.4,
# std 2.0976. Uncentred rule with mu_high = 1: S_c > 2.0976 -> only 3 violates. A centred rule would
# compare the deviation 2 against 2.0976 and drop nothing: the test tells the two apart.
S_V = torch.tensor([[-3.0, 1.0, 2.0], [2.0, 3.0, 50.0]])


def test_clip_v_is_uncentred():
    keep = control.clip_v_mask(S_V, torch.ones(2, 3), MASK, None, 1.0, "any")
    assert keep.tolist() == [[T, T, T], [T, F, F]]
    # mu_low = 0.5: threshold -1.0488, only -3 violates.
    keep = control.clip_v_mask(S_V, -torch.ones(2, 3), MASK, 0.5, None, "negative")
    assert keep.tolist() == [[F, T, T], [T, T, F]]
    keep = control.clip_v_mask(S_V, torch.ones(2, 3), MASK, 0.5, None, "negative")
    assert keep.tolist() == MASK.tolist()


# Cap: 10 valid tokens S_c = -10,-8,-9,-7,5,5,5,5,5,9: sum 0, squares 100+64+81+49+125+81 = 500,
# var 50, std 7.0711. mu_low 0.9 -> threshold -6.364: -10,-8,-9,-7 violate. The -10 token has A>0,
# so under "negative" the violators are -8,-9,-7. max_frac 0.2 -> K = int(2.0) = 2: drop -9 and -8
# (farthest past). Capping before the sign restriction would have dropped -10,-9 and then only -9.
S_CAP = torch.tensor([[-10.0, -8.0, -9.0, -7.0, 5.0, 5.0], [5.0, 5.0, 5.0, 9.0, -1e6, 0.0]])
M_CAP = _b([[T] * 6, [T, T, T, T, F, F]])
A_CAP = torch.tensor([[1.0, -1.0, -1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]])


def test_clip_v_cap_after_sign_restriction_keeps_k_farthest():
    keep = control.clip_v_mask(S_CAP, A_CAP, M_CAP, 0.9, None, "negative", max_frac=0.2)
    dropped = (M_CAP & ~keep).nonzero().tolist()
    assert dropped == [[0, 1], [0, 2]]
    # Without the cap all three sign-allowed violators go; under "any" all four.
    keep = control.clip_v_mask(S_CAP, A_CAP, M_CAP, 0.9, None, "negative")
    assert (M_CAP & ~keep).nonzero().tolist() == [[0, 1], [0, 2], [0, 3]]
    keep = control.clip_v_mask(S_CAP, A_CAP, M_CAP, 0.9, None, "any")
    assert (M_CAP & ~keep).nonzero().tolist() == [[0, 0], [0, 1], [0, 2], [0, 3]]
    # A tiny cap still drops K = max(int(1e-4 * 10), 1) = 1 token: the farthest, -9.
    keep = control.clip_v_mask(S_CAP, A_CAP, M_CAP, 0.9, None, "negative", max_frac=1e-4)
    assert (M_CAP & ~keep).nonzero().tolist() == [[0, 2]]
    # A loose cap (K = 5 >= 3 violators) drops them all.
    keep = control.clip_v_mask(S_CAP, A_CAP, M_CAP, 0.9, None, "negative", max_frac=0.5)
    assert (M_CAP & ~keep).nonzero().tolist() == [[0, 1], [0, 2], [0, 3]]


def test_clip_v_zero_advantage_only_droppable_under_any():
    a = A_CAP.clone()
    a[0, 2] = 0.0  # the -9 token
    keep = control.clip_v_mask(S_CAP, a, M_CAP, 0.9, None, "negative")
    assert (M_CAP & ~keep).nonzero().tolist() == [[0, 1], [0, 3]]


def test_clip_v_released_rule_drops_zero_advantage_violators_outside_the_cap():
    """The authors' rule (advantage_sign "released", the default of method clip_v): A == 0 violators are
    dropped and take no cap slot; A < 0 violators are capped; A > 0 are kept."""
    a = A_CAP.clone()
    a[0, 2] = 0.0  # the -9 token: A == 0
    keep = control.clip_v_mask(S_CAP, a, M_CAP, 0.9, None, "released")
    assert (M_CAP & ~keep).nonzero().tolist() == [[0, 1], [0, 2], [0, 3]]
    # K = 1: the A < 0 violators -8 and -7 compete for it (-8 is farther); the A == 0 one goes anyway
    keep = control.clip_v_mask(S_CAP, a, M_CAP, 0.9, None, "released", max_frac=1e-4)
    assert (M_CAP & ~keep).nonzero().tolist() == [[0, 1], [0, 2]]
    # an all-A == 0 batch (every group's rewards equal): the strict rule drops nothing, the released one drops
    zero = torch.zeros_like(A_CAP)
    assert torch.equal(control.clip_v_mask(S_CAP, zero, M_CAP, 0.9, None, "negative", 1e-4), M_CAP)
    assert (M_CAP & ~control.clip_v_mask(S_CAP, zero, M_CAP, 0.9, None, "released", 1e-4)).sum() == 4
    assert control.build_method("clip_v").advantage_sign == "released"


def trinity_clipv_keep(s: Tensor, n: Tensor, adv: Tensor, mask: Tensor, mu: float, max_frac: float) -> Tensor:
    """A token-by-token transcription of Trinity-RFT's ``clipv_advantage.py`` (fork pan-x-c/Trinity-RFT @
    e8be7740, lines 78-127): xD = N - S uncentred against mu times its population std; A > 0 kept; the cap
    first tests the fraction of all violators, then counts only A < 0 ones, restores them and re-clips the
    top-k by xD."""
    xd = n - s
    valid = mask > 0
    vals = xd[valid]
    std = ((vals - vals.mean()) ** 2).mean().sqrt()
    if std < 1e-12:
        return valid.clone()
    keep_neg = xd <= mu * std
    keep = torch.where(adv > 0, torch.ones_like(keep_neg), keep_neg) & valid
    total = int(valid.sum())
    clipped = valid & ~keep
    if int(clipped.sum()) / total <= max_frac:
        return keep
    cap = max(int(max_frac * total), 1)
    neg = clipped & (adv < 0)
    if int(neg.sum()) <= cap:
        return keep
    final = keep.clone()
    final[neg] = True
    idx = neg.nonzero()
    top = torch.topk(xd[neg], cap).indices
    final[tuple(idx[top].T)] = False
    return final


@pytest.mark.parametrize("seed", range(6))
def test_clip_v_released_rule_equals_the_authors_code(seed):
    """Random batches with groups of equal rewards (A == 0 rows), padding and caps that bind and that do not:
    the mask of method clip_v is the released code's, token for token."""
    g = torch.Generator().manual_seed(seed)
    b, t = 16, 12
    s = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    n = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1
    s[torch.rand(b, t, generator=g) < 0.05] -= 3.0  # a few far violators
    mask = torch.arange(t)[None, :] < torch.randint(3, t + 1, (b, 1), generator=g)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    adv[torch.rand(b, generator=g) < 0.4] = 0.0  # groups whose rewards were all equal
    adv = adv[:, None].expand(b, t)
    for mu, max_frac in ((1.0, 1e-4), (1.0, 0.05), (0.5, 0.5), (2.0, 0.02)):
        m = control.build_method("clip_v", mu=mu, max_frac=max_frac)
        ours = m.rollout_masks(SimpleNamespace(s_centered=s - n), adv, mask).keep
        want = trinity_clipv_keep(s, n, adv, mask, mu, max_frac)
        assert torch.equal(ours, want), (seed, mu, max_frac)
    assert ((adv == 0) & mask & ~ours).any() or ((adv == 0) & mask & ~want).sum() == 0


def test_clip_b_keeps_zero_advantage_tokens_as_released():
    """Trinity-RFT's clipb_advantage.py keeps A == 0 tokens (keep_zero = ones): so does method clip_b."""
    s = torch.tensor([[-5.0, 0.1, 0.2, 0.0, 0.1, 0.2]])
    m = torch.ones(1, 6, dtype=torch.bool)
    for adv, dropped in ((0.0, 0), (-1.0, 1)):
        keep = control.build_method("clip_b", mu=1.0).rollout_masks(
            SimpleNamespace(s_star=s), torch.full((1, 6), adv), m).keep
        assert int((m & ~keep).sum()) == dropped


# ----------------------------------------------------------------------------------- Clip-Cov, KL-Cov
# logp valid -1,-2,-3 (row 0, A=+2) and -4,-5 (row 1, A=-3); padding logp 100.
# mean logp = -3; token-weighted mean A = (3*2 - 2*3)/5 = 0.
# cov = (2)(2)=4, (1)(2)=2, (0)(2)=0, (-1)(-3)=3, (-2)(-3)=6.
LP = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 100.0]])
A_COV = torch.tensor([2.0, -3.0])
CANDIDATES = {(0, 0), (0, 1), (1, 0)}  # 1 < cov < 5: covs 4, 2, 3


def _dropped(keep, mask=MASK):
    return {tuple(x) for x in (mask & ~keep).nonzero().tolist()}


def test_clip_cov_candidates_and_counts():
    # ratio 1 -> K = 5 > 3 candidates: all candidates go.
    assert _dropped(control.clip_cov_mask(LP, A_COV, MASK, 1.0, 1.0, 5.0)) == CANDIDATES
    # ratio 0.1 -> int(0.5) = 0 -> max(., 1) = 1 token, one of the candidates.
    g = torch.Generator().manual_seed(0)
    d = _dropped(control.clip_cov_mask(LP, A_COV, MASK, 0.1, 1.0, 5.0, generator=g))
    assert len(d) == 1 and d <= CANDIDATES
    # ratio 0.4 -> int(2.0) = 2 of the 3.
    g = torch.Generator().manual_seed(0)
    d = _dropped(control.clip_cov_mask(LP, A_COV, MASK, 0.4, 1.0, 5.0, generator=g))
    assert len(d) == 2 and d <= CANDIDATES
    # exclude removes candidates (cov 4 token), ub is exclusive (cov 6 excluded only when ub <= 6).
    ex = _b([[T, F, F], [F, F, F]])
    assert _dropped(control.clip_cov_mask(LP, A_COV, MASK, 1.0, 1.0, 5.0, exclude=ex)) == {(0, 1), (1, 0)}
    assert _dropped(control.clip_cov_mask(LP, A_COV, MASK, 1.0, 3.0, 6.0)) == {(0, 0)}
    assert _dropped(control.clip_cov_mask(LP, A_COV, MASK, 1.0, 2.0, 6.5)) == {(0, 0), (1, 0), (1, 1)}


def test_clip_cov_ratio_zero_drops_nothing():
    assert torch.equal(control.clip_cov_mask(LP, A_COV, MASK, 0.0, 1.0, 5.0), MASK)


def test_clip_cov_random_but_seeded():
    picks = []
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        a = control.clip_cov_mask(LP, A_COV, MASK, 0.1, 1.0, 5.0, generator=g)
        g = torch.Generator().manual_seed(seed)
        b = control.clip_cov_mask(LP, A_COV, MASK, 0.1, 1.0, 5.0, generator=g)
        assert torch.equal(a, b)
        picks.append(next(iter(_dropped(a))))
    # Random, not top-k: over 30 seeds every candidate is picked at least once.
    assert set(picks) == CANDIDATES


def test_clip_cov_detaches_logp():
    lp = LP.clone().requires_grad_(True)
    keep = control.clip_cov_mask(lp, A_COV, MASK, 1.0, 1.0, 5.0)
    assert not keep.requires_grad


def test_kl_cov_select_top_k():
    # Ordered covs: 6 (1,1), 4 (0,0), 3 (1,0), 2 (0,1), 0 (0,2).
    assert control.kl_cov_select(LP, A_COV, MASK, 0.2).nonzero().tolist() == [[1, 1]]
    assert control.kl_cov_select(LP, A_COV, MASK, 0.4).nonzero().tolist() == [[0, 0], [1, 1]]
    assert control.kl_cov_select(LP, A_COV, MASK, 0.01).nonzero().tolist() == [[1, 1]]  # max(., 1)
    assert control.kl_cov_select(LP, A_COV, MASK, 1.0).tolist() == MASK.tolist()  # never padding
    assert not control.kl_cov_select(LP, A_COV, MASK, 0.0).any()


# ------------------------------------------------------------------------------------- high entropy
ENT = torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.7, 5.0]])


@pytest.mark.parametrize(
    "q, expected",
    [
        (0.2, [[F, F, F], [T, F, F]]),  # k = 1
        (0.4, [[F, F, F], [T, T, F]]),  # k = 2
        (0.5, [[F, T, F], [T, T, F]]),  # k = round-half-up(2.5) = 3
        (1.0, [[T, T, T], [T, T, F]]),
        (0.0, [[F, F, F], [F, F, F]]),
    ],
)
def test_high_entropy_mask(q, expected):
    assert control.high_entropy_mask(ENT, MASK, q).tolist() == expected


# ------------------------------------------------------------------------------------------ grad_mask
S_G = torch.tensor([[0.5, -0.2, 0.0], [0.3, -0.4, 7.0]])
A_G = torch.tensor([1.0, -1.0])


@pytest.mark.parametrize(
    "sample_sign, s_sign, expected",
    [
        ("positive", "positive", [[T, F, F], [F, F, F]]),
        ("positive", "negative", [[F, T, F], [F, F, F]]),
        ("negative", "positive", [[F, F, F], [T, F, F]]),
        ("negative", "negative", [[F, F, F], [F, T, F]]),
    ],
)
def test_grad_mask_four_conditions(sample_sign, s_sign, expected):
    assert control.grad_mask(S_G, A_G, MASK, sample_sign, s_sign).tolist() == expected


def test_grad_mask_keep_other_samples():
    keep = control.grad_mask(S_G, A_G, MASK, "positive", "positive", drop_other_samples=False)
    assert keep.tolist() == [[T, F, F], [T, T, F]]


# ------------------------------------------------------------------------------ shared properties
def _random_batch(seed, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.3
    s = torch.randn(b, t, generator=g)
    adv = torch.randint(-1, 2, (b, t), generator=g).to(torch.float32)
    return mask, s, adv


def _all_masks(s, adv, mask, generator):
    return [
        control.clip_b_mask(s, adv, mask, 0.3, 0.3, "any"),
        control.clip_v_mask(s, adv, mask, 0.3, 0.3, "any", max_frac=0.1),
        control.clip_cov_mask(s, adv, mask, 0.3, -1.0, 1.0, generator=generator),
        control.kl_cov_select(s, adv, mask, 0.3),
        control.high_entropy_mask(s, mask, 0.5),
        control.grad_mask(s, adv, mask, "negative", "negative", drop_other_samples=False),
    ]


@pytest.mark.parametrize("seed", range(5))
def test_padding_never_kept_or_selected_and_never_matters(seed):
    mask, s, adv = _random_batch(seed)
    garbage = torch.where(mask, s, torch.full_like(s, 1e9))
    a = _all_masks(s, adv, mask, torch.Generator().manual_seed(1))
    b = _all_masks(garbage, adv, mask, torch.Generator().manual_seed(1))
    for x, y in zip(a, b, strict=True):
        assert x.dtype == torch.bool and x.shape == mask.shape
        assert not (x & ~mask).any()
        assert torch.equal(x, y)


@pytest.mark.parametrize("seed", range(3))
def test_huge_mu_keeps_every_valid_token(seed):
    mask, s, adv = _random_batch(seed)
    assert torch.equal(control.clip_b_mask(s, adv, mask, 1e9, 1e9, "any"), mask)
    assert torch.equal(control.clip_v_mask(s, adv, mask, 1e9, 1e9, "any", max_frac=0.5), mask)


def test_empty_mask():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    s = torch.randn(2, 3)
    for x in _all_masks(s, torch.ones(2, 3), mask, None):
        assert not x.any()


# ------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: control.clip_b_mask(S_B, A_B, MASK, -1.0, None, "any"), "mu_low"),
        (lambda: control.clip_b_mask(S_B, A_B, MASK, None, -0.1, "any"), "mu_high"),
        (lambda: control.clip_b_mask(S_B, A_B, MASK, 1.0, 1.0, "neg"), "advantage_sign"),
        (lambda: control.clip_b_mask(S_B[:, :2], A_B, MASK, 1.0, 1.0, "any"), "s_star"),
        (lambda: control.clip_b_mask(S_B, torch.ones(3), MASK, 1.0, 1.0, "any"), "advantages"),
        (lambda: control.clip_b_mask(S_B, A_B, MASK.float(), 1.0, 1.0, "any"), "mask"),
        (lambda: control.clip_v_mask(S_V, A_B, MASK, 1.0, 1.0, "any", max_frac=2.0), "max_frac"),
        (lambda: control.clip_v_mask(S_V[0], A_B, MASK, 1.0, 1.0, "any"), "s_centered"),
        (lambda: control.clip_cov_mask(LP, A_COV, MASK, 1.5, 1.0, 5.0), "ratio"),
        (lambda: control.clip_cov_mask(LP, A_COV, MASK, -0.1, 1.0, 5.0), "ratio"),
        (lambda: control.clip_cov_mask(LP, A_COV, MASK, 0.1, 5.0, 5.0), "lb"),
        (lambda: control.clip_cov_mask(LP, A_COV, MASK, 0.1, 1.0, 5.0, exclude=MASK[0]), "exclude"),
        (lambda: control.kl_cov_select(LP, A_COV, MASK, 2.0), "ratio"),
        (lambda: control.high_entropy_mask(ENT, MASK, 1.2), "top_q"),
        (lambda: control.grad_mask(S_G, A_G, MASK, "any", "positive"), "sample_sign"),
        (lambda: control.grad_mask(S_G, A_G, MASK, "positive", "zero"), "s_sign"),
    ],
)
def test_validation_names_the_parameter(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# ------------------------------------------------------------------------------------------- lens
# A per sequence (2, -1); S_c row 0: 0.5, -0.25, 0.1; row 1: 0.4, -0.2 (+ padding 9).
# token-mean w = 1/5; contribution -w*A*S_c: -0.2, 0.1, -0.04 | 0.08, -0.04 -> total -0.1.
# keep drops (0,0) [pos_spos, -0.2] and (1,1) [neg_sneg, -0.04] -> dropped -0.24, kept 0.14.
A_L = torch.tensor([2.0, -1.0])
SC_L = torch.tensor([[0.5, -0.25, 0.1], [0.4, -0.2, 9.0]])
KEEP_L = _b([[F, T, T], [T, F, T]])  # the True on padding must not matter


def test_lens_golden_token_mean():
    out = control.lens_attribution(KEEP_L, A_L, SC_L, MASK)
    assert out["lens/drop_frac"] == pytest.approx(2 / 5)
    assert out["lens/drop_frac/pos_spos"] == pytest.approx(1 / 5)
    assert out["lens/drop_frac/neg_sneg"] == pytest.approx(1 / 5)
    assert out["lens/drop_frac/pos_sneg"] == 0 and out["lens/drop_frac/neg_spos"] == 0
    assert out["lens/drop_frac/zero"] == 0
    assert out["lens/drop_rate/pos_spos"] == pytest.approx(1 / 2)  # (0,0) and (0,2) are pos_spos
    assert out["lens/drop_rate/neg_sneg"] == pytest.approx(1.0)
    assert out["lens/drop_rate/zero"] is None  # empty bucket
    assert out["lens/dH_total"] == pytest.approx(-0.1)
    assert out["lens/dH_dropped"] == pytest.approx(-0.24)
    assert out["lens/dH_kept"] == pytest.approx(0.14)
    assert out["lens/dH_dropped/pos_spos"] == pytest.approx(-0.2)
    assert out["lens/dH_dropped/neg_sneg"] == pytest.approx(-0.04)


def test_lens_ratio_clipped_and_agg():
    ratio = torch.full((2, 3), 1.5)
    clipped = _b([[T, F, F], [F, F, F]])
    out = control.lens_attribution(KEEP_L, A_L, SC_L, MASK, ratio=ratio, clipped=clipped)
    # (0,0) carries 0; (1,1) carries 1.5 * -0.04; total 1.5 * (-0.1 + 0.2).
    assert out["lens/dH_dropped"] == pytest.approx(-0.06)
    assert out["lens/dH_total"] == pytest.approx(0.15)
    # seq-mean-token-mean: w = 1/6 in row 0, 1/4 in row 1.
    out = control.lens_attribution(KEEP_L, A_L, SC_L, MASK, agg="seq-mean-token-mean")
    assert out["lens/dH_dropped"] == pytest.approx(-2 * 0.5 / 6 + (-0.2) / 4)
    row0 = -2 * (0.5 - 0.25 + 0.1) / 6
    row1 = (0.4 - 0.2) / 4
    assert out["lens/dH_total"] == pytest.approx(row0 + row1)
    # seq-mean-token-sum-norm: w = 1/(2*3) everywhere.
    out = control.lens_attribution(KEEP_L, A_L, SC_L, MASK, agg="seq-mean-token-sum-norm")
    assert out["lens/dH_total"] == pytest.approx((-2 * 0.35 + 0.2) / 6)


@pytest.mark.parametrize("seed", range(5))
def test_lens_quadrants_sum_to_total(seed):
    mask, s, adv = _random_batch(seed, b=5, t=9)
    keep = torch.rand(5, 9, generator=torch.Generator().manual_seed(seed + 100)) > 0.5
    out = control.lens_attribution(keep, adv, s, mask, ratio=torch.rand(5, 9) + 0.5)
    qs = control.QUADRANTS
    assert set(qs) == {"pos_spos", "pos_sneg", "neg_spos", "neg_sneg", "zero"}
    assert sum(out[f"lens/drop_frac/{q}"] for q in qs) == pytest.approx(out["lens/drop_frac"])
    assert sum(out[f"lens/dH_dropped/{q}"] for q in qs) == pytest.approx(out["lens/dH_dropped"])
    assert out["lens/dH_dropped"] + out["lens/dH_kept"] == pytest.approx(out["lens/dH_total"])
    n = int(mask.sum())
    assert out["lens/drop_frac"] == pytest.approx(int((mask & ~keep).sum()) / n)


def test_lens_released_clip_v_drops_only_entropy_lowering_penalties():
    # Theorem 3.3: A<0 and S_c<0 gives dH = -w*A*S_c < 0; the one-sided rule drops exactly those.
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(8, 16, generator=g) > 0.2
    sc = torch.randn(8, 16, generator=g)
    adv = torch.randn(8, 1, generator=g)
    keep = control.clip_v_mask(sc, adv, mask, 1.0, None, "negative")
    out = control.lens_attribution(keep, adv, sc, mask)
    assert out["lens/drop_frac"] > 0
    assert out["lens/drop_frac/neg_sneg"] == pytest.approx(out["lens/drop_frac"])
    assert out["lens/dH_dropped"] < 0
    assert out["lens/dH_kept"] > out["lens/dH_total"]


def test_lens_zero_bucket_and_empty():
    adv = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    keep = _b([[F, T, T], [T, T, T]])
    out = control.lens_attribution(keep, adv, SC_L, MASK)
    assert out["lens/drop_frac/zero"] == pytest.approx(1 / 5)
    assert out["lens/drop_rate/zero"] == pytest.approx(1 / 2)
    assert out["lens/dH_dropped"] == 0
    empty = control.lens_attribution(keep, adv, SC_L, torch.zeros(2, 3, dtype=torch.bool))
    assert all(v is None for v in empty.values())


def test_lens_on_ppo_clipping_as_diagnostic():
    from entropy_rft.core.loss import ppo_clipped_mask

    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5], [0.5, 1.5, 1.0]]))
    clipped = ppo_clipped_mask(logp, old, A_L, MASK, 0.2, 0.2)
    # row 0 (A>0): r=1.5 clipped; row 1 (A<0): r=0.5 clipped.
    assert clipped.tolist() == [[T, F, F], [T, F, F]]
    out = control.lens_attribution(~clipped, A_L, SC_L, MASK, ratio=torch.exp(logp - old))
    assert out["lens/dH_dropped"] == pytest.approx(-0.2 * 1.5 + 0.08 * 0.5)
    assert not math.isnan(out["lens/dH_kept"])
