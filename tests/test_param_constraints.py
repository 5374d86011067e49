"""Method parameters declare their constraints on ``param`` as config fields do on ``setting`` (issue 52 item 3):
one loop (``Method.check_params``) checks them before ``validate``, at build and in ``set_knob``, and ``erft methods``
shows them next to the help. Expected messages and ranges are written by hand from each method's rule, not read
from the metadata under test.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest

from entropy_rft import control
from entropy_rft.cli.main import main
from entropy_rft.common.constraints import problem, range_rule, rule_words, typed_problem
from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import load_config
from entropy_rft.control.autopilot import _valid_toward


def _refusal(name: str, **params) -> str:
    with pytest.raises(ValueError) as err:
        control.build_method(name, **params)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("name, params, line", [
    ("clip_b", {"mu": -1}, "mu must be >= 0, got -1"),
    ("clip_b", {"mu": None}, "mu must be a finite number >= 0, got None"),
    ("clip_b", {"mu": True}, "mu must be a finite number >= 0, got True"),
    ("clip_b", {"mu": math.inf}, "mu must be a finite number >= 0, got inf"),
    ("clip_b_paper", {"mu_low": -0.5}, "mu_low must be >= 0 or None, got -0.5"),
    ("clip_v", {"max_frac": 1.5}, "max_frac must be in [0, 1] or None, got 1.5"),
    ("clip_v", {"advantage_sign": "neg"}, "advantage_sign must be released, any, negative or positive, got 'neg'"),
    ("clip_cov", {"ratio": -0.1}, "ratio must be in [0, 1], got -0.1"),
    ("clip_cov", {"lb": math.nan}, "lb must be a finite number, got nan"),
    ("clip_cov", {"exclude_clipped": 1}, "exclude_clipped must be a bool, got 1"),
    ("kl_cov", {"coef": "big"}, "coef must be a finite number >= 0, got 'big'"),
    ("clip_higher", {"eps_high": -0.1}, "eps_high must be >= 0, got -0.1"),
    ("high_entropy", {"top_q": 1.2}, "top_q must be in [0, 1], got 1.2"),
    ("grad_mask", {"drop_other_samples": "yes"}, "drop_other_samples must be a bool, got 'yes'"),
    ("entropy_adv", {"kappa": 1.0}, "kappa must be > 1, got 1.0"),
    ("adaptive_entropy", {"delta": -1e-3}, "delta must be >= 0, got -0.001"),
    ("ce_gppo", {"beta_low": -0.5}, "beta_low must be >= 0, got -0.5"),
    ("clip_low", {"eps_low": 1.0}, "eps_low must be in [0, 1) (r >= 1 - eps_low > 0), got 1.0"),
    ("entropic", {"alpha": 1.5}, "alpha must be in [-1, 1] (pos_weight = 1 + alpha in [0, 2]), got 1.5"),
    ("entropic", {"high_prob": 1.0}, "high_prob must be in (0, 1), got 1.0"),
    ("steer", {"omega_floor": 0}, "omega_floor must be > 0, got 0"),
    ("entrocraft", {"total_steps": 2.0}, "total_steps must be an integer >= 0, got 2.0"),
    ("entrocraft", {"half_width": -0.1}, "half_width must be >= 0, got -0.1"),
    ("aepo", {"prompt_frac": 0}, "prompt_frac must be in (0, 1], got 0"),
    ("aepo", {"reinforce_sample_num": False}, "reinforce_sample_num must be an integer >= 0, got False"),
    ("aepo", {"entropy": "mean"}, "entropy must be sampled or true, got 'mean'"),
    ("fec", {"schedule": "up"}, "schedule must be id, did or od, got 'up'"),
    ("steer", {"mapping": None}, "mapping must be exp or linear, got None"),  # a choice is no None
    ("grad_mask", {"s_field": None}, "s_field must be s_star or s_centered, got None"),
    ("fec", {"eps_std": -0.2}, "eps_std must be >= 0, got -0.2"),
])
def test_a_declared_constraint_refuses_in_one_line_naming_the_param(name, params, line):
    assert _refusal(name, **params) == line


def test_values_at_the_edges_and_none_where_declared_pass():
    """The accepted set is what the hand-written checks accepted: edges in, ints for floats, None where typed so."""
    for name, params in (("clip_b", {"mu": 0}), ("clip_b_paper", {"mu_low": None, "mu_high": 0.0}),
                         ("clip_v", {"max_frac": 1}), ("clip_v", {"max_frac": None}), ("clip_cov", {"ratio": 0}),
                         ("high_entropy", {"top_q": 1.0}), ("entropic", {"alpha": -1, "target": None}),
                         ("entrocraft", {"total_steps": 0, "reward_center": -3.5}), ("aepo", {"prompt_frac": 1}),
                         ("fec", {"upper_slope": 2, "lower_intercept": -1.0}), ("clip_low", {"eps_low": 0})):
        control.build_method(name, **params)


def test_rules_that_join_params_stay_in_validate():
    assert _refusal("clip_cov", lb=5.0, ub=1.0) == "lb must be < ub, got lb=5.0, ub=1.0"
    assert _refusal("adaptive_entropy", coef_min=0.5, coef_max=0.1).startswith("coef_min must be <= coef_max")
    assert _refusal("steer", token_weight_min=1.5).startswith("token_weight_min must be in (0, 1] with mapping 'exp'")
    control.build_method("steer", mapping="linear", token_weight_min=1.1)  # linear: up to token_weight_max (1.2)


def test_set_knob_outside_a_declared_range_raises_and_restores():
    m = control.build_method("clip_v", mu=3.0, max_frac=0.5)
    with pytest.raises(ValueError, match=r"^mu must be >= 0, got -1.0$"):
        m.set_knob(-1.0)
    assert (m.mu, m.max_frac) == (3.0, 0.5)
    low = control.build_method("clip_low", eps_low=0.3)
    with pytest.raises(ValueError, match=r"^eps_low must be in \[0, 1\)"):
        low.set_knob(1.0)
    assert low.eps_low == 0.3
    kl = control.build_method("kl_cov", ratio=0.01)
    with pytest.raises(ValueError, match=r"^ratio must be in \[0, 1\], got 1.5$"):
        kl.set_knob(1.5)
    assert kl.ratio == 0.01
    # the autopilot's bisection finds the edge of the declared range: clip_low's eps_low < 1
    edge = _valid_toward(control.build_method("clip_low", eps_low=0.5), 0.5, 4.0)
    assert 0.999 < edge < 1.0


def test_a_bad_method_param_in_the_config_is_one_line_naming_the_field():
    with pytest.raises(UserError) as err:
        load_config(None, ["method.name=high_entropy", "method.params={top_q: 1.5}"])
    assert str(err.value) == "config field 'method' invalid: top_q must be in [0, 1], got 1.5"


def test_erft_methods_shows_the_range_next_to_the_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["methods", "clip_low", "fec", "entropic"]) == 0
    out = capsys.readouterr().out
    assert "eps_low = 0.1 (in [0, 1) (r >= 1 - eps_low > 0)): lower ratio clip, r >= 1 - eps_low" in out
    assert "eps_high = 0.2 (>= 0): upper ratio clip" in out
    assert "schedule = 'id' (id, did or od): the schedule:" in out
    assert "high_prob = 0.95 (in (0, 1)): probability above which a token is adjusted" in out
    assert main(["methods", "--json", "clip_v"]) == 0
    (info,) = json.loads(capsys.readouterr().out)
    assert {p["name"]: p["rule"] for p in info["params"]} == {
        "mu": ">= 0", "max_frac": "in [0, 1] or None", "advantage_sign": "released, any, negative or positive"}


def test_every_numeric_param_declares_a_range_or_says_why_not():
    """A number with no range must say its rule in words (``rule``): lb < ub, any slope, an entropy level, ..."""
    missing = []
    for name in control.available_methods():
        for f in dataclasses.fields(control.get_method_class(name)):
            default = f.default
            if isinstance(default, bool) or not isinstance(default, (int, float)):
                continue
            if not ({"ge", "gt", "le", "lt"} & set(f.metadata) or f.metadata.get("rule")):
                missing.append(f"{name}.{f.name}")
    assert not missing, f"numeric method parameters with neither a range nor a rule: {missing}"


def test_a_custom_method_declares_its_own_constraints():
    @dataclass
    class Stride(control.Method):
        name: ClassVar[str] = "test_stride"
        stride: int = control.param(2, "keep one token in stride", ge=1)
        plain: float = 0.5  # not declared with param: nothing checked

    assert Stride(stride=3).stride == 3 and Stride(plain="anything").plain == "anything"
    with pytest.raises(ValueError, match=r"^stride must be >= 1, got 0$"):
        Stride(stride=0)
    with pytest.raises(ValueError, match=r"^stride must be an integer >= 1, got 2.5$"):
        Stride(stride=2.5)


def test_the_shared_words_are_the_configs():
    """config fields and method params say a constraint the same way (common.constraints)."""
    assert range_rule({"gt": 0, "le": 1}, integer=False) == "in (0, 1]"
    assert problem(-1, {"ge": 0}, float | None) == "must be >= 0 or null, got -1"
    assert typed_problem(-1, {"ge": 0}, float | None) == "must be >= 0 or None, got -1"
    assert typed_problem("x", {"ge": 0}, float | None) == "must be a finite number >= 0 or None, got 'x'"
    assert typed_problem(None, {"ge": 0}, float | None) is None
    assert typed_problem(3, {"choices": ("a", "b")}, str) == "must be a or b, got 3"
    assert rule_words({"ge": 0, "le": 1, "note": "(1: all)"}, float | None, null="None") == "in [0, 1] or None (1: all)"
    assert rule_words({"help": "no constraint"}, str) is None
