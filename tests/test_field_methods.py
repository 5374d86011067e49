"""The field's entropy methods of issue 28 (entropy_adv, adaptive_entropy, ce_gppo, clip_low, entropic):
hand-computed cases, peer tests against TRL 1.16's adaptive-entropy rule, Skywork-OR1's own controller, the
CE-GPPO authors' loss and the EntroPIC authors' code, the weight lens (its terms sum to the total first-order
ΔH), the old lens numbers bit for bit, and one tiny training step of each with the counterfactual probe."""

from __future__ import annotations

import inspect
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from entropy_rft import control
from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import load_config
from entropy_rft.control.builtins import adaptive_entropy_step, entropic_step, entropy_advantage_shift
from entropy_rft.core.loss import agg_weights, policy_loss, ppo_clipped_mask
from entropy_rft.core.loss_types import LossSettings
from entropy_rft.core.theory import first_order_entropy_change
from entropy_rft.launch.run import start
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.training.step_log import lens_metrics
from micro import make_micro_policy, micro_overrides

NEW = ("entropy_adv", "adaptive_entropy", "ce_gppo", "clip_low", "entropic")
DATA = Path(__file__).resolve().parent / "data"


def grad_coef(logp, old, adv, mask, **kw):
    """g = −∂L/∂logp by autograd, float64 (test's own, not control.gradient_coefficients)."""
    lp = logp.detach().double().requires_grad_(True)
    loss, _ = policy_loss(lp, old.double(), adv, mask, **kw)
    loss.backward()
    return -lp.grad


# ----------------------------------------------------------------------------- hand-computed cases


def test_entropy_advantage_shift_by_hand():
    h = torch.tensor([[1.0, 0.1, 2.0, 3.0]])
    a = torch.tensor([[1.0, -1.0, 0.5, 0.0]])
    mask = torch.tensor([[True, True, True, True]])
    psi = entropy_advantage_shift(h, a, mask, 0.4, 2.0)
    # min(0.4·1, 1/2), min(0.4·0.1, 1/2), min(0.4·2, 0.5/2), min(1.2, 0) (A = 0: nothing)
    assert psi.flatten().tolist() == pytest.approx([0.4, 0.04, 0.25, 0.0])
    # through the loss: token-mean over 4, on-policy: g = (A + ψ)/4; the sign of A is kept (kappa > 1)
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3]]))
    g = grad_coef(lp, lp, a, mask, adv_shift=psi)
    assert g.flatten().tolist() == pytest.approx([1.4 / 4, -0.96 / 4, 0.75 / 4, 0.0])
    m = control.build_method("entropy_adv")
    stats = NS(entropy=h)
    assert torch.equal(m.rollout_masks(stats, a, mask).adv_shift, psi)
    with pytest.raises(ValueError, match="kappa"):
        control.build_method("entropy_adv", kappa=1.0)


def test_adaptive_entropy_step_by_hand():
    # previous entropy inf (> target): nothing applied; entropy 0.1 <= 0.2: coefficient up by delta
    assert adaptive_entropy_step(0.01, math.inf, 0.1, 0.2, 0.005, 0.0, 1.0) == (0.0, pytest.approx(0.015))
    assert adaptive_entropy_step(0.015, 0.1, 0.3, 0.2, 0.005, 0.0, 1.0) == (0.015, pytest.approx(0.01))
    assert adaptive_entropy_step(0.002, 0.3, 0.3, 0.2, 0.005, 0.0, 1.0) == (0.0, 0.0)  # clamped at coef_min
    assert adaptive_entropy_step(0.999, 0.1, 0.1, 0.2, 0.005, 0.0, 1.0)[1] == 1.0  # clamped at coef_max


def test_ce_gppo_by_hand():
    # tokens: A>0 r=1.5 (past 1+0.2), A<0 r=0.5 (below 1-0.2), A>0 r=1.1 (inside), A<0 r=1.5 (PPO keeps it)
    old = torch.zeros(1, 4)
    r = torch.tensor([[1.5, 0.5, 1.1, 1.5]])
    lp = torch.log(r)
    a = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    kw = dict(eps_low=0.2, eps_high=0.2)
    ppo = grad_coef(lp, old, a, mask, **kw)
    assert ppo.flatten().tolist() == pytest.approx([0.0, 0.0, 2.0 * 1.1 / 4, -1.5 / 4])
    g = grad_coef(lp, old, a, mask, ce_beta_low=0.5, ce_beta_high=1.0, **kw)
    # clipped tokens: beta·bound·A (no r): 1·1.2·1, 0.5·0.8·(−1); the others as PPO
    assert g.flatten().tolist() == pytest.approx([1.2 / 4, -0.4 / 4, 2.2 / 4, -1.5 / 4])
    l_ppo, m_ppo = policy_loss(lp, old, a, mask, **kw)
    l_ce, m_ce = policy_loss(lp, old, a, mask, ce_beta_low=0.5, ce_beta_high=1.0, **kw)
    assert float(l_ce) == float(l_ppo)  # PPO's clipped value is kept as the forward value
    assert m_ce["clip/ce_frac"] == 0.5 and "clip/ce_frac" not in m_ppo
    # beta = 0 is PPO, bit for bit, in value and gradient
    g0 = grad_coef(lp, old, a, mask, ce_beta_low=0.0, ce_beta_high=0.0, **kw)
    assert torch.equal(g0, ppo)
    assert control.build_method("ce_gppo").loss_kwargs() == {"ce_beta_low": 0.75, "ce_beta_high": 1.0}


