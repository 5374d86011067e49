"""STEER (Hao et al. 2025, arXiv 2510.10150; issue 28): hand-computed Ω and weights, a peer test against a
transcription of the authors' code, its relation to Paper A's S_k, the weight lens (its terms sum to the total
first-order ΔH), extreme logits, bad knob values, ``erft methods`` and one tiny training run with the
counterfactual probe."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from entropy_rft import control
from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import load_config
from entropy_rft.control.builtins import steer_entropy_change, steer_weights
from entropy_rft.core.dynamics import token_stats
from entropy_rft.core.loss import agg_weights, policy_loss, ppo_clipped_mask
from entropy_rft.core.theory import first_order_entropy_change
from entropy_rft.launch.run import start
from entropy_rft.rundir.files import read_jsonl
from micro import make_micro_policy, micro_overrides

ONES = torch.ones(1, 4, dtype=torch.bool)


def grad_coef(logp, old, adv, mask, **kw):
    """g = −∂L/∂logp by autograd, float64 (the test's own, not control.gradient_coefficients)."""
    lp = logp.detach().double().requires_grad_(True)
    loss, _ = policy_loss(lp, old.double(), adv, mask, **kw)
    loss.backward()
    return -lp.grad


def _by_hand_batch():
    """p = (0.5, 0.9, 0.2, 0.5), H = 1 − log p (so log p + H = 1), A = (1, 1, −1, 0): on-policy
    Ω = A·(1 − p)·1 = (0.5, 0.1, −0.8, 0)."""
    p = torch.tensor([[0.5, 0.9, 0.2, 0.5]])
    lp = torch.log(p)
    return lp, 1.0 - lp, torch.tensor([[1.0, 1.0, -1.0, 0.0]])


# ----------------------------------------------------------------------------- hand-computed cases


def test_entropy_change_by_hand():
    lp, h, a = _by_hand_batch()
    omega = steer_entropy_change(lp, lp, h, a, ONES)
    assert omega.dtype == torch.float32
    assert omega.flatten().tolist() == pytest.approx([0.5, 0.1, -0.8, 0.0], abs=1e-6)
    # off-policy: p_old 0.25 for the first token: Ω = A/p_old·p(1−p)·1 = 1/0.25·0.25 = 1
    old = lp.clone()
    old[0, 0] = math.log(0.25)
    assert float(steer_entropy_change(lp, old, h, a, ONES)[0, 0]) == pytest.approx(1.0, rel=1e-6)
    # off the mask: 0; per-sequence advantages broadcast
    mask = torch.tensor([[True, False, True, True]])
    got = steer_entropy_change(lp, lp, h, torch.tensor([2.0]), mask)
    assert got.flatten().tolist() == pytest.approx([1.0, 0.0, 1.6, 1.0], abs=1e-6)


def test_weights_by_hand():
    x = torch.tensor([[0.5, 0.1, 0.8, 0.0]])  # |Ω| of the batch above
    # linear, λ in [0.8, 1.2], Ω_min 0, Ω_max 0.8: λ = 1.2 − 0.5·|Ω|
    lin = steer_weights(x, ONES, 0.8, 1.2, "linear")
    assert lin.flatten().tolist() == pytest.approx([0.95, 1.15, 0.8, 1.2], abs=1e-6)
    # exp: k = −log 0.8 / 0.8, λ = 0.8^(|Ω|/0.8)
    ex = steer_weights(x, ONES, 0.8, 1.2, "exp")
    assert ex.flatten().tolist() == pytest.approx([0.8 ** 0.625, 0.8 ** 0.125, 0.8, 1.0], rel=1e-6)
    # exp below the floor: Ω_max 0.008 < 0.02, so λ = 0.8^(|Ω|/0.02) and nobody reaches λ_min
    small = steer_weights(x / 100, ONES, 0.8, 1.0, "exp")
    assert small.flatten().tolist() == pytest.approx([0.8 ** 0.25, 0.8 ** 0.05, 0.8 ** 0.4, 1.0], rel=1e-6)
    # linear with every |Ω| equal: the midpoint; a token off the mask gets 0 and does not enter min/max
    same = steer_weights(torch.full((1, 4), 0.3), ONES, 0.8, 1.2, "linear")
    assert same.flatten().tolist() == pytest.approx([1.0] * 4)
    mask = torch.tensor([[True, True, True, False]])
    part = steer_weights(torch.tensor([[0.2, 0.4, 0.6, 99.0]]), mask, 0.8, 1.2, "linear")
    assert part.flatten().tolist() == pytest.approx([1.2, 1.0, 0.8, 0.0], abs=1e-6)
    assert torch.equal(steer_weights(x, torch.zeros(1, 4, dtype=torch.bool), 0.8, 1.2), torch.zeros(1, 4))


def test_method_weights_the_loss_by_hand():
    """Default (exp, λ_min 0.8) on the by-hand batch, on-policy, token-mean over 4: g = λ·A/4."""
    lp, h, a = _by_hand_batch()
    m = control.build_method("steer")
    shift = m.rollout_masks(NS(logp=lp, entropy=h), a, ONES).adv_shift
    lam = [0.8 ** 0.625, 0.8 ** 0.125, 0.8, 1.0]
    assert shift.flatten().tolist() == pytest.approx([lam[0] - 1, lam[1] - 1, -(lam[2] - 1), 0.0], rel=1e-6)
    g = grad_coef(lp, lp, a, ONES, adv_shift=shift)
    assert g.flatten().tolist() == pytest.approx([lam[0] / 4, lam[1] / 4, -lam[2] / 4, 0.0], rel=1e-6)
    lin = control.build_method("steer", mapping="linear")
    g_lin = grad_coef(lp, lp, a, ONES, adv_shift=lin.rollout_masks(NS(logp=lp, entropy=h), a, ONES).adv_shift)
    assert g_lin.flatten().tolist() == pytest.approx([0.95 / 4, 1.15 / 4, -0.8 / 4, 0.0], rel=1e-6)
    # λ_min = 1 with the exp mapping is vanilla
    one = control.build_method("steer", token_weight_min=1.0)
    assert not one.rollout_masks(NS(logp=lp, entropy=h), a, ONES).adv_shift.any()


def test_omega_is_paper_a_s_star_times_one_minus_p_over_p():
    """Ω = A·r·(1 − p_k)·S_k/p_k with S_k = p_k(H + log p_k) from core.dynamics.token_stats (float64 here);
    and it is not Theorem 3.3's −A·S_c (it leaves out E_p[S] over the vocabulary)."""
    g = torch.Generator().manual_seed(4)
    logits = 1.5 * torch.randn(3, 5, 9, generator=g)
    ids = torch.randint(0, 9, (3, 5), generator=g)
    st = token_stats(logits, ids)
    adv = torch.randn(3, 1, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    p = st.logp.double().exp()
    want = adv.double() * (1 - p) * st.s_star.double() / p
    torch.testing.assert_close(steer_entropy_change(st.logp, st.logp, st.entropy, adv, mask).double(), want,
                               rtol=1e-5, atol=1e-6)
    s_c_form = -adv.double() * (1 - p) * st.s_centered.double() / p
    assert not torch.allclose(want, -s_c_form, rtol=1e-2)


# ----------------------------------------------------------------------------- peer: the authors' code


def authors_token_weights(advantages, entropys, old_log_prob, log_prob, response_mask, wmin, wmax, linear):
    """``compute_token_weights`` of github.com/zz-haooo/STEER, verl/trainer/ppo/core_algos.py lines 580-676
    (commit b31df71), written from reading it, one token at a time in Python floats: x = clamp(p, 1e-8,
    1 − 1e-8), f = x(1 − x)(log x + H), metric = |A / clamp(p_old, 1e-8, 1) · f| (non-finite: 0); over the valid
    tokens linear: clamp(wmax − (m − min)·(wmax − wmin)/(max − min), wmin, wmax) (midpoint when max == min),
    else clamp(exp(−k·m), wmin, 1) with k = −log(wmin)/max(max, 0.02)."""
    rows, cols = response_mask.shape
    metric = [[0.0] * cols for _ in range(rows)]
    for i in range(rows):
        for j in range(cols):
            x = min(max(math.exp(float(log_prob[i, j])), 1e-8), 1.0 - 1e-8)
            f_x = x * (1 - x) * (math.log(x) + float(entropys[i, j]))
            old_prob = min(max(math.exp(float(old_log_prob[i, j])), 1e-8), 1.0)
            value = float(advantages[i, j]) / old_prob * f_x
            metric[i][j] = abs(value) if math.isfinite(value) else 0.0
    valid = [metric[i][j] for i in range(rows) for j in range(cols) if response_mask[i, j]]
    lo, hi = min(valid), max(valid)
    out = torch.zeros(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            if not response_mask[i, j]:
                continue
            m = metric[i][j]
            if linear:
                w = wmax - (m - lo) * (wmax - wmin) / (hi - lo) if hi > lo else (wmin + wmax) / 2
                w = min(max(w, wmin), wmax)
            else:
                k = -math.log(wmin) / max(hi, 0.02)
                w = min(max(math.exp(-k * m), wmin), 1.0)
            out[i, j] = w
    return out


def authors_steer_loss(old_log_prob, log_prob, advantages, response_mask, token_weights, clip_low, clip_high,
                       clip_ratio_c):
    """``compute_policy_loss_with_entropy`` of the same file, lines 680-800 (loss_agg_mode token-mean), per
    token: ratio = exp(clamp(logp − old, −20, 20)), PPO's max(−A·r, −A·clip(r)), for A < 0 the dual clip
    min(·, −A·c), times the token weight; the masked mean over tokens."""
    total, count = 0.0, 0
    rows, cols = response_mask.shape
    for i in range(rows):
        for j in range(cols):
            if not response_mask[i, j]:
                continue
            a = float(advantages[i, j])
            ratio = torch.exp(torch.clamp(log_prob[i, j] - old_log_prob[i, j], -20.0, 20.0))
            loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
            if a < 0:
                loss = torch.minimum(torch.tensor(-a * clip_ratio_c, dtype=loss.dtype), loss)
            total = total + loss * float(token_weights[i, j])
            count += 1
    return total / count


def _peer_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 8
    logits = 2.0 * torch.randn(b, t, 11, generator=g)
    ids = torch.randint(0, 11, (b, t), generator=g)
    st = token_stats(logits, ids)
    mask = torch.rand(b, t, generator=g) > 0.2
    adv = torch.randn(b, 1, generator=g).expand(b, t) * mask
    new = st.logp.double() + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    new = torch.minimum(new, torch.zeros_like(new))
    neg = ((adv < 0) & mask).nonzero()[0]
    new[neg[0], neg[1]] = st.logp[neg[0], neg[1]].double() + math.log(12.0)  # r = 12 > c: the dual clip acts
    return st, adv, mask, new


@pytest.mark.parametrize("mapping,wmax", [("exp", 1.0), ("linear", 1.2)])
def test_matches_the_authors_code_on_the_first_update(mapping, wmax):
    """The first update of a step (current policy = old policy, as in the authors' first micro-batch): our
    method's weights, loss and gradient equal the authors' code on the same batch (one micro-batch)."""
    st, adv, mask, _ = _peer_batch()
    m = control.build_method("steer", mapping=mapping, token_weight_min=0.8, token_weight_max=wmax)
    want_w = authors_token_weights(adv, st.entropy, st.logp, st.logp, mask, 0.8, wmax, mapping == "linear")
    shift = m.rollout_masks(st, adv, mask).adv_shift
    lam = steer_weights(steer_entropy_change(st.logp, st.logp, st.entropy, adv, mask).abs(), mask, 0.8, wmax,
                        mapping)
    torch.testing.assert_close(lam.double(), want_w, rtol=1e-5, atol=1e-6)
    assert want_w[mask].min() == pytest.approx(0.8) and len(set(want_w[mask].tolist())) > 10
    old = st.logp.double()
    ours_lp = old.clone().requires_grad_(True)
    ours, _ = policy_loss(ours_lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=10.0, adv_shift=shift)
    ours.backward()
    ref_lp = old.clone().requires_grad_(True)
    ref = authors_steer_loss(old, ref_lp, adv, mask, want_w, 0.2, 0.28, 10.0)
    ref.backward()
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mapping,wmax", [("exp", 1.0), ("linear", 1.2)])
def test_matches_the_authors_code_off_policy(mapping, wmax):
    """A later update (current ≠ old policy: r ≠ 1, PPO's clip and the dual clip act): the pure functions with the
    current log-probs equal the authors' weights, and the loss with adv_shift = (λ − 1)·A equals their weighted
    loss in value and gradient. (The method itself keeps the old policy's p: a documented deviation.)"""
    st, adv, mask, new = _peer_batch(1)
    want_w = authors_token_weights(adv, st.entropy, st.logp, new, mask, 0.8, wmax, mapping == "linear")
    lam = steer_weights(steer_entropy_change(new, st.logp, st.entropy, adv, mask).abs(), mask, 0.8, wmax, mapping)
    torch.testing.assert_close(lam.double(), want_w, rtol=1e-5, atol=1e-6)
    old = st.logp.double()
    shift = torch.where(mask, (lam.double() - 1) * adv, torch.zeros_like(old))
    ours_lp = new.clone().requires_grad_(True)
    ours, met = policy_loss(ours_lp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=10.0, adv_shift=shift)
    ours.backward()
    assert met["clip/dual_frac"] > 0 and met["clip/ratio_frac"] > 0
    ref_lp = new.clone().requires_grad_(True)
    ref = authors_steer_loss(old, ref_lp, adv, mask, lam.double(), 0.2, 0.28, 10.0)
    ref.backward()
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-10)
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad, rtol=1e-10, atol=1e-12)
    # the weights matter: unweighted PPO gives another gradient
    plain = new.clone().requires_grad_(True)
    policy_loss(plain, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=10.0)[0].backward()
    assert not torch.allclose(plain.grad, ref_lp.grad, rtol=1e-3)


# ----------------------------------------------------------------------------- the lens, extremes, knob


def test_weight_lens_terms_sum_to_the_total_first_order_change():
    """g = λ·A·r·w on the tokens PPO's clip leaves (closed form), so the method's first-order ΔH is
    theory.first_order_entropy_change with λ·A; the lens's quadrant terms plus the vanilla total give it."""
    st, adv, mask, new = _peer_batch(2)
    old = st.logp.double()
    m = control.build_method("steer", token_weight_min=0.5)
    shift = m.rollout_masks(st, adv, mask).adv_shift
    kw = dict(eps_low=0.2, eps_high=0.28, agg="seq-mean-token-mean")
    g_m = control.gradient_coefficients(new, old, adv, mask, adv_shift=shift, **kw)
    g_v = control.gradient_coefficients(new, old, adv, mask, **kw)
    s_c = st.s_centered.double()
    out = control.weight_lens(g_m, g_v, adv, s_c, mask)
    lam = steer_weights(steer_entropy_change(st.logp, st.logp, st.entropy, adv, mask).abs(), mask, 0.5, 1.2)
    w, r = agg_weights(mask, "seq-mean-token-mean", torch.float64), torch.exp(new - old)
    clipped = ppo_clipped_mask(new, old, adv, mask, 0.2, 0.28)
    total_m = first_order_entropy_change(s_c, lam.double() * adv, weights=w, ratio=r, mask=mask, clipped=clipped)
    total_v = first_order_entropy_change(s_c, adv, weights=w, ratio=r, mask=mask, clipped=clipped)
    assert out["lensw/dH_method"] == pytest.approx(float(total_m.per_token.sum()), rel=1e-6)
    assert out["lensw/dH_vanilla"] == pytest.approx(float(total_v.per_token.sum()), rel=1e-12)
    quads = sum(out[f"lensw/dH_change/{q}"] for q in control.QUADRANTS)
    assert quads == pytest.approx(out["lensw/dH_change"], rel=1e-12, abs=1e-15)
    assert out["lensw/dH_vanilla"] + quads == pytest.approx(out["lensw/dH_method"], rel=1e-12)
    assert out["lensw/dH_change"] != 0.0 and out["lensw/dH_change/zero"] == 0.0
    for q in ("pos_spos", "pos_sneg", "neg_spos", "neg_sneg"):  # reweights; removes and adds nothing
        assert out[f"lensw/removed_rate/{q}"] in (0.0, None) and out[f"lensw/added_rate/{q}"] in (0.0, None), q
    assert any(out[f"lensw/reweighted_rate/{q}"] > 0.5 for q in control.QUADRANTS if q != "zero")


def test_finite_for_extreme_logits():
    logits = torch.tensor([[[1e4, -1e4, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-3e4, 3e4, -3e4, 0.0]]])
    ids = torch.tensor([[1, 2, 1]])  # p = 0 (logp −2e4), p = 1/4, p = 1
    st = token_stats(logits, ids)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for adv in (torch.tensor([1e6]), torch.tensor([-1e-30]), torch.tensor([0.0])):
        for mapping in ("exp", "linear"):
            m = control.build_method("steer", mapping=mapping, token_weight_min=1e-6)
            omega = steer_entropy_change(st.logp, st.logp, st.entropy, adv, mask)
            assert torch.isfinite(omega).all()
            shift = m.rollout_masks(st, adv, mask).adv_shift
            assert torch.isfinite(shift).all()
            lp = st.logp.clone().requires_grad_(True)
            loss, _ = policy_loss(lp, st.logp, adv, mask, adv_shift=shift)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    # a NaN entropy on a valid token counts as Ω = 0 (the authors' rule), off the mask it is ignored
    h = torch.tensor([[float("nan"), 1.0, 1.0]])
    assert steer_entropy_change(st.logp, st.logp, h, torch.tensor([1.0]), mask)[0, 0] == 0.0


def test_bad_knob_values_name_the_field():
    for params, words in (({"token_weight_min": 0.0}, "token_weight_min must be > 0, got 0.0"),
                          ({"token_weight_min": 1.5}, "token_weight_min must be in (0, 1] with mapping 'exp'"),
                          ({"mapping": "linear", "token_weight_max": 0.7},
                           "token_weight_min must be <= token_weight_max with mapping 'linear'"),
                          ({"mapping": "log"}, "mapping must be exp or linear, got 'log'"),
                          ({"omega_floor": -1.0}, "omega_floor must be > 0, got -1.0"),
                          ({"token_weight_min": float("nan")}, "token_weight_min must be a finite number")):
        with pytest.raises(ValueError) as err:
            control.build_method("steer", **params)
        assert str(err.value).startswith(words) and "\n" not in str(err.value), params
    m = control.build_method("steer")
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        m.set_knob(1.2)
    assert m.token_weight_min == 0.8  # restored
    lin = control.build_method("steer", mapping="linear")
    lin.set_knob(1.1)  # linear: up to token_weight_max
    assert lin.get_knob() == 1.1


def test_bad_knob_in_the_config_is_one_line(tmp_path, capsys):
    from entropy_rft.cli.main import main

    with pytest.raises(UserError) as err:
        load_config(None, ["method.name=steer", "method.params={token_weight_min: 1.5}"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config field 'method' invalid: token_weight_min") and "(0, 1]" in msg
    out = tmp_path / "run"
    assert main(["train", "--method", "steer", "--set", "method.params={token_weight_min: 0}", "--out",
                 str(out)]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines == ["erft train: error: config field 'method' invalid: token_weight_min must be > 0, got 0"]
    assert not out.exists()


def test_registered_with_paper_knob_direction_and_lens_line(capsys):
    from entropy_rft.cli.main import main

    info = control.method_info("steer")
    assert (info["knob"], info["knob_raises_entropy"], info["stage"]) == ("token_weight_min", -1, "rollout")
    assert "2510.10150" in info["paper"] and info["engines"] == ["native"]
    assert {p["name"]: p["default"] for p in info["params"]} == {
        "token_weight_min": 0.8, "token_weight_max": 1.2, "mapping": "exp", "omega_floor": 0.02}
    assert info["quadrants"]["zero"] == "-" and info["quadrants"]["neg_sneg"].startswith("reweights")
    assert main(["methods", "steer"]) == 0
    text = capsys.readouterr().out
    assert "steer  (" in text and "arXiv 2510.10150" in text and "token_weight_min" in text
    assert "lens: pos_spos: reweights" in text and "engines: native only" in text
    assert main(["methods", "--json", "steer"]) == 0
    (js,) = json.loads(capsys.readouterr().out)
    assert js["direction"] == "increasing token_weight_min lowers entropy"


def test_refused_on_trl():
    with pytest.raises(UserError, match="method 'steer' runs on engine 'native' only"):
        load_config(None, ["method.name=steer"], extra={"engine": "trl"})


# ----------------------------------------------------------------------------- training: counterfactual probe


def test_counterfactual_probe_and_lens_in_a_run(tmp_path):
    """Two tiny steps (two minibatches each): the probe's vanilla update from the same state at step 1 is the
    real vanilla run's step 1, the method's own ΔH is the step's, the weight lens is logged, and the method
    changed the update."""
    model = make_micro_policy(tmp_path / "policy")
    sets = {"eval.every": 0, "train.max_steps": 2, "algo.minibatches": 2, "probe.counterfactual_every": 1,
            "probe.jvp_every": 0, "train.checkpoint_every": 2, "rollout.prompts_per_step": 8,
            "method.name": "steer", "method.params": "{token_weight_min: 0.2}"}
    start(load_config(None, micro_overrides(model, **sets)), tmp_path / "steer")
    rows = read_jsonl(tmp_path / "steer" / "metrics.jsonl")
    base = {**sets, "method.name": "none", "method.params": "{}", "train.max_steps": 1}
    start(load_config(None, micro_overrides(model, **base)), tmp_path / "none")
    (ref,) = read_jsonl(tmp_path / "none" / "metrics.jsonl")
    assert rows[0]["probe/dH_vanilla"] == ref["probe/dH_actual"]
    for row in rows:
        assert row["probe/dH_method"] == pytest.approx(row["probe/dH_actual"])
        assert row["lensw/dH_change"] is not None and math.isfinite(row["lensw/dH_method"])
        assert row["loss/adv_shift_mean"] is not None
    assert all(r["probe/dH_method_effect"] not in (None, 0.0) for r in rows)
    assert any((rows[0][f"lensw/reweighted_rate/{q}"] or 0) > 0 for q in control.QUADRANTS)
    assert Path(tmp_path / "steer" / "metrics.jsonl").stat().st_size > 0
