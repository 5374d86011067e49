"""Every paper config loads and validates, names its engine, and matches papers.md's settings."""

from pathlib import Path

import pytest

from entropy_rft.config.loading import load_config

PAPER = Path(__file__).resolve().parents[1] / "configs" / "paper"
EXPECTED = {  # name: (engine, method, group_size, prompts_per_step, algorithm, model)
    "qwen2.5-7b_grpo": ("trl", "none", 16, 64, "grpo", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-7b_clip_b": ("trl", "clip_b", 16, 64, "grpo", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-7b_clip_v": ("trl", "clip_v", 8, 64, "grpo", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-14b_grpo": ("trl", "none", 16, 64, "grpo", "Qwen/Qwen2.5-14B-Instruct"),
    "qwen2.5-14b_clip_b": ("trl", "clip_b", 16, 64, "grpo", "Qwen/Qwen2.5-14B-Instruct"),
    "qwen2.5-14b_clip_v": ("trl", "clip_v", 8, 64, "grpo", "Qwen/Qwen2.5-14B-Instruct"),
    "qwen2.5-7b_clip_cov": ("trl", "clip_cov", 8, 256, "grpo", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-7b_kl_cov": ("trl", "kl_cov", 8, 256, "grpo", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-7b_ppo_clip_b": ("native", "clip_b", 1, 64, "ppo", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-7b_ppo_clip_v": ("native", "clip_v", 1, 64, "ppo", "Qwen/Qwen2.5-7B-Instruct"),
}


def test_the_set_of_paper_configs():
    assert sorted(p.stem for p in PAPER.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_paper_config_loads(name):
    path = PAPER / f"{name}.yaml"
    assert "engine" in path.read_text().split("\n", 6)[1]  # the header names the engine it needs
    cfg = load_config(path)
    engine, method, group, prompts, algo, model = EXPECTED[name]
    assert (cfg.engine, cfg.method.name, cfg.rollout.group_size, cfg.rollout.prompts_per_step,
            cfg.algo.algorithm, cfg.model.name) == (engine, method, group, prompts, algo, model)
    assert cfg.rollout.temperature == 1.0 and cfg.algo.ref_kl_coef == 0.0
    assert cfg.eval.temperature == 0.7 and cfg.task.name == "dapo_math_17k"
    assert cfg.task.params["val_size"] == 500
    p = cfg.method_params()
    if method == "clip_b":
        assert p == {"mu": 2.5}
    if method == "clip_v":
        assert p == {"mu": 8.5, "max_frac": 1e-4}
    if method == "clip_cov":
        assert p == {"ratio": 2e-4, "lb": 1.0, "ub": 5.0} and cfg.rollout.max_new_tokens == 8192
    if method == "kl_cov":
        assert p == {"ratio": 2e-3, "coef": 1.0} and cfg.algo.eps_low is None and cfg.algo.eps_high is None
    if name.startswith("qwen2.5-1") or method in ("clip_b", "clip_v", "none"):
        assert cfg.rollout.max_new_tokens in (7168, 8192)
