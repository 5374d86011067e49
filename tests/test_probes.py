"""The deeper probes: agreement metrics, the forward-mode JVP against finite differences, and the
counterfactual probe (exact state restore: a run with it on logs the same training metrics as with it off)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from entropy_rft.models.loading import load_policy
from entropy_rft.policy.jvp import entropy_jvp
from entropy_rft.policy.rollout import position_ids, sample
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.training.probe import agreement_metrics, counterfactual_metrics, due
from micro import make_micro_policy, micro_overrides


def test_agreement_metrics_against_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    actual = torch.randn(4, 6, generator=g, dtype=torch.float64)
    pred = 0.7 * actual + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    pred[0, :2] = 0.0
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[3, 4:] = False
    m = agreement_metrics(pred, actual, mask, "probe/x_")
    pairs = [(float(p), float(a)) for p, a, v in zip(pred.flatten(), actual.flatten(), mask.flatten()) if v]
    nz = [(p, a) for p, a in pairs if p != 0 and a != 0]
    agree = [(p, a) for p, a in nz if (p > 0) == (a > 0)]
    assert m["probe/x_sign_agreement"] == pytest.approx(len(agree) / len(nz))
    assert m["probe/x_sign_agreement_weighted"] == pytest.approx(sum(abs(p) for p, _ in agree)
                                                                 / sum(abs(p) for p, _ in nz))
    mp, ma = sum(p for p, _ in nz) / len(nz), sum(a for _, a in nz) / len(nz)
    cov = sum((p - mp) * (a - ma) for p, a in nz)
    var_p, var_a = sum((p - mp) ** 2 for p, _ in nz), sum((a - ma) ** 2 for _, a in nz)
    assert m["probe/x_corr"] == pytest.approx(cov / math.sqrt(var_p * var_a))
    err = math.sqrt(sum((p - a) ** 2 for p, a in pairs)) / math.sqrt(sum(a * a for _, a in pairs))
    assert m["probe/x_rel_err"] == pytest.approx(err)
    empty = agreement_metrics(pred, actual, torch.zeros_like(mask), "p/")
    assert all(v is None for v in empty.values())


def test_counterfactual_metrics_and_due():
    assert counterfactual_metrics(-0.01, -0.03) == {"probe/dH_method": -0.01, "probe/dH_vanilla": -0.03,
                                                    "probe/dH_method_effect": pytest.approx(0.02)}
    assert counterfactual_metrics(None, -0.03)["probe/dH_method_effect"] is None
    assert [s for s in range(1, 13) if due(5, s)] == [5, 10] and not any(due(0, s) for s in range(1, 13))


# ----------------------------------------------------------------------------- JVP


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("probes") / "policy")


def _entropy_naive(model, rb) -> torch.Tensor:
    """Per response position, entropy from the model's full logits in float64 (no fused path, no JVP)."""
    am = rb.attention_mask.long()
    logits = model(input_ids=rb.input_ids, attention_mask=am, position_ids=position_ids(am)).logits
    p, r = rb.prompt_ids.shape[1], rb.response_ids.shape[1]
    lp = torch.log_softmax(logits[:, p - 1 : p + r - 1].double(), -1)
    return -(lp.exp() * lp).sum(-1)


def test_jvp_matches_central_finite_differences(micro_model):
    model, tok = load_policy(str(micro_model))
    model = model.double()
    assert model.config._attn_implementation == "sdpa"  # forward AD would fail on SDPA; the probe switches
    g = torch.Generator().manual_seed(0)
    rb = sample(model, tok, ["12>7:", "345>42:", "9>1:", "77>3:"], max_new_tokens=6, temperature=1.0, top_p=1.0,
                backend="kv", generator=g)
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    delta = {n: 1e-2 * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in theta.items()}
    h, dh = entropy_jvp(model, rb, 1.0, theta, delta)
    assert model.config._attn_implementation == "sdpa"  # restored

    @torch.no_grad()
    def entropy_at(eps: float) -> torch.Tensor:
        for n, p in model.named_parameters():
            p.copy_(theta[n] + eps * delta[n])
        return _entropy_naive(model, rb)

    m = rb.response_mask
    torch.testing.assert_close(h[m], entropy_at(0.0)[m], rtol=0, atol=1e-6)  # RoPE runs in float32 in HF
    errs = {}
    for eps in (3e-2, 1e-2, 3e-3):  # below ~1e-3 the float32 RoPE's rounding (1e-7 / eps) dominates
        fd = (entropy_at(eps) - entropy_at(-eps)) / (2 * eps)
        errs[eps] = float((dh - fd)[m].abs().max())
    scale = float(dh[m].abs().max())
    assert scale > 1e-2
    assert errs[3e-3] < 1e-3 * scale  # agrees to first order
    # and the gap shrinks like eps^2 (x9 per factor 3): what is left is the central difference's remainder
    assert errs[3e-2] > 5 * errs[1e-2] > 25 * errs[3e-3]
    # A wrong tangent (one tensor's direction flipped) does not pass.
    bad = {**delta, "model.norm.weight": -delta["model.norm.weight"]}
    _, dh_bad = entropy_jvp(model, rb, 1.0, theta, bad)
    fd = (entropy_at(3e-3) - entropy_at(-3e-3)) / 6e-3
    assert float((dh_bad - fd)[m].abs().max()) > 100 * errs[3e-3]


