"""Issue 39: Entrocraft (Li et al. 2026). Its band and switch against a transcription of the authors' released
estimator (lblaoke/entrocraft, ``compute_grpo_range_linear_outcome_advantage`` and the RAFT++ / NSR / GRPO
estimators it switches between) token by token, hand-computed bounds, and a run of ``erft train --method
entrocraft`` whose mode and resume are read back from its metrics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from entropy_rft import control
from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import load_config
from entropy_rft.control.entrocraft import HOLD, LOWER, RAISE, entrocraft_band, entrocraft_mode
from entropy_rft.launch.run import start, start_or_resume
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.training import stages
from entropy_rft.training.records import OldPolicy, Scored
from micro import make_micro_policy, micro_overrides


def released_advantages(rewards: torch.Tensor, mask: torch.Tensor, index: list[int], entropy: float, step: int,
                        total: int, lb: tuple[float, float], ub: tuple[float, float], eps: float = 1e-6):
    """The authors' estimator, transcribed: the bounds (core_algos.py 400-401), the strict switch (359-379),
    RAFT++ (264-271: adv = reward, negatives set to 0), NSR (465-472: positives set to 0) and GRPO per uid
    ((s - mean) / (std + eps), unbiased std, a group of one: mean 0, std 1). Returns (estimator, advantages)."""
    lower = lb[0] + (lb[1] - lb[0]) * step / total
    upper = ub[0] + (ub[1] - ub[0]) * step / total
    scores = rewards.clone()
    if entropy > upper:
        scores[scores < 0] = 0
        return "raftpp", scores[:, None] * mask
    if entropy < lower:
        scores[scores > 0] = 0
        return "nsr", scores[:, None] * mask
    out = torch.zeros_like(scores)
    for uid in set(index):
        rows = [i for i, u in enumerate(index) if u == uid]
        s = scores[rows]
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(rows) == 1 else (s.mean(), s.std())
        out[rows] = (s - mean) / (std + eps)
    return "grpo", out[:, None] * mask


def grpo(rewards: torch.Tensor, groups: int) -> torch.Tensor:
    g = rewards.view(groups, -1)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).flatten()


def test_band_is_linear_in_the_step_and_held_at_its_end():
    low, high = entrocraft_band(1, 10, (0.6, 0.4), (0.7, 0.5))
    assert low == pytest.approx(0.58) and high == pytest.approx(0.68)
    assert entrocraft_band(10, 10, (0.6, 0.4), (0.7, 0.5)) == pytest.approx((0.4, 0.5))
    assert entrocraft_band(25, 10, (0.6, 0.4), (0.7, 0.5)) == pytest.approx((0.4, 0.5))
    # strict comparisons: on a bound is GRPO
    assert entrocraft_mode(0.68, 0.58, 0.68) == HOLD and entrocraft_mode(0.58, 0.58, 0.68) == HOLD
    assert entrocraft_mode(0.69, 0.58, 0.68) == LOWER and entrocraft_mode(0.5, 0.58, 0.68) == RAISE


@pytest.mark.parametrize("entropy", [0.2, 0.45, 0.55, 0.64, 0.9])
@pytest.mark.parametrize("step", [1, 4, 10])
def test_advantages_match_the_released_estimator_token_by_token(entropy, step):
    """The released estimator on ±1 rewards (its math reward) against ours on the same rollouts scored 0/1 (the
    default mapping (r − 0.5)·2) and on ±1 (reward_center 0, reward_scale 1): 4 groups of 4, two mixed, one
    all correct and one all wrong (NSR trains the all-wrong group, GRPO does not), and a padded row. The
    advantage each token trains with (the engine's GRPO plus the method's shift, as ``training.stages.select``
    composes them) equals the released one."""
    pm1 = torch.tensor([1., -1, 1, -1, 1, 1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1])
    index = [i // 4 for i in range(16)]
    mask = torch.ones(16, 5, dtype=torch.bool)
    mask[3, 3:] = False
    total, lb, ub = 10, (0.6, 0.4), (0.7, 0.5)
    estimator, released = released_advantages(pm1, mask, index, entropy, step, total, lb, ub)
    for rewards, mapping in (((pm1 + 1) / 2, {}), (pm1, {"reward_center": 0.0, "reward_scale": 1.0})):
        m = control.build_method("entrocraft", lower_start=lb[0], lower_end=lb[1], upper_start=ub[0],
                                 upper_end=ub[1], total_steps=total, **mapping)
        m._step = step - 1
        stats = SimpleNamespace(entropy=torch.full((16, 5), entropy))
        metrics = m.observe(stats, mask, "token-mean")
        assert metrics["control/own_output"] == {"raftpp": LOWER, "nsr": RAISE, "grpo": HOLD}[estimator]
        adv = grpo(rewards, 4)  # the engine's GRPO advantages (the same for 0/1 and ±1 rewards)
        own = m.rollout_advantages(rewards, adv, mask)
        assert (own is None) == (estimator == "grpo")
        effective = adv[:, None] * mask if own is None else own
        torch.testing.assert_close(effective, released, atol=1e-5, rtol=1e-5)
        assert m.rollout_masks(stats, adv, mask).adv_shift is None


@pytest.mark.parametrize("entropy", [0.2, 0.65, 0.9])
def test_the_trainer_trains_with_the_released_advantages(entropy):
    """``training.stages.select`` composes the method's advantages into the loss's shift: the engine's GRPO
    advantages plus the shift are the released ones on every training token (0/1 rewards, step 1 of 10)."""
    pm1 = torch.tensor([1., -1, 1, -1, 1, 1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1])
    mask = torch.ones(16, 5, dtype=torch.bool)
    mask[3, 3:] = False
    _, released = released_advantages(pm1, mask, [i // 4 for i in range(16)], entropy, 1, 10, (0.6, 0.4),
                                      (0.7, 0.5))
    adv = grpo((pm1 + 1) / 2, 4)[:, None] * mask
    stats = SimpleNamespace(entropy=torch.full((16, 5), entropy))
    run = SimpleNamespace(autopilot=None, loss=SimpleNamespace(agg="token-mean"),
                          method=control.build_method("entrocraft", total_steps=10))
    s = Scored([], None, (pm1 + 1) / 2, mask)
    sel = stages.select(run, s, OldPolicy(torch.zeros(16, 5), stats, adv))
    effective = adv if sel.adv_shift is None else adv + sel.adv_shift
    torch.testing.assert_close(effective, released, atol=1e-5, rtol=1e-5)


def test_a_fixed_band_at_a_setpoint_of_the_first_batch():
    """``target='0.5x'``: the band is half the first batch's entropy ± half_width, held over the run."""
    m = control.build_method("entrocraft", target="0.5x", half_width=0.05)
    mask = torch.ones(2, 3, dtype=torch.bool)
    first = m.observe(SimpleNamespace(entropy=torch.full((2, 3), 0.8)), mask, "token-mean")
    assert (first["control/own_low"], first["control/own_high"]) == pytest.approx((0.35, 0.45))
    assert first["control/own_output"] == LOWER
    later = m.observe(SimpleNamespace(entropy=torch.full((2, 3), 0.3)), mask, "token-mean")
    assert later["control/own_target"] == pytest.approx(0.4) and later["control/own_output"] == RAISE
    inside = m.observe(SimpleNamespace(entropy=torch.full((2, 3), 0.42)), mask, "token-mean")
    assert inside["control/own_output"] == HOLD


