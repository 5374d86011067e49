"""``erft train --engine trl``: an erft config trained by ``EntropyControlGRPOTrainer`` into a run directory
(``train_trl``), with the policy handed to TRL as ZeRO-3 needs it (``policy_for_trl``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import trl
import yaml
from accelerate import PartialState
from trl import GRPOConfig

from entropy_rft.common.numerics import numerics_record
from entropy_rft.common.threads import apply_threads
from entropy_rft.config.schema import config_to_dict
from entropy_rft.config.trl import grpo_config, loss_base, step_factor
from entropy_rft.control.registry import Method
from entropy_rft.integrations.trl import EntropyControlGRPOTrainer
from entropy_rft.integrations.trl_logging import ErftLog
from entropy_rft.integrations.trl_task import prompt_dataset, task_reward_func
from entropy_rft.models.loading import load_tokenizer
from entropy_rft.rundir import files as rundir
from entropy_rft.rundir.checkpoints import last_complete_trl_checkpoint
from entropy_rft.tasks import build_task
from entropy_rft.training.policies import load_policy, resolve_policy


def zero3_enabled() -> bool:
    """Whether this process trains under DeepSpeed ZeRO-3 (``accelerate launch`` with a ZeRO-3 config); valid
    once the ``GRPOConfig`` exists, which registers the DeepSpeed config with transformers."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def policy_for_trl(cfg, args: GRPOConfig) -> tuple[Any, Any]:
    """The policy as ``GRPOTrainer`` should receive it, and its tokenizer.

    Under DeepSpeed ZeRO-3, the policy's folder (or hub id): TRL then loads it with ``from_pretrained`` inside
    transformers' ``deepspeed.zero.Init``, so each rank materialises only its shard of the weights and no
    process holds the whole model in host memory (``args.model_init_kwargs`` carries ``model.dtype``). Otherwise
    the model loaded on CPU in every process, as the native engine loads it (``model.gradient_checkpointing``
    applied).
    """
    if zero3_enabled():
        where = resolve_policy(cfg.model.name)  # builds or converts a built-in policy on first use
        from entropy_rft.models.files import trust_remote_code

        args.model_init_kwargs = {**(args.model_init_kwargs or {}), "dtype": cfg.model.dtype,
                                  "trust_remote_code": trust_remote_code()}
        return where, load_tokenizer(cfg.model.name, where)
    model, tok = load_policy(cfg.model.name, device="cpu", dtype=getattr(torch, cfg.model.dtype),
                           cpu_gemm=cfg.model.cpu_gemm)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, tok


def train_trl(cfg, out: str | Path, resume: bool = False, method: Method | None = None,
              on_row: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """``erft train --engine trl``: train ``cfg`` into run directory ``out`` with EntropyControlGRPOTrainer.

    ``out`` must already be prepared (``launch.start`` refuses to overwrite). Writes ``config.yaml``,
    ``run.json``, ``metrics.jsonl`` and ``out/tb`` (one row per erft step = one generation batch, native names),
    ``samples.jsonl`` (``trl_logging``), TRL checkpoints under ``out/trl`` and the final policy in
    ``out/final``. The GRPOConfig is ``trl_settings.grpo_config`` (with the config's ``trl:`` section).
    ``method``: the method the request's check built (``config.validation.validate_method``), else built here.
    ``resume=True`` continues from the last TRL checkpoint, dropping log rows after it. ``on_row``: called on the
    main process with each metrics row as it is logged. Run under ``accelerate launch`` for several processes.
    """
    out = Path(out)
    state = PartialState()
    if cfg.train.threads:  # before a default-policy build; 0: apply_threads decides after the load
        torch.set_num_threads(cfg.train.threads)
    k = step_factor(cfg)
    # transformers' get_last_checkpoint takes the highest checkpoint-N, complete or not
    last = last_complete_trl_checkpoint(out / "trl", remove=state.is_main_process) if resume else None
    start = int(Path(last).name.split("-")[1]) // k if last else 0
    if state.is_main_process:
        if resume:
            rundir.truncate_logs(out, start if last else -1)
        else:
            rundir.atomic_write_text(out / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        rundir.write_status(out, "running", engine="trl", start_step=start, max_steps=cfg.train.max_steps,
                            processes=state.num_processes, python=sys.version.split()[0], torch=torch.__version__,
                            trl=trl.__version__, cpu_numerics=numerics_record())
    state.wait_for_everyone()
    task = build_task(cfg.task.name, **cfg.task.params)
    train_set, _ = task.split(cfg.train.seed)
    args = grpo_config(cfg, out, state.num_processes)  # first: under ZeRO-3 it sets up transformers' zero.Init
    model, tok = policy_for_trl(cfg, args)
    log: ErftLog  # assigned below, once the trainer exists; the reward callback reads it only during training
    reward = task_reward_func(task, train_set, on_scored=lambda *scored: log.samples(*scored))  # log: below
    trainer = EntropyControlGRPOTrainer(
        model=model, reward_funcs=reward, args=args,
        train_dataset=prompt_dataset(train_set, tok), processing_class=tok,
        method=cfg.method.name if method is None else method,
        method_params=cfg.method_params() if method is None else None, agg=cfg.algo.agg, dual_clip=cfg.algo.dual_clip,
        loss_base=loss_base(cfg))
    apply_threads(cfg.train.threads, trainer.model, cfg.model.device)  # 0: automatic (entropy_rft.common.threads)
    log = ErftLog(trainer, cfg, out, k, purge_step=start + 1 if resume else None, on_row=on_row)
    trainer.add_callback(log)
    trainer.token_view = log  # the token view of its rows (probe.view_every)
    trainer.train(resume_from_checkpoint=str(last) if last else None)
    step = trainer.state.global_step // k
    if state.is_main_process:
        trainer.save_model(str(out / "final"))
        tok.save_pretrained(str(out / "final"))
        rundir.write_status(out, "finished", engine="trl", step=step, max_steps=cfg.train.max_steps,
                            processes=state.num_processes)
    state.wait_for_everyone()
    rows = rundir.read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    return rows[-1] if rows else {"step": step}
