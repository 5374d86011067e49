"""Issue 39: Flexible Entropy Control (Chen et al. 2026, no released code). Its widths and schedules against
hand-computed values of the formulas of the authors' blog post, the per-token clip of ``policy_loss`` against a
float64 reference, and ``erft train --method fec``: with flat widths it trains exactly as GRPO does, and its OD
switch and resume are read back from the metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from entropy_rft import control
from entropy_rft.config.loading import load_config
from entropy_rft.control.fec import LOWER_MODE, RAISE_MODE, fec_bounds, fec_od_state, fec_od_thresholds, fec_width
from entropy_rft.core.loss import policy_loss
from entropy_rft.launch.run import start, start_or_resume
from entropy_rft.rundir.files import read_jsonl
from micro import make_micro_policy, micro_overrides


def test_widths_by_hand():
    p = torch.tensor([0.0, 0.4, 1.0])
    torch.testing.assert_close(fec_width(p, -0.25, 0.5, 0.05, 0.6), torch.tensor([0.5, 0.4, 0.25]))
    torch.testing.assert_close(fec_width(p, -0.13, 0.3, 0.05, 0.6), torch.tensor([0.3, 0.248, 0.17]))
    torch.testing.assert_close(fec_width(p, -1.0, 0.9, 0.05, 0.6), torch.tensor([0.6, 0.5, 0.05]))  # clamped


@pytest.mark.parametrize("schedule, step, high, low", [
    ("id", 2, 0.6 * 0.4 + 0.4 * 0.2, 0.2),      # λ = 0.6: the upper bound on its way from H(p) to ε_std
    ("id", 5, 0.2, 0.2),                        # λ = 0 at T/2
    ("id", 8, 0.2, 0.4 * 0.248 + 0.6 * 0.2),    # λ = -0.6: the lower bound on its way from M(p) to ε_std
    ("id", 10, 0.2, 0.2),
    ("did", 2, 0.6 * 0.2 + 0.4 * 0.4, 0.2),
    ("did", 8, 0.4, 0.4 * 0.248 + 0.6 * 0.2),
    ("did", 10, 0.4, 0.2),
])
def test_schedules_by_hand(schedule, step, high, low):
    """p = 0.4: H(p) = 0.4, M(p) = 0.248, ε_std = 0.2, T = 10."""
    upper, lower = torch.tensor([0.4]), torch.tensor([0.248])
    h, lo = fec_bounds(schedule, step, 10, 0.2, upper, lower)
    assert float(h) == pytest.approx(high) and float(lo) == pytest.approx(low)


def test_oscillatory_decay_by_hand():
    assert fec_od_thresholds(5, 10, 0.8, 0.2) == pytest.approx((0.16, 0.48))
    assert fec_od_thresholds(10, 10, 0.8, 0.2) == pytest.approx((0.16, 0.16))
    assert fec_od_state(0.16, LOWER_MODE, 0.16, 0.48) == RAISE_MODE  # at the floor: raise
    assert fec_od_state(0.3, RAISE_MODE, 0.16, 0.48) == RAISE_MODE  # between: held
    assert fec_od_state(0.3, LOWER_MODE, 0.16, 0.48) == LOWER_MODE
    assert fec_od_state(0.49, RAISE_MODE, 0.16, 0.48) == LOWER_MODE
    u, m = torch.tensor([0.4]), torch.tensor([0.248])
    assert [float(x) for x in fec_bounds("od", 3, 10, 0.2, u, m, RAISE_MODE)] == pytest.approx([0.4, 0.2])
    assert [float(x) for x in fec_bounds("od", 3, 10, 0.2, u, m, LOWER_MODE)] == pytest.approx([0.2, 0.248])


def test_per_token_clip_against_float64():
    """policy_loss with per-token widths: each token's loss is max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) with its
    own widths (float64 by hand, token mean over the mask), and constant widths give the scalar path exactly."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(4, 6, generator=g) > 0.2
    old = torch.log(torch.rand(4, 6, generator=g) * 0.9 + 0.05)
    logp = (old + 0.6 * torch.randn(4, 6, generator=g)).clamp(max=0.0).requires_grad_(True)
    adv = torch.tensor([1.5, -1.0, 0.7, -0.3])
    lo, hi = torch.rand(4, 6, generator=g) * 0.4, torch.rand(4, 6, generator=g) * 0.5
    loss, _ = policy_loss(logp, old, adv, mask, eps_low=lo, eps_high=hi)
    r = (logp.detach().double() - old.double()).exp()
    a = adv.double()[:, None].expand(4, 6)
    clipped = torch.minimum(torch.maximum(r, 1 - lo.double()), 1 + hi.double())
    tok = torch.maximum(-a * r, -a * clipped)
    assert float(loss.detach()) == pytest.approx(float(tok[mask].mean()), rel=1e-6)
    flat, _ = policy_loss(logp, old, adv, mask, eps_low=torch.full((4, 6), 0.2), eps_high=torch.full((4, 6), 0.28))
    scalar, _ = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert torch.equal(flat, scalar)
    with pytest.raises(ValueError, match="eps_low must be finite and >= 0"):
        policy_loss(logp, old, adv, mask, eps_low=-lo)


