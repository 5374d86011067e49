"""The method registry, every built-in end to end through policy_loss, and ``erft methods``."""

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from entropy_rft import control
from entropy_rft.cli.main import main
from entropy_rft.control import registry
from entropy_rft.core.loss import policy_loss, ppo_clipped_mask

BUILTINS = {
    "none", "clip_b", "clip_b_paper", "clip_v", "clip_v_paper", "clip_cov", "kl_cov", "clip_higher",
    "entropy_bonus", "high_entropy", "grad_mask",
    "entropy_adv", "adaptive_entropy", "ce_gppo", "clip_low", "entropic", "steer",  # issue 28: the field's methods
}


@dataclass
class NaiveStats:
    """Float64 token statistics from logits, computed directly from papers.md (Theorem 3.3)."""

    entropy: torch.Tensor
    logp: torch.Tensor
    s_star: torch.Tensor
    s_expected: torch.Tensor
    s_centered: torch.Tensor


def naive_stats(logits, ids):
    p = torch.softmax(logits.double(), -1)
    logp_all = torch.log(p)
    h = -(p * logp_all).sum(-1)
    lp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    s_star = lp.exp() * (h + lp)
    s_exp = (p * p * (h.unsqueeze(-1) + logp_all)).sum(-1)
    return NaiveStats(h, lp, s_star, s_exp, s_star - s_exp)


def _batch(seed=0, b=6, t=10, v=7):
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(b, t, v, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    adv = torch.randn(b, 1, generator=g)
    return naive_stats(logits, ids), adv, mask


def test_builtins_registered_with_defaults():
    assert set(control.available_methods()) >= BUILTINS
    assert control.build_method("clip_b").params() == {"mu": 2.5, "advantage_sign": "negative"}
    assert control.build_method("clip_b_paper").params() == {"mu_low": 2.5, "mu_high": 2.5,
                                                             "advantage_sign": "any"}
    assert control.build_method("clip_v").params() == {"mu": 8.5, "max_frac": 1e-4, "advantage_sign": "released"}
    assert control.build_method("clip_v_paper").advantage_sign == "any"
    assert control.build_method("clip_cov").params() == {"ratio": 2e-4, "lb": 1.0, "ub": 5.0,
                                                         "exclude_clipped": True}
    assert control.build_method("kl_cov").params() == {"ratio": 2e-4, "coef": 1.0}
    assert control.build_method("clip_higher").loss_kwargs() == {"eps_low": 0.2, "eps_high": 0.28}
    assert control.build_method("kl_cov").loss_kwargs() == {"eps_low": None, "eps_high": None, "kl_cov_coef": 1.0}
    eb = control.build_method("entropy_bonus", coef=0.01)
    assert eb.loss_kwargs() == {"entropy_coef": 0.01} and eb.needs_entropy_grad()
    assert control.build_method("high_entropy").top_q == 0.2
    assert control.build_method("none").loss_kwargs() == {}


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as e:
        control.build_method("clipb")
    for name in BUILTINS:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "name, params, bad",
    [
        ("clip_b", {"mu": -1.0}, "mu"),
        ("clip_b", {"mu": None}, "mu"),
        ("clip_b", {"advantage_sign": "neg"}, "advantage_sign"),
        ("clip_b_paper", {"mu_low": -0.5}, "mu_low"),
        ("clip_v", {"max_frac": 1.5}, "max_frac"),
        ("clip_v_paper", {"mu_high": -2}, "mu_high"),
        ("clip_cov", {"ratio": 1.5}, "ratio"),
        ("clip_cov", {"ratio": -0.1}, "ratio"),
        ("clip_cov", {"lb": 5.0, "ub": 1.0}, "lb"),
        ("kl_cov", {"ratio": 2.0}, "ratio"),
        ("kl_cov", {"coef": -1.0}, "coef"),
        ("clip_higher", {"eps_high": -0.1}, "eps_high"),
        ("entropy_bonus", {"coef": "big"}, "coef"),
        ("high_entropy", {"top_q": 1.2}, "top_q"),
        ("grad_mask", {"s_field": "s"}, "s_field"),
        ("grad_mask", {"sample_sign": "any"}, "sample_sign"),
        ("clip_b", {"eps": 0.1}, "eps"),  # unknown parameter
    ],
)
def test_bad_params_name_the_param(name, params, bad):
    with pytest.raises(ValueError, match=bad):
        control.build_method(name, **params)


