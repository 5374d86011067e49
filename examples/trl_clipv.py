"""ClipV in your own TRL script: an erft task and its reward, trained by EntropyControlGRPOTrainer.

One process:      python examples/trl_clipv.py --model <folder> --task rg:products --out runs/clipv
Several GPUs:     accelerate launch --config_file examples/accelerate/multi_gpu.yaml examples/trl_clipv.py ...
ZeRO-3:           accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml examples/trl_clipv.py ...
vLLM (colocate):  add --use-vllm (needs `pip install vllm`)

The CLI equivalent is `erft train --engine trl` (docs/trl.md), which also writes erft's run directory
(metrics.jsonl, samples.jsonl, tb/). Here TRL's own logging and checkpoints are all there is.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer
from trl import GRPOConfig

from entropy_rft.integrations.trl import EntropyControlGRPOTrainer, prompt_dataset, task_reward_func
from entropy_rft.tasks import build_task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="policy folder (or hub id; a folder lets TRL rebuild a "
                                                  "reference model from config._name_or_path when beta > 0)")
    p.add_argument("--task", default="rg:products", help="an erft task name (`erft tasks`), e.g. dapo_math_17k")
    p.add_argument("--out", required=True, help="TRL output_dir: checkpoints and the final model")
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--use-vllm", action="store_true", help="generate with vLLM, colocated on the training GPUs")
    p.add_argument("--num-generations", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--batch-size", type=int, default=8, help="completions per device per micro-batch")
    p.add_argument("--max-completion-length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    task = build_task(args.task)
    train_set, _ = task.split(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    dataset = prompt_dataset(train_set, tok)  # columns: prompt (text or chat), erft_index (into train_set)

    config = GRPOConfig(
        output_dir=args.out, max_steps=args.max_steps, seed=args.seed, learning_rate=1e-6,
        num_generations=args.num_generations, per_device_train_batch_size=args.batch_size,
        max_completion_length=args.max_completion_length, loss_type="dapo", beta=0.0,
        bf16=torch.cuda.is_available(), logging_steps=1, save_steps=50, report_to="none",
        use_vllm=args.use_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_importance_sampling_correction=False,  # erft's policy_loss has no per-token sampling weight
    )
    trainer = EntropyControlGRPOTrainer(
        model=args.model,  # loaded by TRL, so ZeRO-3 shards it while loading (no full copy per process)
        reward_funcs=task_reward_func(task, train_set), args=config, train_dataset=dataset, processing_class=tok,
        method="clip_v", method_params={"mu": 8.5},  # `erft methods` lists the methods and their parameters
    )
    trainer.train()
    trainer.save_model(f"{args.out}/final")
    if trainer.accelerator.is_main_process:
        tok.save_pretrained(f"{args.out}/final")


if __name__ == "__main__":
    main()