def test_clip_low_by_hand():
    m = control.build_method("clip_low")
    assert m.loss_kwargs() == {"eps_low": 0.1, "eps_high": 0.2}
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[0.85, 0.95]]))  # A<0 tokens whose probability fell by 15% and 5%
    a = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert ppo_clipped_mask(lp, old, a, mask, 0.1, 0.2).tolist() == [[True, False]]  # r 0.85 < 0.9
    assert ppo_clipped_mask(lp, old, a, mask, 0.2, 0.2).tolist() == [[False, False]]
    with pytest.raises(ValueError, match=r"eps_low must be in \[0, 1\) \(r >= 1 - eps_low > 0\), got 1.0"):
        control.build_method("clip_low", eps_low=1.0)


def test_entropic_by_hand():
    # token-mean over 4; selected (p > 0.95): tokens 0 (A>0) and 2 (A<0); alpha 0.5, on-policy
    p = torch.tensor([[0.99, 0.5, 0.99, 0.5]])
    lp = torch.log(p)
    a = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    sel = lp > math.log(0.95)
    g = grad_coef(lp, lp, a, mask, weight_select=sel, weight_alpha=0.5)
    # g = A/4 + alpha·|A|/2 on the two selected tokens
    assert g.flatten().tolist() == pytest.approx([0.25 + 0.25, 0.25, -0.25 + 0.25, -0.25])
    loss, met = policy_loss(lp, lp, a, mask, weight_select=sel, weight_alpha=0.5)
    assert met["loss/weight_adjust"] == pytest.approx(-0.5) and met["control/weight_selected_frac"] == 0.5
    assert float(loss) == pytest.approx(0.0 - 0.5)
    # the PI law: e = h − target; alpha = clip(kp·e + ki·I_prev, −1, 1); I += e
    assert entropic_step(1.2, 1.0, 0.0, 1.0, 0.01) == (pytest.approx(0.2), pytest.approx(0.2))
    assert entropic_step(0.9, 1.0, 0.2, 1.0, 0.01) == (pytest.approx(-0.1 + 0.002), pytest.approx(0.1))
    assert entropic_step(9.0, 1.0, 0.0, 1.0, 0.01)[0] == 1.0  # clipped
    m = control.build_method("entropic", alpha=0.25)
    assert m.get_knob() == 1.25 and m.loss_kwargs() == {"weight_alpha": 0.25}
    m.set_knob(0.5)
    assert m.alpha == -0.5
    with pytest.raises(ValueError, match="alpha must be in"):
        m.set_knob(2.5)
    assert m.alpha == -0.5  # restored


def test_methods_registered_with_paper_knob_direction_and_quadrants():
    want = {"entropy_adv": ("alpha", 1, "2506.14758"), "adaptive_entropy": ("coef", 1, "2505.22312"),
            "ce_gppo": ("beta_high", 1, "2509.20712"), "clip_low": ("eps_low", -1, "2509.26114"),
            "entropic": ("pos_weight", -1, "2511.15248")}
    for name, (knob, d, arxiv) in want.items():
        info = control.method_info(name)
        assert (info["knob"], info["knob_raises_entropy"]) == (knob, d)
        assert arxiv in info["paper"]
        assert any(e != "-" for e in info["quadrants"].values()), name
    assert "reweights" in control.method_info("entropic")["quadrants"]["pos_spos"]
    assert "adds gradient" in control.method_info("ce_gppo")["quadrants"]["neg_sneg"]
    assert "changes the clip" in control.method_info("clip_low")["quadrants"]["neg_sneg"]
    assert "drops" in control.method_info("clip_v")["quadrants"]["neg_sneg"]
    with pytest.raises(ValueError, match="unknown quadrant"):
        control.quadrant_effects({"sideways": "x"})


# ----------------------------------------------------------------------------- peer: TRL 1.16


def _trl_rule_source() -> str:
    from trl import GRPOTrainer

    return re.sub(r"\s+", " ", inspect.getsource(GRPOTrainer._compute_loss) + inspect.getsource(
        GRPOTrainer.__init__))


