"""ClipV warns once when its cap lets at most one token go per step (issue 25, item 4): the released settings
(mu 8.5, max_frac 1e-4) on a ~1,000-token batch silently kept every token."""

from __future__ import annotations

import warnings

import pytest
import torch

from entropy_rft import control
from entropy_rft.config.loading import load_config
from entropy_rft.core.dynamics import TokenStats


def batch(rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s_c = torch.randn(rows, cols, generator=g)
    s_c[0, 0] = -50.0  # one far violator, so the rule has something to drop
    zeros = torch.zeros(rows, cols)
    stats = TokenStats(entropy=zeros, logp=zeros, s_star=zeros, s_expected=zeros, s_centered=s_c)
    adv = -torch.ones(rows)
    return stats, adv, torch.ones(rows, cols, dtype=torch.bool)


def caught(method, *args) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        method.rollout_masks(*args)
    return [str(x.message) for x in w if "caps the drop at 1 token" in str(x.message)]


def test_released_settings_warn_once_on_a_thousand_tokens():
    m = control.build_method("clip_v")  # the released defaults
    assert (m.mu, m.max_frac) == (8.5, 1e-4)
    args = batch(8, 125)  # 1,000 tokens: K = max(int(0.1), 1) = 1
    first = caught(m, *args)
    assert len(first) == 1 and "max_frac 0.0001 on 1000 tokens" in first[0] and "null" in first[0]
    assert caught(m, *args) == []  # once per method instance


@pytest.mark.parametrize("rows,warns", [(199, True), (200, False)])  # 19,900 vs 20,000 tokens: K 1 vs 2
def test_boundary_is_two_tokens(rows, warns):
    assert bool(caught(control.build_method("clip_v"), *batch(rows, 100))) is warns


def test_default_preset_and_paper_rule_without_cap_do_not_warn():
    cfg = load_config(None, ["method.name=clip_v"])
    m = control.build_method("clip_v", **cfg.method_params())
    assert m.max_frac is None  # configs/default.yaml's preset
    assert caught(m, *batch(8, 125)) == []
    assert caught(control.build_method("clip_v_paper"), *batch(8, 125)) == []
    assert len(caught(control.build_method("clip_v_paper", max_frac=1e-4), *batch(8, 125))) == 1
