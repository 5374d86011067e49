"""The loss's typed interface (core.loss_types): settings validated when built, inputs checked when built, metrics
as tensors until read, and the typed call equal to the keyword call. Expected values are worked by hand."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from entropy_rft import LossInputs, LossOutputs, LossSettings, Masks, compute_policy_loss, policy_loss
from entropy_rft.common.options import AGG_MODES, KL_ESTIMATORS
from entropy_rft.core.loss_types import Agg, KLEstimator, LossOverrides, read_metrics
from host_reads import Reads, per_tensor_metrics


def test_literals_name_the_accepted_options():
    assert Agg.__args__ == AGG_MODES and KLEstimator.__args__ == KL_ESTIMATORS


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"agg": "mean"}, "agg must be one of"),
    ({"eps_low": -0.1}, "eps_low must be None or a number >= 0"),
    ({"eps_high": True}, "eps_high must be None or a number >= 0"),
    ({"dual_clip": 1.0}, "dual_clip must be None or a number > 1"),
    ({"ref_kl_estimator": "k4"}, "ref_kl_estimator must be one of"),
    ({"entropy_coef": float("nan")}, "entropy_coef must be a number"),
    ({"weight_alpha": "0.1"}, "weight_alpha must be a number"),
])
def test_settings_are_validated_when_built(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LossSettings(**kwargs)


def test_settings_are_frozen_and_give_their_keywords():
    s = LossSettings(eps_high=0.28)
    with pytest.raises(AttributeError):
        s.eps_high = 0.3  # type: ignore[misc]
    assert s.kwargs()["eps_high"] == 0.28 and s.kwargs()["agg"] == "token-mean" and len(s.kwargs()) == 12


def test_inputs_are_checked_when_built():
    mask = torch.ones(2, 3, dtype=torch.long)  # TRL's int64 completion mask
    x = torch.zeros(2, 3)
    inp = LossInputs(x, x, torch.tensor([1.0, -1.0]), mask, Masks(keep=torch.ones(2, 3, dtype=torch.long)))
    assert inp.mask.dtype == torch.bool and inp.masks.keep.dtype == torch.bool
    assert inp.advantages.shape == (2, 3) and inp.advantages[1, 2] == -1.0  # per sequence, broadcast
    with pytest.raises(ValueError, match="zeroed must have the shape of mask"):
        LossInputs(x, x, torch.zeros(2), mask, Masks(zeroed=torch.zeros(2, 2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="eps_high must be finite and >= 0"):
        LossInputs(x, x, torch.zeros(2), mask, Masks(eps_high=torch.full((2, 3), -1.0)))
    with pytest.raises(ValueError, match="kl_cov_coef is non-zero but kl_cov_select is None"):
        compute_policy_loss(LossInputs(x, x, torch.zeros(2), mask), LossSettings(kl_cov_coef=1.0))


def test_hand_worked_clip_and_metrics_as_tensors():
    # one row, three tokens, A = +1; log-ratios 0.3, -0.1 and (padding) 5: r = e^0.3 = 1.3499 > 1.2 is clipped to
    # 1.2, r = e^-0.1 = 0.9048 is not; the padded token counts nowhere. token-mean: -(1.2 + 0.9048) / 2
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.3, -0.1, 5.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    out = compute_policy_loss(LossInputs(logp, old, torch.tensor([1.0]), mask), LossSettings())
    assert isinstance(out, LossOutputs)
    assert all(v is None or isinstance(v, torch.Tensor) for v in out.terms.values())  # nothing read yet
    assert out.loss.item() == pytest.approx(-(1.2 + math.exp(-0.1)) / 2, abs=1e-6)
    out.loss.backward()
    # the clipped token has no gradient; the other's is -A·r/2
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1].item() == pytest.approx(-math.exp(-0.1) / 2, abs=1e-6)
    m = out.metrics()
    assert m["clip/ratio_high_frac"] == 0.5 and m["clip/ratio_low_frac"] == 0.0 and m["tokens/counted"] == 2.0
    assert m["ratio/max"] == pytest.approx(math.exp(0.3), rel=1e-6) and m["loss/counted_frac"] == 1.0
    assert m["clip/dual_frac"] is None and "clip/ce_frac" not in m


def test_no_counted_token_gives_no_numbers():
    x = torch.zeros(1, 2, requires_grad=True)
    out = compute_policy_loss(LossInputs(x, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool),
                                         Masks(keep=torch.zeros(1, 2, dtype=torch.bool))), LossSettings())
    out.loss.backward()  # a zero with a graph
    m = out.metrics()
    assert m["loss/total"] is None and m["ratio/mean"] is None and m["tokens/counted"] == 0.0


def test_typed_call_equals_keyword_call_with_every_term():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    mask = torch.rand(B, T, generator=g) > 0.2
    old = -torch.rand(B, T, generator=g) * 2
    new = old + 0.3 * torch.randn(B, T, generator=g)
    adv, ref = torch.randn(B, generator=g), old - 0.1
    ent = torch.rand(B, T, generator=g)
    sel = {"keep": torch.rand(B, T, generator=g) > 0.1, "zeroed": torch.rand(B, T, generator=g) > 0.8,
           "kl_cov_select": torch.rand(B, T, generator=g) > 0.7, "weight_select": torch.rand(B, T, generator=g) > 0.5,
           "adv_shift": 0.1 * torch.rand(B, T, generator=g)}
    widths = 0.1 + 0.2 * torch.rand(B, T, generator=g)
    kw = dict(eps_low=0.2, dual_clip=3.0, agg="seq-mean-token-mean", kl_cov_coef=0.5, ref_kl_coef=0.05,
              ref_kl_estimator="k2", entropy_coef=0.01, ce_beta_low=0.5, ce_beta_high=0.3, weight_alpha=0.2)
    a = new.clone().requires_grad_(True)
    loss_a, met_a = policy_loss(a, old, adv, mask, ref_logp=ref, entropy=ent, eps_high=widths, **sel, **kw)
    b = new.clone().requires_grad_(True)
    out = compute_policy_loss(LossInputs(b, old, adv, mask, Masks(**sel, eps_high=widths), ref, ent),
                              LossSettings(eps_high=None, **kw))
    loss_a.backward()
    out.loss.backward()
    assert torch.equal(loss_a.detach(), out.loss.detach()) and torch.equal(a.grad, b.grad)
    assert met_a == out.metrics() and met_a["clip/ce_frac"] is not None and met_a["loss/weight_adjust"] is not None


def test_keyword_call_validates_each_distinct_setting():
    # the keyword call caches its settings: 1 and True hash alike, and True must still be refused
    x, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    policy_loss(x, x, torch.ones(1), mask, eps_low=1)
    with pytest.raises(ValueError, match="eps_low must be None or a number >= 0, got True"):
        policy_loss(x, x, torch.ones(1), mask, eps_low=True)
    with pytest.raises(ValueError, match="agg must be one of"):
        policy_loss(x, x, torch.ones(1), mask, agg=["token-mean"])  # unhashable: validated anew, refused


# ----------------------------------------------------------------------------- the keyword call, by field name


def test_keyword_call_gives_each_setting_to_the_field_of_its_name(monkeypatch):
    """``policy_loss`` builds ``LossSettings`` by field name: every field has its keyword (same name, same
    default), and a ``LossSettings`` whose fields were reordered still gets each value in the field of its name
    (a call that filled the fields by position would swap them without an error)."""
    from entropy_rft.core import loss as loss_mod

    params = inspect.signature(policy_loss).parameters
    for f in dataclasses.fields(LossSettings):
        assert f.name in params and params[f.name].default == f.default, f.name
    values = dict(eps_low=0.11, eps_high=0.13, dual_clip=3.5, agg="seq-mean-token-mean", kl_cov_coef=0.7,
                  ref_kl_coef=0.05, ref_kl_estimator="k2", ref_kl_ratio_weighted=True, entropy_coef=0.01,
                  ce_beta_low=0.3, ce_beta_high=0.4, weight_alpha=0.2)
    assert set(values) == {f.name for f in dataclasses.fields(LossSettings)}  # a new field needs a value here
    reordered = dataclasses.make_dataclass(
        "Reordered", [(f.name, f.type, dataclasses.field(default=f.default))
                      for f in reversed(dataclasses.fields(LossSettings))], frozen=True)
    seen = []

    class Stop(Exception):
        pass

    def capture(inputs, settings):
        seen.append(settings)
        raise Stop

    x, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    monkeypatch.setattr(loss_mod, "compute_policy_loss", capture)
    try:
        for cls in (LossSettings, reordered):
            monkeypatch.setattr(loss_mod, "LossSettings", cls)
            loss_mod._cached_settings.cache_clear()
            with pytest.raises(Stop):
                policy_loss(x, x, torch.ones(2), mask, **values)
            assert type(seen[-1]) is cls and {k: getattr(seen[-1], k) for k in values} == values, cls
    finally:
        loss_mod._cached_settings.cache_clear()  # no Reordered instance left in the cache


def test_keyword_call_refuses_a_name_no_field_has():
    from entropy_rft.core.loss import loss_arguments

    x, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(TypeError, match="unexpected loss keyword"):
        loss_arguments(x, x, torch.ones(1), mask, eps_hi=0.3)


def test_overrides_name_settings_fields_and_replace_them_by_name():
    """A method's ``LossOverrides`` are ``LossSettings`` fields by name; ``apply`` replaces exactly the fields set."""
    settings_fields = {f.name for f in dataclasses.fields(LossSettings)}
    names = [f.name for f in dataclasses.fields(LossOverrides)]
    assert set(names) <= settings_fields
    base = LossSettings(eps_low=0.1, eps_high=0.3, agg="seq-mean-token-mean", ref_kl_coef=0.05)
    assert LossOverrides().apply(base) is base and LossOverrides().kwargs() == {}
    for i, name in enumerate(names):
        value = 0.5 + i / 100
        got = LossOverrides(**{name: value}).apply(base)
        assert getattr(got, name) == value
        assert all(getattr(got, f) == getattr(base, f) for f in settings_fields - {name}), name
    off = LossOverrides(eps_low=None, eps_high=None, kl_cov_coef=1.0)
    assert off.kwargs() == {"eps_low": None, "eps_high": None, "kl_cov_coef": 1.0}
    assert off.apply(base).eps_low is None and off.apply(base).agg == "seq-mean-token-mean"
    with pytest.raises(ValueError, match="eps_high must be None or a number >= 0"):
        LossOverrides(eps_high=-1.0).apply(base)


