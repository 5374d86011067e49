"""The state of a native run (``Run``): what it carries from step to step, how it is built from a config, and
its checkpoint.

``Run`` holds state only: the model, tokenizer and reference policy, the task and its split, the method and the
autopilot, the optimizer and scheduler, the PPO value head, the loss's settings, the RNGs and the step. The
stages of a step (``stages``) read and advance it; the loop is ``trainer.train``; the run directory's files
around the loop (resume, status, signals) are ``launch.run``'s.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import yaml

from entropy_rft.common.threads import apply_threads
from entropy_rft.config.schema import Config, autopilot_gains, config_to_dict
from entropy_rft.control.autopilot import Autopilot, parse_target
from entropy_rft.control.registry import Method, build_method
from entropy_rft.core.loss_types import Agg, KLEstimator, LossSettings
from entropy_rft.rundir import checkpoints
from entropy_rft.tasks import build_task
from entropy_rft.tasks.base import Example, Task

# the files a native checkpoint must hold for a resume (``checkpoints.resume_point``)
CHECKPOINT_PARTS = ("model", "optim", "sched", "rng", "trainer")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(gens: dict[str, torch.Generator]) -> dict[str, Any]:
    """Every RNG's state as tensors and plain Python values (``torch.load(..., weights_only=True)`` loads it:
    numpy's key array is a tensor here, not a pickled ndarray)."""
    name, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    return {"python": random.getstate(),
            "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "generators": {k: g.get_state() for k, g in gens.items()}}


def set_rng_state(state: dict[str, Any], gens: dict[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in gens.items():
        g.set_state(state["generators"][k])


def make_scheduler(optim: torch.optim.Optimizer, cfg: Config, total_updates: int):
    warm, kind = cfg.optim.warmup_steps, cfg.optim.schedule

    def factor(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        frac = (i - warm) / max(1, total_updates - warm)
        if kind == "linear":
            return max(0.0, 1.0 - frac)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


class ValueHead(torch.nn.Module):
    """PPO critic on the policy's (detached) hidden states: the policy's entropy dynamics stay its own."""

    def __init__(self, d: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden.detach().float()).squeeze(-1)


def run_method(cfg: Config) -> Method:
    """The run's method, built from ``cfg.method`` (the one place the native engine builds it)."""
    return build_method(cfg.method.name, **cfg.method_params())


def engine_loss_settings(cfg: Config) -> LossSettings:
    """The native engine's loss settings from ``cfg.algo`` (the ratio clip, the dual clip, the aggregation, the
    reference KL), built once when the run is set up: the one place the engine reads them from the config. A
    method's own go on top at each update (``stages.loss_rule``)."""
    a = cfg.algo  # its option names are validated with the config (common.options); LossSettings checks them again
    return LossSettings(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, agg=cast(Agg, a.agg),
                        ref_kl_coef=a.ref_kl_coef, ref_kl_estimator=cast(KLEstimator, a.ref_kl_estimator))


# ----------------------------------------------------------------------------- the state


@dataclass(eq=False)
class Run:
    """Everything a native run carries from step to step (build it with :func:`build_run`)."""

    cfg: Config
    out: Path  # the run directory
    device: torch.device
    model: Any  # the policy (a transformers causal LM), trained in place
    tok: Any  # its tokenizer
    ref: Any | None  # the frozen reference policy (algo.ref_kl_coef > 0)
    task: Task
    train_set: list[Example]
    val_set: list[Example]
    method: Method  # its knob moves (autopilot) and a controller method keeps its own state
    vanilla: Method  # the reference of the counterfactual and the weight lens
    autopilot: Autopilot | None  # with method.entropy_target
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    value_head: ValueHead | None  # PPO's critic
    value_optim: torch.optim.Optimizer | None
    gens: dict[str, torch.Generator]  # "data" (prompts, minibatches), "method" (its random picks), "sample"
    loss: LossSettings  # the engine's loss settings (engine_loss_settings); agg is read from here
    step: int = 0  # the step being taken (the last one taken, between steps)
    fitting_prompts: set[tuple] = field(default_factory=set)  # prompts checked against the context, once each


def build_run(cfg: Config, out: Path, start_step: int = 0, method: Method | None = None) -> Run:
    """Load the policy, split the task, check the prompts, build the method, the optimizer and the RNGs.

    A prompt that cannot fit the context with the response budget is refused here (UserError), before any
    step: the evaluation set and the first training prompts (each step checks its own, ``stages``)."""
    from transformers.utils import logging as hf_logging

    from entropy_rft.training.policies import load_policy

    hf_logging.disable_progress_bar()

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    device = torch.device(cfg.model.device)
    dtype = getattr(torch, cfg.model.dtype)
    model, tok = load_policy(cfg.model.name, device=str(device), dtype=dtype, cpu_gemm=cfg.model.cpu_gemm)
    apply_threads(cfg.train.threads, model, cfg.model.device)  # 0: automatic (entropy_rft.common.threads)
    from entropy_rft.models.precision import lr_warning
    from entropy_rft.training import preflight

    preflight.warn_once(lr_warning(model, cfg.optim.lr))
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ref = None
    if cfg.algo.ref_kl_coef > 0:
        ref, _ = load_policy(cfg.model.name, device=str(device), dtype=dtype, cpu_gemm=cfg.model.cpu_gemm)
        ref.eval().requires_grad_(False)
    task = build_task(cfg.task.name, **cfg.task.params)
    train_set, val_set = task.split(cfg.train.seed)
    fitting: set[tuple] = set()
    check_prompts([ex.prompt for ex in [*val_set[: cfg.eval.prompts], *train_set[:256]]], tok, model,
                  cfg.rollout.max_new_tokens, fitting)
    method = run_method(cfg) if method is None else method  # None: not built by the request's check
    method.set_horizon(cfg.train.max_steps)  # a rule that moves over training (Entrocraft's band)
    vanilla = build_method("none")
    target = parse_target(cfg.method.entropy_target)
    autopilot = None if target is None else Autopilot(method, target, autopilot_gains(cfg), cfg.train.max_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                              weight_decay=cfg.optim.weight_decay)
    updates = cfg.train.max_steps * cfg.algo.minibatches * cfg.algo.ppo_epochs
    sched = make_scheduler(optim, cfg, updates)
    value_head = value_optim = None
    if cfg.algo.algorithm == "ppo":
        d = model.get_output_embeddings().weight.shape[1]
        value_head = ValueHead(d).to(device)
        value_optim = torch.optim.AdamW(value_head.parameters(), lr=cfg.algo.value_lr)
    s = cfg.train.seed
    gens = {
        "data": torch.Generator().manual_seed(s + 1),
        "method": torch.Generator().manual_seed(s + 2),
        "sample": torch.Generator(device=device).manual_seed(s + 3),
    }
    return Run(cfg, out, device, model, tok, ref, task, train_set, val_set, method, vanilla, autopilot, optim,
               sched, value_head, value_optim, gens, engine_loss_settings(cfg), start_step, fitting)


def check_prompts(prompts: list[str], tok: Any, model: Any, max_new_tokens: int, fitting: set[tuple]) -> None:
    """One line (UserError) when a prompt plus ``max_new_tokens`` exceeds the model's context. Prompts in
    ``fitting`` were checked before; the ones that fit are added to it."""
    from entropy_rft.tasks.prompts import encode_prompt
    from entropy_rft.training.preflight import check_prompt_lengths

    new = {(type(p), str(p), getattr(p, "system", None)): p for p in prompts}
    new = {k: p for k, p in new.items() if k not in fitting}
    if not new:
        return
    check_prompt_lengths([len(encode_prompt(tok, p)) for p in new.values()], max_new_tokens,
                         getattr(model.config, "max_position_embeddings", None), truncate=False)
    fitting.update(new)


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_state(run: Run) -> dict[str, Any]:
    """The tensors and plain values a checkpoint holds (``checkpoints.save_checkpoint``'s parts)."""
    st = {"model": run.model.state_dict(), "optim": run.optim.state_dict(), "sched": run.sched.state_dict(),
          "rng": rng_state(run.gens), "trainer": {"step": run.step, "method": method_state(run.method)}}
    if run.autopilot is not None:
        st["trainer"]["autopilot"] = run.autopilot.state_dict()
    if run.value_head is not None:
        st["value_head"] = run.value_head.state_dict()
        assert run.value_optim is not None  # made with the value head
        st["value_optim"] = run.value_optim.state_dict()
    return st


def method_state(method: Method) -> dict[str, Any]:
    st: dict[str, Any] = {"knob": method.get_knob()} if method.knob else {}
    own = method.state_dict()  # a controller method's own state (adaptive_entropy, entropic)
    if own:
        st["own"] = own
    return st


def load_checkpoint_state(run: Run, st: dict[str, Any]) -> None:
    """Put ``run`` back into the state ``checkpoint_state`` recorded."""
    run.model.load_state_dict(st["model"])
    run.optim.load_state_dict(st["optim"])
    run.sched.load_state_dict(st["sched"])
    if run.value_head is not None:
        run.value_head.load_state_dict(st["value_head"])
        assert run.value_optim is not None  # made with the value head
        run.value_optim.load_state_dict(st["value_optim"])
    set_rng_state(st["rng"], run.gens)
    run.step = int(st["trainer"]["step"])
    if st["trainer"].get("method", {}).get("knob") is not None:
        run.method.set_knob(st["trainer"]["method"]["knob"])
    if st["trainer"].get("method", {}).get("own") is not None:
        run.method.load_state_dict(st["trainer"]["method"]["own"])
    if run.autopilot is not None and st["trainer"].get("autopilot") is not None:
        run.autopilot.load_state_dict(st["trainer"]["autopilot"])


def save_checkpoint(run: Run) -> None:
    """Write ``checkpoints/step_N/`` for the run's step (with a copy of the config to restore from)."""
    config = yaml.safe_dump(config_to_dict(run.cfg), sort_keys=False).encode()
    checkpoints.save_checkpoint(run.out, run.step, checkpoint_state(run), run.cfg.train.keep_checkpoints,
                                extra_files={"config.yaml": config})
