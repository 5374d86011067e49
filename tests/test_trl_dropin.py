"""The TRL drop-in with method ``none`` trains as stock ``GRPOTrainer`` on the configurations issue 35 found broken
or refused: GSPO's sequence-level ratio, the loss types cispo, sapo, luspo and vespo, a model with dropout and
LoRA with its default dropout, bnpo with gradient accumulation, ``steps_per_generation=2``, and
``mask_truncated_completions`` with grpo and dr_grpo. Reference: TRL itself, same config, weights and seed.
Compared: every logged loss, grad_norm and TRL metric at every step, and the weights after the last step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from entropy_rft.models.loading import load_policy  # noqa: E402
from micro import make_micro_policy  # noqa: E402
from test_trl_parity import LOGGED, PROMPTS, Logs, digit_reward  # noqa: E402

STEPS = 2
# name -> (GRPOConfig fields, model change): each a row of issue 35's table
ROWS = {
    "gspo": ({"importance_sampling_level": "sequence", "loss_type": "grpo"}, None),
    "cispo": ({"loss_type": "cispo"}, None),
    "sapo": ({"loss_type": "sapo"}, None),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, None),
    "vespo": ({"loss_type": "vespo"}, None),
    "dropout": ({}, "dropout"),
    "lora_dropout": ({}, "lora"),
    "bnpo_accumulation": ({"loss_type": "bnpo", "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
                          None),
    "steps_per_generation": ({"steps_per_generation": 2, "per_device_train_batch_size": 4}, None),
    "grpo_mask_truncated": ({"loss_type": "grpo", "mask_truncated_completions": True}, None),
    "dr_grpo_mask_truncated": ({"loss_type": "dr_grpo", "mask_truncated_completions": True}, None),
}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("dropin") / "policy")


def run(trainer_cls, policy_dir: Path, out: Path, cfg: dict, change: str | None) -> tuple[dict, list[dict], dict]:
    from datasets import Dataset
    from trl import GRPOConfig

    model, tok = load_policy(str(policy_dir))
    extra = {}
    if change == "dropout":
        model.config.attention_dropout = 0.3  # the attention applies it in training mode
    if change == "lora":
        from peft import LoraConfig

        # lora_dropout 0.05: TRL's ModelConfig default, what `trl/scripts/grpo.py --use_peft` trains with
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                                          task_type="CAUSAL_LM")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kw = dict(output_dir=str(out), use_cpu=True, bf16=False, per_device_train_batch_size=8, num_generations=4,
              max_completion_length=6, max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[],
              save_strategy="no", disable_tqdm=True, seed=0, gradient_checkpointing=False, temperature=1.5)
    kw.update(cfg)
    logs = Logs()
    trainer = trainer_cls(model=model, reward_funcs=digit_reward, args=GRPOConfig(**kw),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tok,
                          callbacks=[logs.callback()], **extra)
    trainer.train()
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return params, logs.rows, initial


@pytest.mark.parametrize("row", list(ROWS))
def test_method_none_trains_as_stock_on_every_row(policy_dir, tmp_path, row):
    from trl import GRPOTrainer

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    cfg, change = ROWS[row]
    p_stock, log_stock, initial = run(GRPOTrainer, policy_dir, tmp_path / "stock", cfg, change)
    p_ours, log_ours, _ = run(EntropyControlGRPOTrainer, policy_dir, tmp_path / "ours", cfg, change)
    assert len(log_ours) == len(log_stock) == STEPS
    for step, (a, b) in enumerate(zip(log_ours, log_stock), 1):
        for k in LOGGED:
            assert (k in a) == (k in b), (row, step, k)
            if k == "grad_norm":
                assert a[k] == b[k], (row, step, a[k], b[k])  # bit for bit
            elif k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-8), (row, step, k, a[k], b[k])
    assert "entropy/mean" in log_ours[0]  # the plug-in's statistics ran beside TRL's loss (a generation step)
    assert p_ours.keys() == p_stock.keys()
    for name, w in p_stock.items():
        assert torch.equal(p_ours[name], w), (row, name)
    trained = [n for n, w in p_stock.items() if n in initial and not torch.equal(w, initial[n])]
    if change == "lora":
        trained = [n for n in p_stock if "lora_B" in n and p_stock[n].abs().max() > 0]
    assert trained, row  # the run trained: the equality is not that of two untouched models