# ----------------------------------------------------------------------------- metrics: one transfer


def _varied_outputs(n_calls: int = 5) -> list[LossOutputs]:
    g = torch.Generator().manual_seed(3)
    outs = []
    for i in range(n_calls):
        B, T = 3 + i, 5
        mask = torch.rand(B, T, generator=g) > 0.2
        old = -torch.rand(B, T, generator=g) * 2
        new = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_(True)
        keep = torch.zeros(B, T, dtype=torch.bool) if i == 2 else torch.rand(B, T, generator=g) > 0.2  # none counts
        masks = Masks(keep=keep, zeroed=torch.rand(B, T, generator=g) > 0.8,
                      kl_cov_select=torch.rand(B, T, generator=g) > 0.7,
                      weight_select=torch.rand(B, T, generator=g) > 0.5 if i % 2 else None,
                      adv_shift=0.1 * torch.rand(B, T, generator=g) if i != 3 else None)
        settings = LossSettings(eps_low=0.2, eps_high=0.28, dual_clip=3.0 if i % 2 else None, kl_cov_coef=0.5,
                                ce_beta_low=0.5 if i != 4 else 0.0, weight_alpha=0.2 if i % 2 else 0.0,
                                agg="seq-mean-token-mean" if i % 2 else "token-mean")
        out = compute_policy_loss(LossInputs(new, old, torch.randn(B, generator=g), mask, masks), settings)
        out.loss.backward()
        outs.append(out)
    return outs


def test_metrics_of_many_calls_are_one_transfer_with_the_per_tensor_values(monkeypatch):
    outs = _varied_outputs()
    want = [per_tensor_metrics(o) for o in outs]
    extra = [torch.tensor(1.25), torch.tensor(3, dtype=torch.int64)]
    reads = Reads(monkeypatch)
    pending = [o.pending() for o in outs]  # compacts the counted tokens: no value read
    reads.on = True
    rows, numbers = read_metrics(pending, extra)
    reads.on = False
    assert [way for way, _ in reads.calls] == ["tolist"]
    assert rows == want and [list(r) for r in rows] == [list(w) for w in want]  # same numbers, same order
    assert numbers == [1.25, 3.0]
    assert rows[2]["ratio/mean"] is None and rows[2]["tokens/counted"] == 0.0  # the call where nothing counts
    assert all(o.metrics() == w for o, w in zip(outs, want))