def trl_adaptive_reference(entropies, coef, target, delta, cmin, cmax):
    """TRL 1.16's adaptive entropy rule, replicated from GRPOTrainer (``__init__`` sets _last_world_entropy =
    inf; ``_compute_loss``: apply_coef = coef if last <= target else 0, then coef ± delta clamped, last = H).
    It is inline in ``_compute_loss`` (it needs a model forward), so it is not callable on its own;
    ``test_trl_source_still_has_the_replicated_rule`` checks that the installed TRL still has these lines."""
    last, applied, coefs = float("inf"), [], []
    for world_entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        if world_entropy <= target:  # noqa: SIM108  (TRL's own if/else, kept as written)
            coef = min(coef + delta, cmax)
        else:
            coef = max(coef - delta, cmin)
        last = world_entropy
        coefs.append(coef)
    return applied, coefs


def test_trl_source_still_has_the_replicated_rule():
    src = _trl_rule_source()
    for line in ("self._last_world_entropy = float(\"inf\")",
                 "apply_coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0",
                 "if world_entropy <= self.args.entropy_target: self.entropy_coef = min( self.entropy_coef + "
                 "self.args.entropy_coef_delta, self.args.entropy_coef_max )",
                 "self.entropy_coef = max( self.entropy_coef - self.args.entropy_coef_delta, "
                 "self.args.entropy_coef_min )",
                 "self._last_world_entropy = world_entropy",
                 "loss = loss - apply_coef * entropy_loss"):
        assert line in src, line


def test_adaptive_entropy_gives_trls_coefficient_sequence():
    g = torch.Generator().manual_seed(3)
    seq = (0.2 + 0.15 * torch.randn(40, generator=g, dtype=torch.float64)).tolist()  # around the target
    seq[5:9] = [0.2, 0.2, 0.2, 0.2]  # ties: "<=" counts as below
    want_applied, want_coef = trl_adaptive_reference(seq, 0.01, 0.2, 0.005, 0.0, 0.05)
    m = control.build_method("adaptive_entropy", coef=0.01, target=0.2, delta=0.005, coef_min=0.0, coef_max=0.05)
    mask = torch.ones(1, 1, dtype=torch.bool)
    applied, coefs = [], []
    for h in seq:  # a batch whose token-mean entropy is h (one token: the mean is h exactly, ties stay ties)
        m.observe(NS(entropy=torch.tensor([[h]], dtype=torch.float64)), mask, "token-mean")
        applied.append(m.loss_kwargs()["entropy_coef"])
        coefs.append(m.coef)
    assert applied == want_applied and coefs == want_coef
    assert 0.0 in applied and 0.05 in coefs and len(set(coefs)) > 5  # gating, clamping and motion all happen
    # a wrong rule (no gating by the previous entropy) gives a different sequence
    assert applied != [0.01] + want_coef[:-1]


# ----------------------------------------------------------------------------- peer: EntroPIC's code


def _masked_mean(x, m):
    return (x * m).sum() / m.sum()


def authors_entropic_loss(old_log_prob, log_prob, advantages, response_mask, alpha, clip_low, clip_high,
                          clip_c=3.0, thresh=0.95):
    """``compute_policy_loss_entropic`` of github.com/yk7333/EntroPIC (core_algos.py, commit 2470730), token-mean:
    vanilla PPO with dual clip c, plus alpha·mean over {p > thresh}(−ratio·|A|). Written from reading it."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(pg1, pg2)
    clip2 = torch.min(-advantages * clip_c, clip1)
    pg = torch.where(advantages < 0, clip2, clip1)
    loss = _masked_mean(pg, response_mask)
    prob_mask = response_mask * (log_prob > math.log(thresh))
    return loss + alpha * _masked_mean(-ratio * advantages.abs(), prob_mask)


def authors_alpha_sequence(entropies, target, kp, ki):
    """The control law of the authors' dp_actor.py (update_policy), one micro-batch per minibatch: alpha from
    the integral before this step's error; then accumulate += error · (micro size / minibatch size = 1)."""
    acc, out = 0.0, []
    for h in entropies:
        a = acc * ki + (h - target) * kp
        out.append(min(1.0, max(-1.0, a)))
        acc += (h - target) * 1.0
    return out


def test_entropic_loss_matches_the_authors_code():
    g = torch.Generator().manual_seed(1)
    b, t = 6, 8
    mask = torch.rand(b, t, generator=g) > 0.2
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t) * mask
    old = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64) * 0.08 + 0.92)  # many p > 0.95
    logp = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    logp = torch.minimum(logp, torch.zeros_like(logp))
    sel = mask & (logp > math.log(0.95))
    assert 0 < int(sel.sum()) < int(mask.sum())
    for alpha in (0.3, -0.7):
        ours_lp = logp.clone().requires_grad_(True)
        ours, _ = policy_loss(ours_lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                              weight_select=sel, weight_alpha=alpha)
        ours.backward()
        ref_lp = logp.clone().requires_grad_(True)
        ref = authors_entropic_loss(old, ref_lp, adv, mask.double(), alpha, 0.2, 0.28)
        ref.backward()
        assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-12, abs=1e-12)
        torch.testing.assert_close(ours_lp.grad, ref_lp.grad, rtol=1e-10, atol=1e-12)


