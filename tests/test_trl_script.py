"""TRL's own GRPO script (``trl/scripts/grpo.py`` from the installed wheel), unchanged and with the plug-in in
place of ``GRPOTrainer`` (method ``none``), over a table of configurations: every logged loss and grad_norm and
the saved weights are the same, row by row. The table below is the documentation of what the drop-in runs as
stock (docs/trl.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from micro import make_micro_policy

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
ROWS = {  # row -> the script's own flags
    "defaults": [],
    "gspo": ["--importance_sampling_level", "sequence", "--loss_type", "grpo"],
    "cispo": ["--loss_type", "cispo"],
    "sapo": ["--loss_type", "sapo"],
    "luspo": ["--loss_type", "luspo", "--importance_sampling_level", "sequence"],
    "vespo": ["--loss_type", "vespo"],
    "dropout": ["--model_name_or_path", "{dropout_policy}"],
    "use_peft": ["--use_peft", "--lora_target_modules", "q_proj", "v_proj"],  # lora_dropout 0.05 (the default)
    "bnpo_accumulation": ["--loss_type", "bnpo", "--gradient_accumulation_steps", "2",
                          "--per_device_train_batch_size", "4"],
    "steps_per_generation": ["--steps_per_generation", "2", "--per_device_train_batch_size", "4"],
    "grpo_mask_truncated": ["--loss_type", "grpo", "--mask_truncated_completions", "true"],
    "dr_grpo_mask_truncated": ["--loss_type", "dr_grpo", "--mask_truncated_completions", "true"],
}


def script_rows(tmp: Path, which: str, policy: Path, dropout_policy: Path, data: Path) -> dict[str, list[str]]:
    common = ["--model_name_or_path", str(policy), "--dataset_name", str(data), "--reward_funcs",
              "test_trl_parity.digit_reward", "--max_steps", str(STEPS), "--per_device_train_batch_size", "8",
              "--num_generations", "4", "--max_completion_length", "6", "--learning_rate", "1e-2",
              "--logging_steps", "1", "--report_to", "none", "--save_strategy", "steps", "--save_steps", str(STEPS),
              "--seed", "0", "--use_cpu", "true", "--disable_tqdm", "true", "--temperature", "1.5"]
    return {name: [*common, "--output_dir", str(tmp / which / name),
                   *(a.format(dropout_policy=dropout_policy) for a in flags)] for name, flags in ROWS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trl-script")
    policy = make_micro_policy(tmp / "policy")
    dropout_policy = make_micro_policy(tmp / "dropout-policy")
    cfg = json.loads((dropout_policy / "config.json").read_text())
    (dropout_policy / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.3}))
    data = tmp / "data"
    data.mkdir()
    from test_trl_parity import PROMPTS

    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 4))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = {}
    for which in ("stock", "none"):  # side by side: one core each
        rows = tmp / f"{which}.json"
        rows.write_text(json.dumps(script_rows(tmp, which, policy, dropout_policy, data)))
        procs[which] = subprocess.Popen([sys.executable, str(ROOT / "tests" / "trl_script_rows.py"), which,
                                         str(rows)], cwd=tmp, env={**env, "OMP_NUM_THREADS": "1"},
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for which, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (which, out[-1500:], err[-3000:])
    return tmp


def _log(out: Path) -> list[dict]:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [r for r in state["log_history"] if "grad_norm" in r]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(out / name)


@pytest.mark.parametrize("row", list(ROWS))
def test_trls_own_script_trains_the_same_with_the_plug_in(runs, row):
    stock, ours = runs / "stock" / row, runs / "none" / row
    log_stock, log_ours = _log(stock), _log(ours)
    assert len(log_stock) == len(log_ours) == STEPS
    for a, b in zip(log_ours, log_stock):
        assert a["grad_norm"] == b["grad_norm"], (row, a, b)  # bit for bit
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-8), (row, a, b)
        for k in ("entropy", "kl", "clip_ratio/region_mean"):
            assert (k in a) == (k in b), (row, k)
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-8), (row, k, a[k], b[k])
    w_stock, w_ours = _weights(stock), _weights(ours)
    assert w_stock.keys() == w_ours.keys()
    for k, v in w_stock.items():
        assert torch.equal(v, w_ours[k]), (row, k)
    assert any(r["grad_norm"] > 0 for r in log_stock), row  # it trained
    assert "entropy/mean" in log_ours[0] and "entropy/mean" not in log_stock[0], row  # the plug-in's statistics ran


@pytest.mark.parametrize("method,params,cfg,acted", [
    ("clip_v", {"mu": 0.5}, {"loss_type": "sapo"}, "control/rollout_kept_frac"),
    ("clip_b", {"mu": 0.5}, {"loss_type": "grpo", "importance_sampling_level": "sequence"},
     "control/rollout_kept_frac"),
    ("high_entropy", {"top_q": 0.5}, {"loss_type": "cispo"}, "control/rollout_kept_frac"),
    ("clip_v", {"mu": 0.5}, {"loss_type": "luspo", "importance_sampling_level": "sequence"},
     "control/rollout_kept_frac"),
    ("clip_cov", {"ratio": 0.2, "lb": -5.0, "ub": 5.0},
     {"loss_type": "vespo", "num_iterations": 2, "max_steps": 2}, "zeroed"),
    ("entropy_bonus", {"coef": 0.5}, {"loss_type": "sapo"}, "entropy_coef"),
], ids=["clip_v-sapo", "clip_b-gspo", "80/20-cispo", "clip_v-luspo", "clip_cov-vespo-2iter", "bonus-sapo"])
def test_methods_compose_with_every_loss_type_and_level(tmp_path, method, params, cfg, acted):
    """Methods that drop or zero tokens, or add TRL's entropy term, run inside TRL's own loss (its loss mask, its
    per-token advantages, its ``entropy_coef``) on the loss types and the sequence level that entropy-rft's
    surrogate lacks: each acts (kept fraction < 1, zeroed tokens, TRL's entropy_coef logged) and the update
    differs from ``none``'s."""
    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer
    from test_trl_parity import run

    policy = make_micro_policy(tmp_path / "policy")
    p_none, _ = run(EntropyControlGRPOTrainer, policy, tmp_path / "none", steps=1, bf16=False, **cfg)
    p_m, logs = run(EntropyControlGRPOTrainer, policy, tmp_path / "m", steps=1, bf16=False,
                    trainer_kw={"method": method, "method_params": params}, **cfg)
    if acted == "zeroed":
        assert logs[0]["control/zeroed_frac"] > 0, logs[0]
    elif acted == "entropy_coef":
        assert logs[0]["entropy_coef"] == params["coef"], logs[0]
    else:
        assert logs[0][acted] < 1.0, logs[0]
    assert any(not torch.equal(p_m[k], p_none[k]) for k in p_none)  # the method changed the update


@pytest.mark.parametrize("method,params,acted", [
    ("clip_v", {"mu": 0.5}, "control/rollout_kept_frac"),
    ("clip_cov", {"ratio": 0.2, "lb": -5.0, "ub": 5.0}, "control/zeroed_frac"),
    ("kl_cov", {"ratio": 0.2}, "control/kl_cov_selected_frac"),
], ids=["clip_v", "clip_cov", "kl_cov"])
def test_methods_train_lora_adapters_with_dropout(tmp_path, method, params, acted):
    """With peft's LoRA (its default dropout 0.05, as ``--use_peft``) each method trains the
    adapters: it acts, the adapters move, and the base weights stay as loaded."""
    from peft import LoraConfig

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer
    from test_trl_parity import run

    policy = make_micro_policy(tmp_path / "policy")
    base = load_file(policy / "model.safetensors")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05)
    weights, logs = run(EntropyControlGRPOTrainer, policy, tmp_path / "m", steps=2, bf16=False, num_iterations=2,
                        trainer_kw={"peft_config": lora, "method": method, "method_params": params})
    assert logs[0][acted] < 1.0 if acted.endswith("kept_frac") else logs[0][acted] > 0, logs[0]
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at 0: the adapters trained
    frozen = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in weights.items()
              if "lora_" not in k and ".base_layer." in k}
    assert frozen and all(torch.equal(v, base[k]) for k, v in frozen.items())