def _run(model: Path, out: Path, **extra) -> list[dict]:
    start(load_config(None, micro_overrides(model, **{"eval.every": 0, **extra})), out)
    return read_jsonl(out / "metrics.jsonl")


def test_jvp_probe_in_training_is_near_exact_at_a_small_step(micro_model, tmp_path):
    rows = _run(micro_model, tmp_path / "r", **{"optim.lr": 3e-5, "probe.jvp_every": 1, "train.max_steps": 5,
                                                "probe.counterfactual_every": 0})
    live = [r for r in rows if r["probe/jvp_corr"] is not None]
    assert len(live) >= 2
    for r in live:
        assert r["probe/jvp_corr"] > 0.99 and r["probe/jvp_sign_agreement"] > 0.95, r
        assert r["probe/jvp_rel_err"] < 0.1
        assert r["probe/dH_jvp"] == pytest.approx(r["probe/dH_actual"], rel=0.1, abs=1e-6)
    # The tabular level on the same tokens is far weaker (logits share parameters).
    tab = [r["probe/corr"] for r in live if r["probe/corr"] is not None]
    assert tab and sum(tab) / len(tab) < 0.9


# ----------------------------------------------------------------------------- counterfactual


def _training_view(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("probe/", "time/", "perf/"))} for r in rows]


@pytest.mark.parametrize("extra", [
    {"method.name": "clip_v", "method.params": "{mu: 0.5, max_frac: null}"},  # rollout-level masks
    {"method.name": "clip_cov", "method.params": "{ratio: 0.2, lb: -100.0, ub: 100.0}"},  # its own RNG
    {"method.name": "entropy_bonus", "method.params": "{coef: 0.05}", "method.entropy_target": "0.9x",
     "algo.algorithm": "ppo"},  # loss term, autopilot knob, value head
    {"method.name": "entropic", "method.params": "{high_prob: 0.2, target: 0.9x}"},  # its own controller's state
], ids=["clip_v", "clip_cov", "autopilot-ppo", "entropic"])
def test_counterfactual_on_and_off_give_identical_training(micro_model, tmp_path, extra):
    on = _run(micro_model, tmp_path / "on", **{"probe.counterfactual_every": 1, "probe.jvp_every": 1,
                                               "train.max_steps": 4, **extra})
    off = _run(micro_model, tmp_path / "off", **{"probe.counterfactual_every": 0, "probe.jvp_every": 0,
                                                 "train.max_steps": 4, **extra})
    assert _training_view(on) == _training_view(off)
    assert all("probe/dH_method_effect" in r for r in on) and not any("probe/dH_vanilla" in r for r in off)
    assert any(r["probe/dH_method_effect"] not in (None, 0.0) for r in on)  # the method did something
    for r in on:
        assert r["probe/dH_method"] == pytest.approx(r["probe/dH_actual"])


def test_counterfactual_vanilla_equals_a_real_vanilla_step(micro_model, tmp_path):
    """Step 1 starts from the same state and batch under any method, so the probe's vanilla ΔH must equal
    the ΔH of a real run of method 'none' at step 1; and under 'none' the method's effect is exactly 0."""
    clip = _run(micro_model, tmp_path / "clip", **{"method.name": "clip_v", "method.params": "{mu: 0.5}",
                                                   "probe.counterfactual_every": 1, "train.max_steps": 2,
                                                   "rollout.prompts_per_step": 8})
    none = _run(micro_model, tmp_path / "none", **{"probe.counterfactual_every": 1, "train.max_steps": 2,
                                                   "rollout.prompts_per_step": 8})
    assert none[0]["probe/dH_actual"] != 0.0
    assert clip[0]["probe/dH_vanilla"] == none[0]["probe/dH_actual"]
    assert all(r["probe/dH_method_effect"] == 0.0 for r in none)


def test_tabular_probe_metrics_by_hand():
    from entropy_rft.training.probe import probe_metrics

    pred = torch.tensor([[0.2, -0.1, 0.0, 0.3, 9.0]])
    actual = torch.tensor([[0.1, 0.1, 0.5, -0.2, 9.0]])
    mask = torch.tensor([[True, True, True, True, False]])  # the fifth token is padding
    m = probe_metrics(pred, actual, mask)
    # Tokens where both are non-zero: 0 (+,+ agree), 1 (-,+), 3 (+,-).
    assert m["probe/sign_agreement"] == pytest.approx(1 / 3)
    assert m["probe/sign_agreement_weighted"] == pytest.approx(0.2 / 0.6)
    assert m["probe/corr"] == pytest.approx(float(np.corrcoef([0.2, -0.1, 0.3], [0.1, 0.1, -0.2])[0, 1]))
    assert m["probe/dH_pred"] == pytest.approx(0.1) and m["probe/dH_actual"] == pytest.approx(0.125)
    assert m["probe/batch_sign_agree"] == 1.0 and "probe/rel_err" not in m