def test_entropic_controller_matches_the_authors_alpha_sequence():
    g = torch.Generator().manual_seed(2)
    seq = (0.5 + 0.3 * torch.randn(30, generator=g, dtype=torch.float64)).tolist()
    seq[3] = 4.0  # saturates: alpha clipped to 1
    want = authors_alpha_sequence(seq, 0.5, 1.0, 0.01)
    m = control.build_method("entropic", target=0.5)
    mask = torch.ones(1, 2, dtype=torch.bool)
    got = []
    for h in seq:
        m.observe(NS(entropy=torch.tensor([[h, h]], dtype=torch.float64)), mask, "token-mean")
        got.append(m.loss_kwargs()["weight_alpha"])
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert 1.0 in got
    # relative target: 0.9 times the first batch's entropy
    m = control.build_method("entropic", target="0.9x")
    met = m.observe(NS(entropy=torch.tensor([[1.0, 1.0]])), mask, "token-mean")
    assert met["control/own_target"] == pytest.approx(0.9) and m.alpha == pytest.approx(0.1)


# ----------------------------------------------------------------------------- peer: Skywork-OR1's and CE-GPPO's code


def skywork_adaptive_reference(entropies, init, target, delta, cmin, cmax):
    """Skywork-OR1's own adaptive entropy control (github.com/SkyworkAI/Skywork-OR1: ``EntController`` in
    verl/trainer/ppo/core_algos.py; dp_actor.py applies value·entropy_loss_enabled; ray_trainer.py calls update
    after each step's actor update). Written from reading it: enabled starts at 1; both tests are strict (<)."""
    value, enabled, applied, coefs = init, 1, [], []
    for h in entropies:
        applied.append(value * enabled)
        value = value + delta if h < target else value - delta
        value = float(min(max(value, cmin), cmax))
        enabled = int(h < target)
        coefs.append(value)
    return applied, coefs


def _run_adaptive(seq, **params):
    m = control.build_method("adaptive_entropy", **params)
    mask = torch.ones(1, 1, dtype=torch.bool)
    applied, coefs = [], []
    for h in seq:
        m.observe(NS(entropy=torch.tensor([[h]], dtype=torch.float64)), mask, "token-mean")
        applied.append(m.loss_kwargs()["entropy_coef"])
        coefs.append(m.coef)
    return applied, coefs


def test_adaptive_entropy_matches_skywork_or1s_own_controller_up_to_the_documented_differences():
    g = torch.Generator().manual_seed(4)
    seq = (0.2 + 0.1 * torch.randn(40, generator=g, dtype=torch.float64)).tolist()
    assert 0.2 not in seq
    # Skywork-OR1's released setting (or1_scripts/train/*.sh): initial 0, target 0.2, delta 1e-4, max 0.005
    kw = dict(target=0.2, delta=1e-4, coef_min=0.0, coef_max=0.005)
    want = skywork_adaptive_reference(seq, 0.0, kw["target"], kw["delta"], kw["coef_min"], kw["coef_max"])
    got = _run_adaptive(seq, coef=0.0, **kw)
    assert got[0] == want[0] and got[1] == pytest.approx(want[1], rel=0, abs=1e-15)
    assert len(set(got[0])) > 3  # the coefficient moves and is gated
    # documented difference 1: an entropy exactly at the target counts as below for TRL and us, not for Skywork
    tie = [0.1, 0.2, 0.3]
    ours, theirs = _run_adaptive(tie, coef=0.0, **kw), skywork_adaptive_reference(tie, 0.0, 0.2, 1e-4, 0.0, 0.005)
    assert ours[1] == pytest.approx([1e-4, 2e-4, 1e-4]) and theirs[1] == pytest.approx([1e-4, 0.0, 0.0])
    assert ours[0][2] == pytest.approx(2e-4) and theirs[0][2] == 0.0
    # documented difference 2: a non-zero initial coefficient is applied at step 1 by Skywork, not by TRL/us
    ours, theirs = _run_adaptive([0.1], coef=0.003, **kw), skywork_adaptive_reference([0.1], 0.003, 0.2, 1e-4,
                                                                                      0.0, 0.005)
    assert ours[0] == [0.0] and theirs[0] == [0.003]


def authors_gppo_loss(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, beta1, beta2,
                      clip_c=3.0):
    """``compute_gppo_loss_general_beta`` of github.com/Kwai-Klear/CE-GPPO (verl/trainer/ppo/core_algos.py),
    token-mean. Written from reading it: clipped tokens −beta·bound·A·r/sg(r), the others −A·r, then dual clip
    min(·, −A·c) on A < 0."""
    ratio = torch.exp(log_prob - old_log_prob)
    rd = ratio.detach()
    low = (ratio < 1 - clip_low) & (advantages < 0)
    high = (ratio > 1 + clip_high) & (advantages > 0)
    pg = -advantages * ratio
    pg = torch.where(low, -beta1 * (1 - clip_low) / rd * ratio * advantages, pg)
    pg = torch.where(high, -beta2 * (1 + clip_high) / rd * ratio * advantages, pg)
    pg = torch.where(advantages < 0, torch.min(-advantages * clip_c, pg), pg)
    return _masked_mean(pg, response_mask), low, high