def test_knobs_and_directions():
    expected = {
        "none": (None, 0), "clip_b": ("mu", -1), "clip_b_paper": ("mu", -1), "clip_v": ("mu", -1),
        "clip_v_paper": ("mu", -1), "clip_cov": ("ratio", 1), "kl_cov": ("ratio", 1),
        "clip_higher": ("eps_high", 1), "entropy_bonus": ("coef", 1), "high_entropy": ("top_q", -1),
        "grad_mask": (None, 0),
    }
    for name, (knob, direction) in expected.items():
        info = control.method_info(name)
        assert (info["knob"], info["knob_raises_entropy"]) == (knob, direction), name
        assert info["paper"] and info["summary"] and info["doc"]
        assert all(p["help"] for p in info["params"])
        m = control.build_method(name)
        if knob is None:
            with pytest.raises(ValueError, match="knob"):
                m.get_knob()
        else:
            m.set_knob(0.5)
            assert m.get_knob() == 0.5


def test_set_knob_validates_and_restores():
    m = control.build_method("clip_v", mu=3.0)
    with pytest.raises(ValueError, match="mu"):
        m.set_knob(-1.0)
    assert m.mu == 3.0
    p = control.build_method("clip_b_paper", mu_low=2.0, mu_high=None)
    assert p.get_knob() == 2.0
    p.set_knob(3.0)
    assert (p.mu_low, p.mu_high) == (3.0, None)
    q = control.build_method("clip_b_paper", mu_low=2.0, mu_high=3.0)
    with pytest.raises(ValueError, match="ambiguous"):
        q.get_knob()
    q.set_knob(1.0)
    assert (q.mu_low, q.mu_high) == (1.0, 1.0)


def test_rollout_masks_equal_the_mask_functions():
    st, adv, mask = _batch()
    cases = {
        ("clip_b", ()): control.clip_b_mask(st.s_star, adv, mask, 1.0, None, "negative"),
        ("clip_b_paper", ()): control.clip_b_mask(st.s_star, adv, mask, 1.0, 1.0, "any"),
        ("clip_v", ()): control.clip_v_mask(st.s_centered, adv, mask, 1.0, None, "negative", 0.05),
        ("clip_v_paper", ()): control.clip_v_mask(st.s_centered, adv, mask, 1.0, 1.0, "any"),
        ("high_entropy", ()): control.high_entropy_mask(st.entropy, mask, 0.3),
    }
    params = {"clip_b": {"mu": 1.0}, "clip_b_paper": {"mu_low": 1.0, "mu_high": 1.0},
              "clip_v": {"mu": 1.0, "max_frac": 0.05}, "clip_v_paper": {"mu_low": 1.0, "mu_high": 1.0},
              "high_entropy": {"top_q": 0.3}}
    for (name, _), want in cases.items():
        masks = control.build_method(name, **params[name]).rollout_masks(st, adv, mask)
        assert masks.zeroed is None and masks.kl_cov_select is None
        assert torch.equal(masks.keep, want), name
        assert 0 < int((mask & ~masks.keep).sum()) < int(mask.sum()), name  # the case is not trivial
    gm = control.build_method("grad_mask", sample_sign="negative", s_sign="negative", s_field="s_centered")
    want = control.grad_mask(st.s_centered, adv, mask, "negative", "negative")
    assert torch.equal(gm.rollout_masks(st, adv, mask).keep, want)


def test_naive_stats_satisfy_corollary_3_4():
    # Sanity of the test helper: E_{k~p}[S_c] = 0 exactly (papers.md, Corollary 3.4).
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 6, generator=g)
    p = torch.softmax(logits.double(), -1)
    e = sum(p[:, k] * naive_stats(logits, torch.full((5,), k)).s_centered for k in range(6))
    assert e.abs().max() < 1e-12


