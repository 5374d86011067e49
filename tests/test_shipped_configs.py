"""Every shipped config loads on its own engine with no warning (issue 25, item 9): the checks `erft train`
runs on a config's settings (``preflight.settings_warnings``, and ``trl_settings.unhonoured`` for engine 'trl')
say nothing, and loading it raises no Python warning. Before, every engine-'trl' paper config printed six
lines about settings that engine ignores (eval.every, probe.*, rollout.backend)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from entropy_rft.config import trl as trl_settings
from entropy_rft.config.loading import load_config
from entropy_rft.training import preflight

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
BUILT_IN = ROOT / "src" / "entropy_rft" / "configs"  # the package's own (`--model smollm2-135m` loads its own)
SHIPPED = sorted(CONFIGS.glob("*.yaml")) + sorted((CONFIGS / "paper").glob("*.yaml")) + sorted(BUILT_IN.glob("*.yaml"))


def test_the_shipped_configs_are_found():
    assert len(SHIPPED) >= 14
    assert {p.name for p in SHIPPED} >= {"default.yaml", "qwen2.5-7b_clip_v.yaml", "smollm2-135m.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_loads_on_its_engine_without_warnings(path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path)
    lines = preflight.settings_warnings(cfg, 0)
    if cfg.engine == "trl":  # trl_settings.check without building the GRPOConfig (cuda/bf16 on a CPU machine)
        errors, more = trl_settings.unhonoured(cfg)
        lines += trl_settings.section_errors(cfg) + errors + more
    assert lines == [], f"{path.name}: {lines}"
    captured = capsys.readouterr()
    assert "warning" not in (captured.out + captured.err).lower()