def test_ce_gppo_gradient_matches_the_authors_code():
    g = torch.Generator().manual_seed(5)
    b, t = 8, 10
    mask = torch.rand(b, t, generator=g) > 0.15
    adv = (torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t) * mask).clone()
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + (torch.rand(b, t, generator=g, dtype=torch.float64) * 2.6 - 1.0)  # r in [0.37, 4.5]
    n = int(mask.sum())
    for eps_low, eps_high, b1, b2 in ((0.2, 0.2, 0.75, 1.0), (0.2, 0.28, 0.5, 1.0), (0.1, 0.2, 0.25, 0.6)):
        ours_lp = logp.clone().requires_grad_(True)
        ours, _ = policy_loss(ours_lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=3.0,
                              ce_beta_low=b1, ce_beta_high=b2)
        ours.backward()
        ref_lp = logp.clone().requires_grad_(True)
        ref, low, high = authors_gppo_loss(old, ref_lp, adv, mask.double(), eps_low, eps_high, b1, b2)
        ref.backward()
        low, high = low & mask, high & mask
        assert int(low.sum()) > 2 and int(high.sum()) > 2
        assert bool(((adv < 0) & (logp - old > math.log(3.0)) & mask).any())  # the dual clip is exercised too
        torch.testing.assert_close(ours_lp.grad, ref_lp.grad, rtol=1e-12, atol=1e-14)
        # the documented deviation, in value only: ours keeps PPO's −bound·A on clipped tokens, theirs −beta·bound·A
        diff = (-(1 - b1) * (1 - eps_low) * adv)[low].sum() + (-(1 - b2) * (1 + eps_high) * adv)[high].sum()
        assert float(ours.detach() - ref.detach()) == pytest.approx(float(diff) / n, rel=1e-10, abs=1e-14)


# ----------------------------------------------------------------------------- the lens


def _golden_batch(seed):
    """The batch of tests/data/lens_golden_pre_issue28.json (its values come from the code before issue 28,
    commit b335edc, step_log.lens_metrics, written as float.hex)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    mask = torch.rand(b, t, generator=g) > 0.2
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    adv[0] = 0.0
    adv = adv * mask
    s_c = torch.randn(b, t, generator=g)
    logp = -torch.rand(b, t, generator=g) * 3
    new = logp + 0.4 * torch.randn(b, t, generator=g)
    keep = torch.rand(b, t, generator=g) > 0.3
    return mask, adv, s_c, logp, new, keep


def test_existing_lens_metrics_are_bit_identical():
    golden = json.loads((DATA / "lens_golden_pre_issue28.json").read_text())
    assert len(golden) == 6
    for key, want in golden.items():
        seed, agg = key.split("/", 1)
        mask, adv, s_c, logp, new, keep = _golden_batch(int(seed))
        s = NS(mask=mask)
        old = NS(adv=adv, logp=logp, stats=NS(s_centered=s_c))
        pr = NS(logp=new, ratio=torch.exp((new - logp).double()))
        rule = NS(settings=LossSettings(agg=agg, eps_low=0.2, eps_high=0.28))
        vanilla = NS(settings=LossSettings(agg=agg, eps_low=0.2, eps_high=0.2))
        sel = NS(keep=keep, adv_shift=None, weight_select=None)
        upd = NS(zeroed=torch.zeros_like(mask))
        for got in (lens_metrics(s, old, pr, mask & keep, rule),
                    lens_metrics(s, old, pr, mask & keep, rule, sel, upd, vanilla)):
            old_keys = {k: v for k, v in got.items() if k.startswith(("lens/", "lens_ppo/"))}
            assert old_keys == {k: None if v is None else float.fromhex(v) for k, v in want.items()}, key
        assert any(k.startswith("lensw/") for k in got)


def _lens_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 8, 11
    mask = torch.rand(b, t, generator=g) > 0.15
    adv = (torch.randn(b, 1, generator=g).expand(b, t) * mask).double()
    adv[1] = 0.0
    s_c = torch.randn(b, t, generator=g, dtype=torch.float64)
    old = -3 * torch.rand(b, t, generator=g, dtype=torch.float64)
    new = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    keep = torch.rand(b, t, generator=g) > 0.25
    psi = 0.3 * torch.rand(b, t, generator=g, dtype=torch.float64)
    return mask, adv, s_c, old, new, keep, psi


def test_weight_lens_terms_sum_to_the_total_first_order_change():
    """Method: keep-mask + advantage shift under PPO's clip, off-policy ratios, token-mean. Its token weights are
    known in closed form, g = r·(A + ψ)/|kept| on kept tokens the clip leaves, so the total first-order ΔH is
    theory.first_order_entropy_change of those; the lens's quadrant terms plus the vanilla total give it."""
    mask, adv, s_c, old, new, keep, psi = _lens_batch()
    kw = dict(eps_low=0.2, eps_high=0.2, agg="token-mean")
    g_m = control.gradient_coefficients(new, old, adv, mask, keep=keep, adv_shift=psi, **kw)
    g_v = control.gradient_coefficients(new, old, adv, mask, **kw)
    out = control.weight_lens(g_m, g_v, adv, s_c, mask)
    r = torch.exp(new - old)
    kept = mask & keep
    shifted = adv + torch.where(mask, psi, torch.zeros_like(psi))
    total_m = first_order_entropy_change(s_c, shifted, weights=agg_weights(kept, dtype=torch.float64), ratio=r,
                                         mask=kept, clipped=ppo_clipped_mask(new, old, shifted, mask, 0.2, 0.2))
    total_v = first_order_entropy_change(s_c, adv, weights=agg_weights(mask, dtype=torch.float64), ratio=r,
                                         mask=mask, clipped=ppo_clipped_mask(new, old, adv, mask, 0.2, 0.2))
    assert out["lensw/dH_method"] == pytest.approx(float(total_m.per_token.sum()), rel=1e-12)
    assert out["lensw/dH_vanilla"] == pytest.approx(float(total_v.per_token.sum()), rel=1e-12)
    quads = sum(out[f"lensw/dH_change/{q}"] for q in control.QUADRANTS)
    assert quads == pytest.approx(out["lensw/dH_change"], rel=1e-12, abs=1e-15)
    assert out["lensw/dH_vanilla"] + quads == pytest.approx(out["lensw/dH_method"], rel=1e-12)
    assert out["lensw/dH_change"] != 0.0
    # shares: tokens dropped by keep are "removed"; A == 0 tokens are untouched (ψ = 0 there... and g = 0)
    assert out["lensw/removed_rate/zero"] in (0.0, None)
    assert any((out[f"lensw/removed_rate/{q}"] or 0) > 0 for q in control.QUADRANTS)
    assert any((out[f"lensw/reweighted_rate/{q}"] or 0) > 0 for q in control.QUADRANTS)