def test_minibatch_masks():
    st, adv, mask = _batch(seed=2)
    lp = st.logp.float().requires_grad_(True)
    old = (st.logp + 0.3 * torch.randn(st.logp.shape, generator=torch.Generator().manual_seed(0))).float()
    clipped = ppo_clipped_mask(lp, old, adv, mask, 0.2, 0.2)
    cov = control.build_method("clip_cov", ratio=0.1, lb=-10.0, ub=10.0)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    m1 = cov.minibatch_masks(lp, old, adv, mask, clipped=clipped, generator=g1)
    m2 = cov.minibatch_masks(lp, old, adv, mask, clipped=clipped, generator=g2)
    assert m1.keep is None and torch.equal(m1.zeroed, m2.zeroed)
    assert int(m1.zeroed.sum()) == max(int(0.1 * int(mask.sum())), 1)
    assert not (m1.zeroed & (clipped | ~mask)).any()
    want = ~control.clip_cov_mask(lp, adv, mask, 0.1, -10.0, 10.0, generator=torch.Generator().manual_seed(5),
                                  exclude=clipped) & mask
    assert torch.equal(m1.zeroed, want)
    kl = control.build_method("kl_cov", ratio=0.1).minibatch_masks(lp, old, adv, mask, clipped=clipped)
    assert torch.equal(kl.kl_cov_select, control.kl_cov_select(lp, adv, mask, 0.1))
    # ratio 0: Clip-Cov is vanilla.
    z = control.build_method("clip_cov", ratio=0.0).minibatch_masks(lp, old, adv, mask, clipped=clipped)
    base, _ = policy_loss(lp, old, adv, mask)
    same, _ = policy_loss(lp, old, adv, mask, zeroed=z.zeroed)
    assert not z.zeroed.any() and torch.equal(base, same)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_runs_through_policy_loss(name):
    st, adv, mask = _batch(seed=3)
    method = control.build_method(name)
    lp = st.logp.float().clone().requires_grad_(True)
    old = st.logp.float()
    ent = st.entropy.float().clone().requires_grad_(True)
    kwargs = method.loss_kwargs()
    rm = method.rollout_masks(st, adv, mask)
    clipped = ppo_clipped_mask(lp, old, adv, mask, kwargs.get("eps_low", 0.2), kwargs.get("eps_high", 0.2))
    mm = method.minibatch_masks(lp, old, adv, mask, clipped=clipped, generator=torch.Generator().manual_seed(0))
    masks = {k: v for src in (rm, mm) for k, v in vars(src).items() if v is not None}
    if method.needs_entropy_grad():
        kwargs["entropy"] = ent
    loss, metrics = policy_loss(lp, old, adv, mask, **kwargs, **masks)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert metrics["loss/pg"] is not None
    if name == "entropy_bonus":
        assert ent.grad[mask].lt(0).all()


def test_register_custom_method():
    @control.register_method
    @dataclass
    class Half(control.Method):
        """Keep every other token."""

        name: ClassVar[str] = "test_half"
        paper: ClassVar[str] = "none"
        summary: ClassVar[str] = "test"
        stride: int = control.param(2, "keep one token in stride")

        def rollout_masks(self, stats, advantages, mask):
            keep = torch.zeros_like(mask)
            keep[..., :: self.stride] = True
            return control.Masks(keep=mask & keep)

    try:
        m = control.build_method("test_half", stride=3)
        assert "test_half" in control.available_methods()
        assert control.method_info("test_half")["params"][0]["default"] == 2
        assert m.rollout_masks(None, None, torch.ones(1, 4, dtype=torch.bool)).keep.tolist() == [[1, 0, 0, 1]]
        with pytest.raises(ValueError, match="already registered"):

            @control.register_method
            @dataclass
            class Other(control.Method):
                name: ClassVar[str] = "test_half"

        with pytest.raises(TypeError):
            control.register_method(int)
    finally:
        registry._REGISTRY.pop("test_half", None)


def test_cli_methods_table_and_json(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in BUILTINS:
        assert name in out
    assert main(["methods", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_name = {d["name"]: d for d in data}
    assert set(by_name) >= BUILTINS
    assert by_name["clip_v"]["knob"] == "mu" and by_name["clip_v"]["knob_raises_entropy"] == -1
    assert {p["name"]: p["default"] for p in by_name["clip_cov"]["params"]}["ub"] == 5.0
    assert main(["methods", "--json", "kl_cov"]) == 0
    assert [d["name"] for d in json.loads(capsys.readouterr().out)] == ["kl_cov"]
    assert main(["methods", "nope"]) == 2
    assert "known methods" in capsys.readouterr().err