def test_validation_names_the_bad_parameter():
    with pytest.raises(ValueError, match="lower_end must be"):
        control.build_method("entrocraft", lower_end="x")
    with pytest.raises(ValueError, match="lower bound must not exceed the upper one"):
        control.build_method("entrocraft", lower_start=0.8)
    with pytest.raises(ValueError, match="total_steps must be >= 0, got -1"):
        control.build_method("entrocraft", total_steps=-1)
    with pytest.raises(ValueError, match="total_steps must be an integer >= 0, got 1.5"):
        control.build_method("entrocraft", total_steps=1.5)
    with pytest.raises(ValueError, match="target must be None, a number of nats"):
        control.build_method("entrocraft", target="x0.5")
    with pytest.raises(ValueError, match="reward_scale must be"):
        control.build_method("entrocraft", reward_scale=-1.0)
    assert control.method_info("entrocraft")["engines"] == ["native"]


def test_refused_with_the_uniform_group_filter():
    """The filter would drop the all-correct groups the released rule trains with +1 above the band and the
    all-wrong ones with -1 below it (issue 50): one line naming the field, before anything runs."""
    with pytest.raises(UserError, match=r"^config field 'algo.drop_uniform_groups': method 'entrocraft' reads "
                                        r"the all-correct and all-wrong groups.*set algo.drop_uniform_groups=false"):
        load_config(overrides=["method.name=entrocraft", "algo.drop_uniform_groups=true"])
    assert load_config(overrides=["method.name=entrocraft"]).algo.drop_uniform_groups is False
    assert load_config(overrides=["method.name=clip_v", "algo.drop_uniform_groups=true"]).algo.drop_uniform_groups
    assert control.method_info("entrocraft")["allows_group_filter"] is False


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    return make_micro_policy(tmp_path_factory.mktemp("entrocraft") / "model")


def test_erft_train_entrocraft_logs_its_band_and_mode_and_resumes(micro_model, tmp_path):
    """A band far above the policy's entropy: every step is below it, so positive rollouts are rejected (mode
    -1), the bounds move from 9/10 toward 5/6 over the run's 4 steps (total_steps 0: train.max_steps), and a
    resumed run continues the band where it stopped."""
    sets = {"eval.every": 0, "train.max_steps": 4, "train.checkpoint_every": 2, "probe.counterfactual_every": 0,
            "probe.jvp_every": 0, "task.name": "micro:OverlapTask", "method.name": "entrocraft",
            "method.params": "{lower_start: 9.0, lower_end: 5.0, upper_start: 10.0, upper_end: 6.0}"}
    cfg = load_config(None, micro_overrides(micro_model, **sets))
    start(cfg, tmp_path / "full")
    rows = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    train = [r for r in rows if r["step"] >= 1]
    assert [r["control/own_low"] for r in train] == pytest.approx([9 - 4 * k / 4 for k in range(1, 5)])
    assert [r["control/own_high"] for r in train] == pytest.approx([10 - 4 * k / 4 for k in range(1, 5)])
    assert all(r["control/own_output"] == RAISE for r in train)
    assert all(math.isfinite(r["control/own_entropy"]) for r in train)
    # a run stopped after 2 of its 4 steps and resumed (the band's length given, so the stop does not change it)
    sets["method.params"] = "{lower_start: 9.0, lower_end: 5.0, upper_start: 10.0, upper_end: 6.0, total_steps: 4}"
    part = load_config(None, micro_overrides(micro_model, **{**sets, "train.max_steps": 2}))
    start(part, tmp_path / "part")
    start_or_resume(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / "part")
    resumed = [r for r in read_jsonl(tmp_path / "part" / "metrics.jsonl") if r["step"] >= 1]
    keys = ("control/own_low", "control/own_output", "entropy/mean", "loss/total")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in train]