def test_validation_names_the_bad_parameter():
    for bad, match in (({"schedule": "up"}, "schedule must be id, did or od"), ({"eps_min": 0.7}, "eps_min must be <="),
                       ({"total_steps": -2}, "total_steps"), ({"target": "x"}, "target")):
        with pytest.raises(ValueError, match=match):
            control.build_method("fec", **bad)
    assert control.method_info("fec")["engines"] == ["native"]


def test_a_setpoint_switches_at_the_target():
    m = control.build_method("fec", target="0.5x")
    mask = torch.ones(1, 2, dtype=torch.bool)
    first = m.observe(SimpleNamespace(entropy=torch.full((1, 2), 0.8)), mask, "token-mean")
    assert first["control/own_target"] == pytest.approx(0.4) and first["control/own_output"] == LOWER_MODE
    assert m.observe(SimpleNamespace(entropy=torch.full((1, 2), 0.4)), mask, "token-mean")["control/own_output"] \
        == RAISE_MODE
    masks = m.minibatch_masks(torch.log(torch.tensor([[0.4, 1.0]])), torch.zeros(1, 2), torch.ones(1), mask)
    torch.testing.assert_close(masks.eps_high, torch.tensor([[0.4, 0.25]]))  # raising: H(p), ε_std below
    torch.testing.assert_close(masks.eps_low, torch.tensor([[0.2, 0.2]]))


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    return make_micro_policy(tmp_path_factory.mktemp("fec") / "model")


BASE = {"eval.every": 0, "train.max_steps": 4, "train.checkpoint_every": 2, "probe.counterfactual_every": 0,
        "probe.jvp_every": 0, "algo.minibatches": 2, "algo.eps_high": 0.28}


def test_flat_widths_train_exactly_as_grpo(micro_model, tmp_path):
    """Widths that do not depend on p (slopes 0, intercepts ε_low 0.2 and ε_high 0.28, the run's own clip): every
    schedule reduces to the run's clip, so FEC trains bit for bit as ``none`` (two minibatches, so the second
    one's ratio leaves 1 and the clip acts)."""
    start(load_config(None, micro_overrides(micro_model, **BASE)), tmp_path / "none")
    # DID past T/2 is (H, (1 + λ)·M − λ·ε_std): with H = 0.28 and M = ε_std = 0.2 it is (0.28, 0.2) at every
    # step of a schedule of T = 1, as the run's own clip
    flat = "{schedule: did, upper_slope: 0.0, upper_intercept: 0.28, lower_slope: 0.0, lower_intercept: 0.2, " \
           "eps_std: 0.2, total_steps: 1}"
    start(load_config(None, micro_overrides(micro_model, **BASE, **{"method.name": "fec", "method.params": flat})),
          tmp_path / "fec")
    keys = ("loss/total", "entropy/mean", "clip/ratio_frac", "optim/grad_norm")
    ref = [[r[k] for k in keys] for r in read_jsonl(tmp_path / "none" / "metrics.jsonl") if r["step"] >= 1]
    got = [[r[k] for k in keys] for r in read_jsonl(tmp_path / "fec" / "metrics.jsonl") if r["step"] >= 1]
    assert got == ref and any(r[2] for r in ref)


def test_erft_train_fec_od_logs_its_thresholds_and_resumes(micro_model, tmp_path):
    sets = {**BASE, "method.name": "fec", "method.params": "{schedule: od, total_steps: 4}"}
    start(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / "full")
    train = [r for r in read_jsonl(tmp_path / "full" / "metrics.jsonl") if r["step"] >= 1]
    h0 = train[0]["control/own_entropy"]
    for k, r in enumerate(train, start=1):
        assert (r["control/own_low"], r["control/own_high"]) == pytest.approx(fec_od_thresholds(k, 4, h0, 0.2))
        assert r["control/own_output"] in (LOWER_MODE, RAISE_MODE)
    start(load_config(None, micro_overrides(micro_model, **{**sets, "train.max_steps": 2})), tmp_path / "part")
    start_or_resume(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / "part")
    resumed = [r for r in read_jsonl(tmp_path / "part" / "metrics.jsonl") if r["step"] >= 1]
    keys = ("control/own_high", "control/own_output", "entropy/mean", "loss/total")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in train]
