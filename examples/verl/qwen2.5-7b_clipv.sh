#!/usr/bin/env bash
# ClipV on Qwen2.5-7B-Instruct with verl 0.9.1 + vLLM 0.24.0 (one node of 8 GPUs; set NNODES for more).
# The papers' settings: 64 prompts x 8 rollouts, prompts <= 1024 and responses <= 7168 tokens, T 1.0, KL 0,
# lr 1e-6, eps 0.2, ClipV mu 8.5 with max_frac 1e-4. Install every Ray node first: examples/verl/install_node.sh.
#
#   MODEL=/path/to/Qwen2.5-7B-Instruct bash examples/verl/qwen2.5-7b_clipv.sh [extra hydra overrides...]
#   DRY_RUN=1 ... prints the overrides instead of launching.
#
# Status: in CI these overrides, with the model, sizes, devices, rollout and reward swapped for a tiny CPU job
# (and ClipV's mu lowered), train 2 steps of a real main_ppo job on 2 FSDP ranks (tests_verl/test_real_job.py);
# a run on GPUs with vLLM has not been made by this project yet (docs/verl.md, "What has run").
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local Qwen2.5-7B-Instruct folder}
DATA=${DATA:-data/dapo}
NNODES=${NNODES:-1}
GPUS=${GPUS:-8}

[ -f "$DATA/train.parquet" ] || erft export-verl --task dapo_math_17k --out "$DATA"
REWARD=$(python -c "import entropy_rft.integrations.verl_reward as m; print(m.__file__)")
export VERL_USE_EXTERNAL_MODULES=entropy_rft.integrations.verl

OVERRIDES=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA/train.parquet"
    data.val_files="$DATA/val.parquet"
    reward.custom_reward_function.path="$REWARD"
    reward.custom_reward_function.name=compute_score
    data.train_batch_size=64
    data.max_prompt_length=1024
    data.max_response_length=7168
    actor_rollout_ref.model.path="$MODEL"
    actor_rollout_ref.model.external_lib=entropy_rft.integrations.verl
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384
    actor_rollout_ref.actor.clip_ratio=0.2
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.kl_loss_coef=0.0
    actor_rollout_ref.actor.entropy_coeff=0.0
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.policy_loss.loss_mode=clip_v
    +actor_rollout_ref.erft.mu=8.5
    +actor_rollout_ref.erft.max_frac=1e-4
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384
    actor_rollout_ref.rollout.tensor_model_parallel_size=2
    trainer.v1.trainer_mode=erft_sync
    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=entropy_rft.integrations.verl
    trainer.n_gpus_per_node="$GPUS"
    trainer.nnodes="$NNODES"
    trainer.total_training_steps=500
    trainer.project_name=entropy-rft
    trainer.experiment_name=qwen2.5-7b-clipv
)
if [ -n "${DRY_RUN:-}" ]; then printf '%s\n' "${OVERRIDES[@]}" "$@"; exit 0; fi  # the overrides, one per line
exec python -m verl.trainer.main_ppo "${OVERRIDES[@]}" "$@"
