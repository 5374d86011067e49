"""The verl kit (examples/verl): the launch script's overrides compose into verl 0.9.1's own trainer config,
name a loss, trainer and engine that the integration registers and supports, and method parameters that
the method registry accepts. The script itself runs (DRY_RUN=1 prints its overrides instead of launching)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import verl
from hydra import compose, initialize_config_dir

import entropy_rft.integrations.verl as ev

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "examples" / "verl"


def script_overrides(tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "data"
    data.mkdir(parents=True)
    (data / "train.parquet").touch()  # the script exports the data only when it is missing
    env = {**os.environ, "DRY_RUN": "1", "MODEL": str(tmp_path / "Qwen2.5-7B-Instruct"), "DATA": str(data),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}  # this venv's python
    r = subprocess.run(["bash", str(KIT / "qwen2.5-7b_clipv.sh"), *extra], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_launch_script_composes_into_verls_config(tmp_path):
    cfg = composed(script_overrides(tmp_path))
    actor = cfg.actor_rollout_ref.actor
    assert actor.policy_loss.loss_mode == "clip_v" and actor.strategy == "fsdp2"
    assert cfg.trainer.v1.trainer_mode == "erft_sync"
    assert cfg.actor_rollout_ref.model.external_lib == "entropy_rft.integrations.verl"
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.data.train_batch_size == 64 and cfg.data.max_response_length == 7168
    # what the worker does with it: the loss is registered, the method builds with the script's parameters,
    # the trainer is registered, and the FSDP engine is one the statistics hook reads
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    assert "clip_v" in POLICY_LOSS_REGISTRY
    method = ev.configure("clip_v", **dict(cfg.actor_rollout_ref.erft))
    assert method.stage == "rollout"
    assert get_trainer_cls("erft_sync").__name__ == "ErftPPOTrainerSync"
    ev.check_stats_engine(FSDPEngineWithLMHead)


def test_launch_script_passes_extra_overrides_and_refuses_a_typo(tmp_path):
    cfg = composed(script_overrides(tmp_path, "trainer.total_training_steps=3"))
    assert cfg.trainer.total_training_steps == 3
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        composed(script_overrides(tmp_path / "b", "actor_rollout_ref.actor.polcy_loss.loss_mode=clip_v"))


def test_node_constraints_pin_what_verl_vllm_pins():
    pins = dict(line.split("==") for line in (KIT / "constraints-node.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins["verl"] == verl.__version__ == "0.9.1"
    from importlib.metadata import requires

    vllm_extra = {r.split(";")[0].replace(" ", "") for r in requires("verl") if 'extra == "vllm"' in r}
    for name in ("vllm", "torch", "transformers"):
        assert f"{name}=={pins[name]}" in vllm_extra, name
