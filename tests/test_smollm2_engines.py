"""SmolLM2-135M-Instruct end to end on both engines with its own built-in config (no --config): a couple of
steps each on reasoning-gym's one-digit products, at small sizes (CI time), writing the same metric names."""

from __future__ import annotations

import math

import yaml

from entropy_rft.cli.main import main
from entropy_rft.common.metric_names import is_known
from entropy_rft.config.loading import default_config_path, load_yaml
from entropy_rft.rundir.files import read_jsonl

SMALL = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.every=0",
         "algo.minibatches=1", "train.progress=false", "train.tensorboard=false", "train.checkpoint_every=2",
         "train.threads=1"]


def _train(out, *extra) -> list[dict]:
    args = ["train", "--model", "smollm2-135m", "--method", "clip_v", "--max-steps", "2", "--out", str(out), *extra]
    assert main(args + sum((["--set", s] for s in SMALL), [])) == 0
    return read_jsonl(out / "metrics.jsonl")


def test_smollm2_trains_on_both_engines_with_its_own_settings(smollm2_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("ERFT_CACHE", str(smollm2_cache))
    native = _train(tmp_path / "native")
    trl = _train(tmp_path / "trl", "--engine", "trl")
    for out in ("native", "trl"):
        cfg = yaml.safe_load((tmp_path / out / "config.yaml").read_text())
        assert cfg["tuned_for"] == "smollm2-135m" and cfg["task"]["name"] == "rg:products"
        own = load_yaml(default_config_path("smollm2-135m"))
        assert cfg["optim"]["lr"] == own["optim"]["lr"] != load_yaml(default_config_path())["optim"]["lr"]
    assert [r["step"] for r in native] == [1, 2] and [r["step"] for r in trl] == [1, 2]
    for rows in (native, trl):
        for r in rows:
            assert 0.0 < r["entropy/mean"] < math.log(49152)
            assert 0.0 <= r["reward/mean"] <= 1.0 and math.isfinite(r["loss/pg"])
    shared = set(native[-1]) & set(trl[-1])
    for key in ("entropy/mean", "reward/mean", "control/kept_frac", "loss/pg", "response/length"):
        assert key in shared
    for key in set(native[-1]) | set(trl[-1]):
        assert key == "step" or is_known(key), key  # one table of names for both engines
