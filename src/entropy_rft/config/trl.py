"""The TRL engine's settings (``engine: trl``): the ``GRPOConfig`` an erft config becomes, the ``trl:``
pass-through section checked against TRL's own ``GRPOConfig`` dataclass, and the erft settings that engine does
not honour: refused when they would change training (the results would silently differ from the native
engine's), warned about when they only change what is measured or logged. One line each, naming the field and
the fix. ``trl`` is imported only inside the functions that need it (``preflight`` calls :func:`check` for
``engine: trl`` only).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

from entropy_rft.common.errors import UserError
from entropy_rft.common.options import trackers_selected
from entropy_rft.config.schema import AlgoConfig

# GRPOConfig fields erft sets from its own settings: refused in the `trl:` section, naming what to use instead.
RESERVED: dict[str, str] = {
    "output_dir": "--out", "use_cpu": "model.device", "bf16": "model.autocast_bf16",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "activation_checkpointing": "model.gradient_checkpointing",
    "per_device_train_batch_size": "rollout.prompts_per_step (split over algo.minibatches, algo.grad_accum and "
                                   "the processes)",
    "generation_batch_size": "rollout.prompts_per_step", "steps_per_generation": "algo.minibatches",
    "gradient_accumulation_steps": "algo.grad_accum", "num_iterations": "algo.ppo_epochs",
    "num_generations": "rollout.group_size", "max_completion_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature", "top_p": "rollout.top_p",
    "top_k": "rollout.top_p (erft samples the full softmax, top_k=0)",
    "beta": "algo.ref_kl_coef", "epsilon": "algo.eps_low", "epsilon_high": "algo.eps_high",
    "scale_rewards": "algo.algorithm (grpo: group std, dr_grpo: none)", "loss_type": "algo.agg",
    "learning_rate": "optim.lr", "adam_beta1": "optim.betas", "adam_beta2": "optim.betas",
    "weight_decay": "optim.weight_decay", "warmup_steps": "optim.warmup_steps",
    "lr_scheduler_type": "optim.schedule", "max_grad_norm": "optim.max_grad_norm",
    "max_steps": "train.max_steps", "num_train_epochs": "train.max_steps",
    "save_strategy": "train.checkpoint_every", "save_steps": "train.checkpoint_every",
    "save_total_limit": "train.keep_checkpoints", "seed": "train.seed", "data_seed": "train.seed",
    "disable_tqdm": "train.progress", "resume_from_checkpoint": "erft train --resume",
    "logging_steps": "nothing (erft logs one row per erft step)",
    "disable_dropout": "nothing (erft trains without dropout, as the native engine)",
}
# TRL's own loss knobs that erft replaces by its methods and settings (the trainer refuses them).
REPLACED: dict[str, str] = {
    "delta": "algo.dual_clip", "top_entropy_quantile": "method.name high_entropy",
    "entropy_coef": "method.name entropy_bonus", "use_adaptive_entropy": "method.entropy_target on engine native",
}
# Allowed GRPOConfig fields whose other values EntropyControlGRPOTrainer refuses (its loss is erft's policy_loss).
_SUPPORTED_ONLY: dict[str, tuple[Any, str]] = {
    "importance_sampling_level": ("token", "token-level ratios only"),
    "off_policy_mask_threshold": (None, "no off-policy mask"),
    "vllm_importance_sampling_correction": (False, "policy_loss has no per-token sampling weight"),
}
# Set unless the section says otherwise: TRL's vLLM correction would be refused by the trainer; TRL's
# ratio-weighted reference KL (use_bias_correction_kl, which the trainer supports) is not the native engine's.
_DEFAULTS = {"vllm_importance_sampling_correction": False, "use_bias_correction_kl": False}


def grpo_fields() -> list[str]:
    """The field names of TRL's ``GRPOConfig`` (imports trl)."""
    import dataclasses

    from trl import GRPOConfig

    return [f.name for f in dataclasses.fields(GRPOConfig)]


