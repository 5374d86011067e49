"""Issue 51's second regime: ``--model default-strong`` is the built-in policy family from a stronger SFT (every
SFT target a correct expression), with its own built-in config, which is the default's but for the base. The
full build takes minutes, so the test builds the recipe for a few SFT steps and trains two RL steps from it."""

from __future__ import annotations

import json
from pathlib import Path

from entropy_rft.config.loading import default_config_path, load_config, load_yaml
from entropy_rft.launch.run import start
from entropy_rft.models.files import policy_names
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.training.policies import resolve_policy


def test_the_strong_config_is_the_default_but_for_the_base():
    strong, default = load_yaml(default_config_path("default-strong")), load_yaml(default_config_path())
    assert strong["model"].pop("name") == "default-strong" and strong.pop("tuned_for") == "default-strong"
    default["model"].pop("name")
    default.pop("tuned_for")
    assert strong == default  # the two regimes differ only in the base policy
    cfg = load_config(None, ["model.name=default-strong"])  # `--model default-strong` picks its own config
    assert cfg.model.name == "default-strong" and cfg.tuned_for == "default-strong"
    assert "default-strong" in policy_names()


def test_the_strong_recipe_builds_and_trains_two_steps(tmp_path):
    folder = resolve_policy("default-strong", build_kwargs={"steps": 3, "eval_prompts": 0}, cache_dir=tmp_path)
    info = json.loads((Path(folder) / "erft_build.json").read_text())
    # The recipe by hand (docs/results.md, "A second regime"): the default's architecture and data, all targets
    # correct (p_correct 1), the default's 690 SFT steps (here cut to 3 by the override).
    assert info["build"]["p_correct"] == 1.0 and info["build"]["steps"] == 3
    assert (info["build"]["d_model"], info["build"]["layers"], info["build"]["batch_size"]) == (192, 3, 128)
    sets = [f"model.name={folder}", "tuned_for=", "train.max_steps=2",
            "eval.every=0", "train.progress=false", "train.threads=1", "train.checkpoints=false",
            "probe.enabled=false", "rollout.prompts_per_step=4"]
    start(load_config(default_config_path("default-strong"), sets), tmp_path / "run")
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "entropy/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