def test_weight_lens_sees_added_gradient_and_is_zero_for_vanilla():
    mask, adv, s_c, old, new, keep, _ = _lens_batch(1)
    kw = dict(eps_low=0.2, eps_high=0.2, agg="seq-mean-token-mean")
    g_v = control.gradient_coefficients(new, old, adv, mask, **kw)
    same = control.weight_lens(g_v, g_v, adv, s_c, mask)
    assert same["lensw/dH_change"] == 0.0 and all(same[f"lensw/dH_change/{q}"] == 0.0 for q in control.QUADRANTS)
    g_ce = control.gradient_coefficients(new, old, adv, mask, ce_beta_low=1.0, ce_beta_high=1.0, **kw)
    out = control.weight_lens(g_ce, g_v, adv, s_c, mask)
    assert any((out[f"lensw/added_rate/{q}"] or 0) > 0 for q in control.QUADRANTS)
    assert all((out[f"lensw/removed_rate/{q}"] or 0) == 0 for q in control.QUADRANTS)
    # vanilla coefficients are w·A·r on the tokens the clip leaves (PPO Eq. 7), by hand
    w = agg_weights(mask, "seq-mean-token-mean", torch.float64)
    clipped = ppo_clipped_mask(new, old, adv, mask, 0.2, 0.2)
    want = torch.where(mask & ~clipped, w * adv * torch.exp(new - old), torch.zeros_like(w))
    torch.testing.assert_close(g_v, want, rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- training: counterfactual probe


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("field") / "policy")


@pytest.mark.parametrize("name,params", [
    ("entropy_adv", "{alpha: 2.0}"),
    ("adaptive_entropy", "{coef: 0.05, target: 9.0}"),
    ("ce_gppo", "{beta_low: 1.0, beta_high: 1.0}"),
    ("clip_low", "{eps_low: 0.02}"),
    ("entropic", "{alpha: 0.5, target: null, high_prob: 0.2}"),
])
def test_counterfactual_probe_on_each_new_method(micro_model, tmp_path, name, params):
    """Two tiny steps (two minibatches each, so the clip methods act): the probe's vanilla update from the same
    state at step 1 is the real vanilla run's step 1, the method's own ΔH is the step's, and the lens is logged.
    adaptive_entropy applies nothing at step 1 (TRL's rule: the previous entropy starts at +inf)."""
    sets = {"eval.every": 0, "train.max_steps": 2, "algo.minibatches": 2, "probe.counterfactual_every": 1,
            "probe.jvp_every": 0, "train.checkpoint_every": 2, "rollout.prompts_per_step": 8, "method.name": name,
            "method.params": params}
    start(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / name)
    rows = read_jsonl(tmp_path / name / "metrics.jsonl")
    base = {**sets, "method.name": "none", "method.params": "{}", "train.max_steps": 1}
    start(load_config(None, micro_overrides(micro_model, **base)), tmp_path / "none")
    (ref,) = read_jsonl(tmp_path / "none" / "metrics.jsonl")
    assert rows[0]["probe/dH_vanilla"] == ref["probe/dH_actual"]
    for row in rows:
        assert row["probe/dH_method"] == pytest.approx(row["probe/dH_actual"])
        assert row["lensw/dH_change"] is not None and math.isfinite(row["lensw/dH_method"])
    assert rows[-1]["probe/dH_method_effect"] not in (None, 0.0)  # the method changed the update
    assert (rows[0]["probe/dH_method_effect"] == 0.0) == (name == "adaptive_entropy")
    assert ref["lensw/dH_change"] == 0.0