def section_errors(cfg: Any, fields: list[str] | None = None) -> list[str]:
    """What is wrong with the ``trl:`` section: unknown keys (with the closest GRPOConfig field), keys erft sets
    itself (with the erft field to use), values the trainer refuses. One line each."""
    names = fields if fields is not None else grpo_fields()
    out = []
    for key, value in cfg.trl.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean 'trl.{close[0]}'?" if close else "see the fields of trl.GRPOConfig"
            out.append(f"unknown config field 'trl.{key}' (not a trl.GRPOConfig field); {hint}")
        elif key in RESERVED:
            out.append(f"config field 'trl.{key}' is set by erft; use {RESERVED[key]} instead")
        elif key in REPLACED:
            out.append(f"config field 'trl.{key}' is TRL's own loss knob, which erft replaces; use {REPLACED[key]} "
                       "instead")
        elif key in _SUPPORTED_ONLY and value != _SUPPORTED_ONLY[key][0]:
            ok, why = _SUPPORTED_ONLY[key]
            out.append(f"config field 'trl.{key}' = {value!r} is not supported by engine 'trl' ({why}); set it to "
                       f"{ok!r} or remove it")
    return out


def unhonoured(cfg: Any) -> tuple[list[str], list[str]]:
    """(errors, warnings): erft settings engine 'trl' does not honour. Errors change training (refused);
    warnings only change what is measured or logged (the run goes on without it)."""
    a, p = cfg.algo, cfg.probe
    errors = []
    if a.algorithm == "ppo":
        errors.append("engine 'trl' runs GRPO / Dr.GRPO only; algo.algorithm 'ppo' needs engine 'native' "
                      "(GRPOTrainer has no critic)")
    if a.drop_uniform_groups:
        errors.append("engine 'trl' does not support algo.drop_uniform_groups; set it to false or use engine "
                      "'native'")
    if a.adv_eps != AlgoConfig.adv_eps:
        errors.append(f"engine 'trl' fixes the group-std epsilon at 1e-4; algo.adv_eps {a.adv_eps:g} needs engine "
                      f"'native' (or remove it)")
    if cfg.method.entropy_target is not None:
        errors.append("engine 'trl' has no entropy autopilot; set method.entropy_target: null or use engine "
                      "'native'")
    warnings = []
    if cfg.eval.every:
        warnings.append(f"eval.every {cfg.eval.every}: engine 'trl' runs no periodic evaluation (no eval/* "
                        "metrics); set eval.every=0 and run `erft eval` on the saved policies")
    if p.enabled:
        warnings.append("probe.enabled: engine 'trl' runs no per-update probe (no probe/* metrics); set "
                        "probe.enabled=false")
    for name, what in (("records_every", "writes no token_records.jsonl"), ("jvp_every", "runs no JVP probe"),
                       ("counterfactual_every", "runs no vanilla counterfactual")):
        if getattr(p, name):
            warnings.append(f"probe.{name} {getattr(p, name)}: engine 'trl' {what}; set probe.{name}=0")
    # TRL's W&B callback logs into the W&B run already open (erft's): two step axes in one run. (TensorBoard,
    # MLflow and trackio get a run or folder of TRL's own.)
    if "wandb" in trackers_selected(cfg.train) and ({"wandb", "all"} & set(report_to(cfg))):
        warnings.append("wandb in both train.report_to (erft's rows, erft steps) and trl.report_to (TRL's keys, "
                        "optimizer steps): TRL would log into erft's W&B run on another step axis; remove wandb "
                        "from trl.report_to")
    if cfg.rollout.backend != "auto":
        warnings.append(f"rollout.backend {cfg.rollout.backend!r}: engine 'trl' samples with TRL's generate (or "
                        "vLLM: trl.use_vllm); set rollout.backend=auto")
    if cfg.rollout.cuda_graphs:
        warnings.append("rollout.cuda_graphs: engine 'trl' samples with TRL's generate (or vLLM: trl.use_vllm), "
                        "not erft's static decoder; set rollout.cuda_graphs=false")
    return errors, warnings


def report_to(cfg: Any) -> list[str]:
    """TRL's own ``report_to``: the ``trl:`` section's (a name or a list; default none), TRL's keys on the
    optimizer-step axis. erft's trackers (``train.report_to``, ``train.tensorboard``, ``train.wandb``) get erft's
    metrics rows from erft's callback (``integrations.trl_logging``), with the native keys on the erft step axis,
    as on the native engine: they are not TRL's."""
    want = cfg.trl.get("report_to") or []
    want = [want] if isinstance(want, str) else list(want)
    return [] if want == ["none"] else want


def loss_base(cfg: Any) -> dict[str, Any]:
    """The loss settings erft's config says beyond what GRPOConfig can say, by ``LossSettings`` field: no ratio
    clip on a side (``algo.eps_low/eps_high: null``; TRL's epsilon is a number), and the reference-KL estimator.
    The trainer takes them over TRL's (``EntropyControlGRPOTrainer(loss_base=...)``) and puts the method's own on
    top at every loss call, so a method that sets a side keeps it."""
    out: dict[str, Any] = {"ref_kl_estimator": cfg.algo.ref_kl_estimator}
    out.update({side: None for side in ("eps_low", "eps_high") if getattr(cfg.algo, side) is None})
    return out


def step_factor(cfg: Any) -> int:
    """TRL optimizer steps per erft step (one rollout batch): minibatches × PPO epochs."""
    return cfg.algo.minibatches * cfg.algo.ppo_epochs


def grpo_config(cfg: Any, out: Path, world: int):
    """The ``trl.GRPOConfig`` equivalent of an erft ``Config`` (one erft step = one generation batch), with the
    ``trl:`` section on top (refused keys raise :class:`UserError`)."""
    from trl import GRPOConfig

    errors = section_errors(cfg) + unhonoured(cfg)[0]
    if errors:
        raise UserError("; ".join(errors))
    r, a, o, t = cfg.rollout, cfg.algo, cfg.optim, cfg.train
    n_seq = r.prompts_per_step * r.group_size
    per_update = a.minibatches * a.grad_accum * world
    if n_seq % per_update:
        raise UserError(f"engine 'trl': prompts_per_step*group_size ({n_seq}) must be divisible by "
                        f"algo.minibatches*algo.grad_accum*processes ({per_update})")
    k = step_factor(cfg)
    sched = {"constant": "constant_with_warmup" if o.warmup_steps else "constant", "linear": "linear",
             "cosine": "cosine"}[o.schedule]
    cpu = cfg.model.device == "cpu"
    kw = dict(
        output_dir=str(Path(out) / "trl"), use_cpu=cpu, bf16=cfg.model.autocast_bf16 and not cpu,
        per_device_train_batch_size=n_seq // per_update, gradient_accumulation_steps=a.grad_accum,
        steps_per_generation=a.minibatches * a.grad_accum, num_iterations=a.ppo_epochs,
        num_generations=r.group_size, max_completion_length=r.max_new_tokens, temperature=r.temperature,
        top_p=r.top_p, top_k=0, beta=a.ref_kl_coef,
        epsilon=a.eps_low if a.eps_low is not None else 0.2,  # null: loss_overrides takes the clip off
        epsilon_high=a.eps_high if a.eps_high is not None else 0.2,
        scale_rewards="group" if a.algorithm == "grpo" else "none", loss_type="dapo",
        learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1], weight_decay=o.weight_decay,
        warmup_steps=o.warmup_steps, lr_scheduler_type=sched,
        max_grad_norm=o.max_grad_norm if o.max_grad_norm is not None else 0.0,
        max_steps=t.max_steps * k, logging_steps=1, save_strategy="steps", save_steps=t.checkpoint_every * k,
        save_total_limit=t.keep_checkpoints, seed=t.seed, data_seed=t.seed, report_to=report_to(cfg),
        disable_tqdm=not t.progress, disable_dropout=True, dataloader_num_workers=0, log_completions=False,
        # GRPOConfig turns checkpointing on by default; erft's setting decides, as on the native engine.
        gradient_checkpointing=cfg.model.gradient_checkpointing, **_DEFAULTS,
    )
    kw.update({key: v for key, v in cfg.trl.items() if key != "report_to"})  # the section's own (not RESERVED)
    return GRPOConfig(**kw)


def check(cfg: Any) -> list[str]:
    """Preflight for ``engine: trl``: raise :class:`UserError` (one line) for a bad ``trl:`` section or a
    refused erft setting, then build the GRPOConfig so that TRL validates the values too; return the warnings."""
    errors = section_errors(cfg)
    more, warnings = unhonoured(cfg)
    errors += more
    if cfg.trl.get("use_vllm") and importlib.util.find_spec("vllm") is None:
        errors.append("config field 'trl.use_vllm' is true but vllm is not installed; pip install vllm, or set "
                      "trl.use_vllm=false")
    if errors:
        raise UserError("; ".join(errors))
    world = int(os.environ.get("WORLD_SIZE", "1"))  # accelerate launch sets it in every process
    try:
        grpo_config(cfg, Path(tempfile.gettempdir()) / "erft-trl-check", world)  # writes nothing
    except (ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"config section 'trl' refused by trl.GRPOConfig: {first}") from None
    return warnings