def test_own_controller_state_survives_a_resume(micro_model, tmp_path):
    sets = {"eval.every": 0, "train.max_steps": 4, "train.checkpoint_every": 2, "probe.counterfactual_every": 0,
            "probe.jvp_every": 0, "method.name": "entropic", "method.params": "{target: 0.9x}"}
    cfg = load_config(None, micro_overrides(micro_model, **sets))
    start(cfg, tmp_path / "full")
    full = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    cfg2 = load_config(None, micro_overrides(micro_model, **{**sets, "train.max_steps": 2}))
    start(cfg2, tmp_path / "part")
    from entropy_rft.launch.run import start_or_resume

    start_or_resume(cfg, tmp_path / "part")
    part = read_jsonl(tmp_path / "part" / "metrics.jsonl")
    keys = ("control/own_output", "control/own_integral", "entropy/mean", "loss/total")
    assert [[r[k] for k in keys] for r in part] == [[r[k] for k in keys] for r in full]
    assert full[-1]["control/own_integral"] != 0.0


def test_native_only_methods_are_refused_on_trl(micro_model):
    for name in ("entropy_adv", "adaptive_entropy", "entropic"):
        with pytest.raises(UserError, match=f"method '{name}' runs on engine 'native' only"):
            load_config(None, micro_overrides(micro_model, **{"method.name": name}), extra={"engine": "trl"})
    load_config(None, micro_overrides(micro_model, **{"method.name": "ce_gppo"}), extra={"engine": "trl"})


def test_trl_trainer_refuses_a_native_only_method():
    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    with pytest.raises(ValueError, match="'entropic' runs on engine native only"):
        EntropyControlGRPOTrainer(method="entropic")


def test_controller_tracking_and_table_by_hand():
    from entropy_rft.analysis.equal_entropy import controller_markdown
    from entropy_rft.analysis.summary import controller_tracking

    # own controller, target 1.0: starts at 1.5, reaches at step 3 (0.95 <= 1.0), then 1.1 (in), 1.3 (out)
    rows = [{"step": i + 1, "entropy/mean": h, "control/own_target": 1.0} for i, h in enumerate([1.5, 1.2, 0.95,
                                                                                                 1.1, 1.3])]
    t = controller_tracking(rows)
    assert t["controller/kind"] == "own" and t["controller/reach_step"] == 3
    assert t["controller/in_band"] == pytest.approx(2 / 3) and t["controller/max_dev"] == pytest.approx(0.3)
    auto = controller_tracking([{**r, "control/entropy_target": r.pop("control/own_target")} for r in rows])
    assert auto["controller/kind"] == "autopilot" and auto["controller/max_dev"] == pytest.approx(0.3)
    assert controller_tracking([{"step": 1, "entropy/mean": 1.0}])["controller/kind"] is None
    summ = [{"method": "entropic", "method_name": "entropic", "controller/target_spec": "0.5x", **t},
            {"method": "entropic", "method_name": "entropic", "controller/target_spec": "0.5x", **t,
             "controller/in_band": 1 / 3},
            {"method": "entropic", "method_name": "entropic", "controller/target_spec": "0.5x", **auto},
            {"method": "none", "method_name": "none", "controller/kind": None}]
    md = controller_markdown(summ)
    assert "| 0.5x | entropic | own | 2 | 2/2 | 50.0% ± 16.7% | 30.0% ± 0.0% |" in md
    assert "| 0.5x | entropic | autopilot | 1 | 1/1 | 66.7% | 30.0% |" in md and "none" not in md
    assert controller_markdown(summ[3:]) == ""


def test_erft_methods_lists_each_new_method_with_its_lens_line(capsys):
    from entropy_rft.cli.main import main

    assert main(["methods", *NEW, "clip_v"]) == 0
    text = capsys.readouterr().out
    for name in NEW:
        assert f"{name}  (" in text
    assert "lens: neg_sneg: drops (S_c < −mu·std)" in text
    assert "engines: native only" in text and "arXiv 2511.15248" in text
    assert main(["methods", "--json", "entropic"]) == 0
    (info,) = json.loads(capsys.readouterr().out)
    assert info["knob"] == "pos_weight" and info["engines"] == ["native"]
    assert info["quadrants"]["neg_spos"].startswith("reweights")


def test_report_shows_methods_through_the_lens(micro_model, tmp_path):
    from entropy_rft.report.page import build_report

    for name in ("none", "entropy_adv"):
        sets = {"eval.every": 0, "train.max_steps": 2, "probe.jvp_every": 0, "probe.counterfactual_every": 0,
                "rollout.prompts_per_step": 8, "method.name": name}
        start(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / "runs" / name)
    nums = build_report([tmp_path / "runs"], tmp_path / "rep")
    rows = {r["label"]: r for r in nums["quadrants"]}
    assert rows["entropy_adv"]["effects"]["pos_spos"] == "reweights up (A + ψ)"
    assert rows["none"]["effects"] == {q: "-" for q in control.QUADRANTS}
    assert all(v == 0.0 for v in rows["none"]["dH_change"].values())  # vanilla against vanilla
    metrics = read_jsonl(tmp_path / "runs" / "entropy_adv" / "metrics.jsonl")
    want = sum(r["lensw/dH_change/pos_spos"] for r in metrics if r["step"] >= 1) / 2
    assert rows["entropy_adv"]["dH_change"]["pos_spos"] == pytest.approx(want)
    html_text = (tmp_path / "rep" / "report.html").read_text()
    assert "Methods through the lens" in html_text and "reweights up (A + ψ)" in html_text


def test_entropic_state_restores_alpha_exactly():
    m = control.build_method("entropic", target=0.3)
    m.observe(NS(entropy=torch.tensor([[0.4123456789]])), torch.ones(1, 1, dtype=torch.bool), "token-mean")
    alpha, st = m.alpha, m.state_dict()
    assert (1.0 + alpha) - 1.0 != alpha  # the knob alone loses the last bits of this alpha
    m2 = control.build_method("entropic", target=0.3)
    m2.set_knob(1.0 + alpha)  # what the trainer's load_checkpoint_state does first
    m2.load_state_dict(st)
    assert m2.alpha == alpha and m2.state_dict() == st


def test_own_law_variants_get_their_own_row_at_their_setpoint(micro_model, tmp_path):
    """erft compare with entropic:target=0.9x next to entropic@0.9x: two rows in the 0.9x block, not one merged
    with the preset run, each judged on its own controller's tracking."""
    from entropy_rft.analysis.equal_entropy import comparison_rows
    from entropy_rft.analysis.summary import run_summary

    sums = []
    for label, extra in (("entropic:target=0.9x", {"params": {"target": "0.9x", "high_prob": 0.2}}),
                         ("entropic@0.9x", {"entropy_target": "0.9x"}), ("entropic", {})):
        sets = {"eval.every": 0, "train.max_steps": 3, "probe.jvp_every": 0, "probe.counterfactual_every": 0}
        cfg = load_config(None, micro_overrides(micro_model, **sets),
                          extra={"method": {"name": "entropic", "label": label, **extra}})
        start(cfg, tmp_path / label)
        s = run_summary(tmp_path / label)
        s["method"] = label
        sums.append(s)
    assert [s["controller/kind"] for s in sums] == ["own", "autopilot", "own"]
    rows = {(r["setpoint"], r["method"]): r for r in comparison_rows(sums)}
    assert set(rows) == {("0.9x", "entropic (own law)"), ("0.9x", "entropic"), ("preset", "entropic")}
    assert rows[("0.9x", "entropic (own law)")]["status"] in ("held", "not held", "not reached") or \
        rows[("0.9x", "entropic (own law)")]["status"].startswith("held on")

    # the report groups the runs as their summaries do: the own law at its setpoint, not among the presets
    from entropy_rft.analysis.runs import assign_labels, load_run
    from entropy_rft.report.equal_entropy_page import controller_lines, fig_controllers, series_by_setpoint
    from entropy_rft.report.page import build_report

    runs = [load_run(tmp_path / label) for label in ("entropic:target=0.9x", "entropic@0.9x", "entropic")]
    assign_labels(runs)
    groups = series_by_setpoint(runs, sums)
    assert {sp: sorted(g) for sp, g in groups.items()} == {"0.9x": ["entropic", "entropic (own law)"],
                                                          "preset": ["entropic"]}
    assert fig_controllers(runs, sums)[:4] == b"\x89PNG"
    assert controller_lines(groups["0.9x"], "entropic") == [("entropic (own law)", "own law"),
                                                            ("entropic", "autopilot")]
    # a method without a knob (Entrocraft) is drawn next to the autopilot on the setpoint's other methods
    block = {"entrocraft (own law)": [1], "clip_v": [1], "clip_cov": [1], "aepo (own law)": [1], "none": [1]}
    assert controller_lines(block, "entrocraft") == [("entrocraft (own law)", "own law"),
                                                     ("clip_cov", "autopilot on clip_cov"),
                                                     ("clip_v", "autopilot on clip_v")]
    assert fig_controllers(runs[1:], sums[1:]) is None  # no own law at a setpoint: no figure
    build_report([tmp_path / label for label in ("entropic:target=0.9x", "entropic@0.9x", "entropic")],
                 tmp_path / "report")
    page = (tmp_path / "report" / "report.html").read_text()
    assert "Which controller holds entropy" in page and "<th>worst excursion</th>" in page
