"""The single-process GRPO / Dr.GRPO / PPO loop, on CPU or one GPU, with entropy control and the probe.

Read ``train`` top to bottom: each step samples prompts, rolls out, scores, computes advantages, runs the
old-policy forward (TokenStats), lets the autopilot set the method's knob (when an entropy target is set),
builds the method's masks, takes the optimizer updates with ``policy_loss``, probes the entropy change
(tabular every step; the JVP and the counterfactual every k steps) and logs. What a step reports is
``step_log``'s, checkpoints and the resume point are ``checkpoints``'; everything else here is a small helper.
The maths lives in ``dynamics``, ``control``, ``loss`` and ``advantages``; this file only wires it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from entropy_rft import control
from entropy_rft.common.errors import UserError
from entropy_rft.common.threads import apply_threads
from entropy_rft.config.schema import Config, autopilot_gains, config_to_dict
from entropy_rft.control.autopilot import Autopilot, parse_target
from entropy_rft.core import advantages as adv_lib
from entropy_rft.core.dynamics import NonFiniteLogits
from entropy_rft.core.loss import agg_weights, policy_loss
from entropy_rft.core.metrics import masked_mean
from entropy_rft.policy import evaluation
from entropy_rft.policy.forward import PolicyOut, policy_forward
from entropy_rft.policy.jvp import entropy_jvp
from entropy_rft.policy.rollout import RolloutBatch, sample
from entropy_rft.rundir import checkpoints
from entropy_rft.rundir import files as rundir
from entropy_rft.rundir.logger import Logger
from entropy_rft.tasks import build_task
from entropy_rft.tasks.base import Example
from entropy_rft.training.probe import (
    agreement_metrics,
    counterfactual_metrics,
    due,
    probe_metrics,
    tabular_prediction,
)
from entropy_rft.training.records import OldPolicy, Probed, Rule, Scored, Selection, Update, trained_mask
from entropy_rft.training.step_log import batch_metrics, lens_metrics, log_step, progress_bar

# ----------------------------------------------------------------------------- small helpers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def device_name(device: torch.device) -> str:
    """The device in words for run.json: the GPU's name on CUDA (``cuda:0 NVIDIA H100 80GB HBM3``), else its type."""
    if device.type == "cuda":
        return f"cuda:{device.index or 0} {torch.cuda.get_device_name(device)}"
    return str(device)


def rng_state(gens: dict[str, torch.Generator]) -> dict[str, Any]:
    """Every RNG's state as tensors and plain Python values (``torch.load(..., weights_only=True)`` loads it:
    numpy's key array is a tensor here, not a pickled ndarray)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
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


def _rows(m: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if m is None else m[idx]


class ValueHead(torch.nn.Module):
    """PPO critic on the policy's (detached) hidden states: the policy's entropy dynamics stay its own."""

    def __init__(self, d: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, 1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden.detach().float()).squeeze(-1)


# ----------------------------------------------------------------------------- the run


class Run:
    """Model, optimizer, RNGs and logs of one run directory. ``train()`` drives it."""

    def __init__(self, cfg: Config, out: Path, start_step: int = 0, method: control.Method | None = None):
        from transformers.utils import logging as hf_logging

        from entropy_rft.training.policies import load_policy

        hf_logging.disable_progress_bar()

        self.cfg, self.out = cfg, out
        self.progress_note: Callable[[str], None] = lambda text: None  # the progress bar's, while training
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        seed_everything(cfg.train.seed)
        self.device = torch.device(cfg.model.device)
        dtype = getattr(torch, cfg.model.dtype)
        self.model, self.tok = load_policy(cfg.model.name, device=str(self.device), dtype=dtype)
        apply_threads(cfg.train.threads, self.model, cfg.model.device)  # 0: automatic (entropy_rft.common.threads)
        from entropy_rft.models.precision import lr_warning
        from entropy_rft.training import preflight

        preflight.warn_once(lr_warning(self.model, cfg.optim.lr))
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.ref = None
        if cfg.algo.ref_kl_coef > 0:
            self.ref, _ = load_policy(cfg.model.name, device=str(self.device), dtype=dtype)
            self.ref.eval().requires_grad_(False)
        self.task = build_task(cfg.task.name, **cfg.task.params)
        self.train_set, self.val_set = self.task.split(cfg.train.seed)
        # Prompts that cannot fit the context with the response budget are refused before any step (the
        # evaluation set, and the first training prompts; each step checks its own, see sample_prompts).
        self.fitting_prompts: set[tuple] = set()  # checked once each, not every step
        self.check_prompts([ex.prompt for ex in [*self.val_set[: cfg.eval.prompts], *self.train_set[:256]]])
        # ``method``: the instance the request's check built (config.validation.validate_method), else built here
        self.method = method if method is not None else control.build_method(cfg.method.name, **cfg.method_params())
        self.vanilla = control.build_method("none")  # the reference of the counterfactual and the weight lens
        target = parse_target(cfg.method.entropy_target)
        self.autopilot = None if target is None else Autopilot(self.method, target, autopilot_gains(cfg),
                                                                cfg.train.max_steps)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                       weight_decay=cfg.optim.weight_decay)
        updates = cfg.train.max_steps * cfg.algo.minibatches * cfg.algo.ppo_epochs
        self.sched = make_scheduler(self.optim, cfg, updates)
        self.value_head = self.value_optim = None
        if cfg.algo.algorithm == "ppo":
            d = self.model.get_output_embeddings().weight.shape[1]
            self.value_head = ValueHead(d).to(self.device)
            self.value_optim = torch.optim.AdamW(self.value_head.parameters(), lr=cfg.algo.value_lr)
        s = cfg.train.seed
        self.gens = {
            "data": torch.Generator().manual_seed(s + 1),
            "method": torch.Generator().manual_seed(s + 2),
            "sample": torch.Generator(device=self.device).manual_seed(s + 3),
        }
        self.step = start_step
        self.stop_signal: int | None = None

    # ------------------------------------------------------------------ config-derived pieces

    def rule(self, method: control.Method | None = None) -> Rule:
        """``method`` (default: the run's) and ``policy_loss``'s settings as they stand now (knobs such as
        coef / eps_high, which the autopilot moves, enter the loss kwargs)."""
        method = method or self.method
        a = self.cfg.algo
        kw = dict(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, agg=a.agg,
                  ref_kl_coef=a.ref_kl_coef, ref_kl_estimator=a.ref_kl_estimator)
        kw.update(method.loss_kwargs())
        return Rule(method, kw)

    def autocast(self):
        if self.cfg.model.autocast_bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, batch: RolloutBatch, *, with_entropy: bool = False):
        with self.autocast():
            return policy_forward(self.model, batch, self.cfg.rollout.temperature, with_entropy=with_entropy,
                                  fused=self.cfg.model.fused_logp)

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, Any]:
        st = {"model": self.model.state_dict(), "optim": self.optim.state_dict(), "sched": self.sched.state_dict(),
              "rng": rng_state(self.gens), "trainer": {"step": self.step, "method": self.method_state()}}
        if self.autopilot is not None:
            st["trainer"]["autopilot"] = self.autopilot.state_dict()
        if self.value_head is not None:
            st["value_head"] = self.value_head.state_dict()
            st["value_optim"] = self.value_optim.state_dict()
        return st

    def method_state(self) -> dict[str, Any]:
        st: dict[str, Any] = {"knob": self.method.get_knob()} if self.method.knob else {}
        own = self.method.state_dict()  # a controller method's own state (adaptive_entropy, entropic)
        if own:
            st["own"] = own
        return st

    def load_state(self, st: dict[str, Any]) -> None:
        self.model.load_state_dict(st["model"])
        self.optim.load_state_dict(st["optim"])
        self.sched.load_state_dict(st["sched"])
        if self.value_head is not None:
            self.value_head.load_state_dict(st["value_head"])
            self.value_optim.load_state_dict(st["value_optim"])
        set_rng_state(st["rng"], self.gens)
        self.step = int(st["trainer"]["step"])
        if st["trainer"].get("method", {}).get("knob") is not None:
            self.method.set_knob(st["trainer"]["method"]["knob"])
        if st["trainer"].get("method", {}).get("own") is not None:
            self.method.load_state_dict(st["trainer"]["method"]["own"])
        if self.autopilot is not None and st["trainer"].get("autopilot") is not None:
            self.autopilot.load_state_dict(st["trainer"]["autopilot"])

    def save(self) -> None:
        config = yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False).encode()  # a copy to restore from
        checkpoints.save_checkpoint(self.out, self.step, self.state(), self.cfg.train.keep_checkpoints,
                                    extra_files={"config.yaml": config})

    # ------------------------------------------------------------------ the stages of a step

    def check_prompts(self, prompts: list[str]) -> None:
        """One line (UserError) when a prompt plus ``rollout.max_new_tokens`` exceeds the model's context."""
        from entropy_rft.tasks.prompts import encode_prompt
        from entropy_rft.training.preflight import check_prompt_lengths

        new = {(type(p), str(p), getattr(p, "system", None)): p for p in prompts}
        new = {k: p for k, p in new.items() if k not in self.fitting_prompts}
        if not new:
            return
        check_prompt_lengths([len(encode_prompt(self.tok, p)) for p in new.values()],
                             self.cfg.rollout.max_new_tokens,
                             getattr(self.model.config, "max_position_embeddings", None), truncate=False)
        self.fitting_prompts.update(new)

    def sample_prompts(self) -> list[Example]:
        n = self.cfg.rollout.prompts_per_step
        idx = torch.randint(len(self.train_set), (n,), generator=self.gens["data"]).tolist()
        examples = [self.train_set[i] for i in idx]
        self.check_prompts([ex.prompt for ex in examples])
        return examples

    def rollout(self, prompts: list[str]) -> RolloutBatch:
        r = self.cfg.rollout
        with self.autocast():
            return sample(self.model, self.tok, prompts, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                          top_p=r.top_p, backend=r.backend, generator=self.gens["sample"],
                          cuda_graphs=r.cuda_graphs, check_every=r.check_every)

    def score(self, group: list[Example], rb: RolloutBatch) -> Scored:
        """Stage 3: the task's rewards; with ``algo.drop_uniform_groups`` a group whose rewards are all equal
        does not train (GRPO and Dr.GRPO)."""
        cfg = self.cfg
        rewards = torch.tensor(self.task.rewards(rb.responses, group), dtype=torch.float32, device=self.device)
        mask = rb.response_mask.clone()
        if cfg.algo.drop_uniform_groups and cfg.algo.algorithm != "ppo":
            mask &= ~adv_lib.uniform_groups(rewards, cfg.rollout.group_size)[:, None]
        return Scored(group, rb, rewards, mask)

    @property
    def single_update(self) -> bool:
        """One optimizer update per rollout batch (one minibatch, one epoch, no accumulation, no critic)."""
        a = self.cfg.algo
        return a.minibatches == 1 and a.ppo_epochs == 1 and a.grad_accum == 1 and self.value_head is None

    @torch.no_grad()
    def old_policy(self, s: Scored, live: bool = False) -> OldPolicy:
        """Stages 4-5: old-policy log-probs and TokenStats for the whole batch, reference log-probs, values,
        and the advantages.

        ``live`` (only with :attr:`single_update`): the old policy *is* the policy that the single update
        differentiates, so this forward keeps its graph and the update reuses it instead of recomputing the
        same numbers (PPO's ratio is then exactly 1, as it is after a recompute)."""
        with torch.enable_grad() if live else contextlib.nullcontext():
            out = self.forward(s.rollout, with_entropy=live and self.method.needs_entropy_grad())
        values = self.value_head(out.hidden) if self.value_head is not None else None
        ref_logp = None
        if self.ref is not None:
            with self.autocast():
                ref_logp = policy_forward(self.ref, s.rollout, self.cfg.rollout.temperature,
                                          fused=self.cfg.model.fused_logp).logp.detach()
        a = self.cfg.algo
        adv, returns = adv_lib.token_advantages(s.rewards, s.mask, values, algorithm=a.algorithm,
                                                group_size=self.cfg.rollout.group_size, adv_eps=a.adv_eps,
                                                gamma=a.gamma, lam=a.lam)
        return OldPolicy(out.logp.detach(), out.stats, adv, returns, ref_logp, out if live else None)

    def select(self, s: Scored, old: OldPolicy) -> Selection:
        """Stage 6: the autopilot (entropy target) sets the method's knob from this batch's measured entropy
        (all response tokens), or, with no autopilot, a controller method runs its own law (``Method.observe``,
        on the tokens that train); then the method's rollout-level masks, from the old-policy statistics."""
        if self.autopilot is not None:
            control_m = self.autopilot.update(self.step, masked_mean(old.stats.entropy, s.rollout.response_mask))
        else:
            control_m = self.method.observe(old.stats, s.mask, self.cfg.algo.agg)
        masks = self.method.rollout_masks(old.stats, old.adv, s.mask)
        return Selection(masks.keep, control_m, masks.adv_shift, masks.weight_select)

    def minibatches(self, n: int) -> list[torch.Tensor]:
        perm = torch.randperm(n, generator=self.gens["data"])
        return [c for c in perm.chunk(self.cfg.algo.minibatches) if c.numel()]

    def update(self, s: Scored, old: OldPolicy, sel: Selection | None = None, rule: Rule | None = None) -> Update:
        """Stages 7-8: PPO epochs × minibatches of optimizer updates with ``rule`` (default: the run's method
        as it stands). Returns the averaged loss metrics and the tokens a minibatch-level method zeroed."""
        rule = rule or self.rule()
        keep = None if sel is None else sel.keep
        extra = Selection(None, {}) if sel is None else sel  # adv_shift, weight_select of the method
        logs = []
        zeroed = torch.zeros_like(s.mask)  # tokens zeroed by a minibatch-level method (first epoch)
        live = old.live  # the old-policy forward, when it is the single update's own: used once
        for epoch in range(self.cfg.algo.ppo_epochs):
            for idx in self.minibatches(s.mask.shape[0]):
                logs.append(self.update_minibatch(s, old, keep, rule, idx, zeroed if epoch == 0 else None, live,
                                                  extra))
                live = None
        out: dict[str, Any] = {}
        for k in logs[0]:
            vals = [d[k] for d in logs if d.get(k) is not None]
            out[k] = float(np.mean(vals)) if vals else None
        return Update(out, zeroed)

    def update_minibatch(self, s: Scored, old: OldPolicy, keep: torch.Tensor | None, rule: Rule, idx: torch.Tensor,
                         zeroed: torch.Tensor | None, live: PolicyOut | None, extra: Selection | None = None) -> dict:
        cfg, a = self.cfg, self.cfg.algo
        need_ent = rule.method.needs_entropy_grad()
        micro = [c for c in idx.chunk(a.grad_accum) if c.numel()]
        mb_mask = s.mask[idx]
        first = None
        if len(micro) == 1:  # one forward with grad; the selection uses its detached log-probs
            first = live.rows(idx) if live is not None else self.forward(s.rollout.select(idx), with_entropy=need_ent)
            cur = first.logp.detach()
        elif rule.minibatch_masks:  # accumulation: select over the whole minibatch first
            with torch.no_grad():
                cur = self.forward(s.rollout.select(idx)).logp
        # The one selection rule (control.select_minibatch): Clip-Cov / KL-Cov over the whole minibatch.
        mb_masks, counted, _ = control.select_minibatch(
            cur if rule.minibatch_masks else None, old.logp[idx], old.adv[idx], mb_mask,
            None if keep is None else keep[idx], rule.method, rule.loss_kwargs.get("eps_low"),
            rule.loss_kwargs.get("eps_high"), self.gens["method"])
        if zeroed is not None and mb_masks.zeroed is not None:
            zeroed[idx] |= mb_masks.zeroed & mb_mask
        mb_weights = agg_weights(counted, a.agg)  # minibatch-level weights, for control.microbatch_loss_scale

        self.optim.zero_grad(set_to_none=True)
        metrics: list[dict] = []
        value_loss_total = 0.0
        pos = {int(j): i for i, j in enumerate(idx.tolist())}
        for mi in micro:
            local = torch.tensor([pos[int(j)] for j in mi.tolist()])
            out = first if first is not None else self.forward(s.rollout.select(mi), with_entropy=need_ent)
            loss, met = policy_loss(
                out.logp, old.logp[mi], old.adv[mi], s.mask[mi],
                keep=_rows(mb_masks.keep, local), zeroed=_rows(mb_masks.zeroed, local),
                kl_cov_select=_rows(mb_masks.kl_cov_select, local),
                ref_logp=None if old.ref_logp is None else old.ref_logp[mi],
                adv_shift=None if extra is None else _rows(extra.adv_shift, mi),
                weight_select=None if extra is None else _rows(extra.weight_select, mi),
                entropy=out.entropy, **rule.loss_kwargs)
            if len(micro) > 1:  # re-weight so the accumulated gradient equals the whole minibatch's loss
                loss = loss * control.microbatch_loss_scale(mb_weights[local], counted[local], a.agg)
            if self.value_head is not None:
                v = self.value_head(out.hidden)
                vm = s.mask[mi].float()
                vloss = (((v - old.returns[mi]) ** 2) * vm).sum() / vm.sum().clamp(min=1)
                loss = loss + a.value_coef * vloss * (len(mi) / len(idx))
                value_loss_total += float(vloss.detach()) * len(mi) / len(idx)
            loss.backward()
            metrics.append(met)
        gn = None
        if cfg.optim.max_grad_norm is not None:
            gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm))
        self.optim.step()
        self.sched.step()
        if self.value_optim is not None:
            self.value_optim.step()
            self.value_optim.zero_grad(set_to_none=True)
        out_m = {k: float(np.mean([m[k] for m in metrics if m.get(k) is not None]))
                 if any(m.get(k) is not None for m in metrics) else None for k in metrics[0]}
        out_m["optim/grad_norm"] = gn
        out_m["optim/lr"] = self.sched.get_last_lr()[0]
        if self.value_head is not None:
            out_m["loss/value"] = value_loss_total
        return out_m

    @torch.no_grad()
    def probe(self, s: Scored, old: OldPolicy, trained: torch.Tensor) -> Probed:
        """Stage 9: entropy after the updates, on the same tokens, against the tabular prediction for the
        tokens that ``trained``."""
        after = self.forward(s.rollout)
        mask = s.mask
        w = agg_weights(trained, self.cfg.algo.agg)
        pred = tabular_prediction(old.stats.s_centered, old.adv, w)
        actual = after.stats.entropy - old.stats.entropy
        m = probe_metrics(pred, actual, mask) if self.cfg.probe.enabled else {}
        log_r = (after.logp - old.logp).double()
        m["policy/approx_kl"] = masked_mean(torch.expm1(log_r) - log_r, mask)
        return Probed(pred, actual, after.logp, torch.exp(log_r), m)

    def params_snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def jvp_probe(self, s: Scored, probed: Probed, before: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The network's first-order ΔH per token (∇θH·Δθ by forward-mode AD at the pre-update parameters,
        along the step's actual update) against the actual ΔH that ``probe`` measured on the same tokens."""
        delta = {n: p.detach() - before[n] for n, p in self.model.named_parameters()}
        _, pred = entropy_jvp(self.model, s.rollout, self.cfg.rollout.temperature, before, delta)
        m = agreement_metrics(pred, probed.actual, s.mask, "probe/jvp_")
        m["probe/dH_jvp"] = masked_mean(pred, s.mask)
        return m

    def vanilla_counterfactual(self, s: Scored, old: OldPolicy) -> float | None:
        """From this exact state (parameters, optimizer, scheduler, RNGs, knob), take the vanilla update on
        the same records, measure the batch-mean entropy change, then restore the state: training is
        unaffected. The vanilla rule is a value passed to ``update``; nothing of the run is swapped."""
        saved = copy.deepcopy(self.state())
        rule = self.rule(self.vanilla)
        try:
            self.update(s, dataclasses.replace(old, live=None), None, rule)
            with torch.no_grad():
                after = self.forward(s.rollout)
            return masked_mean(after.stats.entropy - old.stats.entropy, s.mask)
        finally:
            self.load_state(saved)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Avg@K, Pass@K, Maj@K, distinct correct answers, pass-rate histogram and entropy on validation.

        Sampling uses its own generator seeded from (seed, step), so evaluation never moves the training RNG.
        """
        e = self.cfg.eval
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed * 1_000_003 + self.step)
        note = self.progress_note
        with self.autocast():
            out = evaluation.evaluate_policy(
                self.model, self.tok, self.task, self.val_set[: e.prompts], n_samples=e.samples,
                temperature=e.temperature, max_new_tokens=self.cfg.rollout.max_new_tokens, generator=gen,
                batch_size=e.batch_size, cuda_graphs=self.cfg.rollout.cuda_graphs,
                check_every=self.cfg.rollout.check_every,
                on_progress=lambda done, total: note(f"step {self.step} evaluation: {done}/{total} prompts"))
        for k in ("eval/samples", "eval/seconds"):
            out.pop(k)
        return out


# ----------------------------------------------------------------------------- the loop


def train(cfg: Config, out: str | Path, *, resume: bool = False, on_step=None,
          method: control.Method | None = None) -> dict[str, Any]:
    """Train ``cfg`` into run directory ``out`` (fresh, or resumed from its newest intact checkpoint).

    Returns the last metrics row. SIGTERM/SIGINT save a checkpoint, record the status "stopped" and raise
    SystemExit(143/130). The caller holds the run directory's lock (``launch``). ``method``: the method the
    request's check built (``config.validation.validate_method``), so the run does not build it again.
    """
    out = Path(out)
    required = ("model", "optim", "sched", "rng", "trainer")
    _, state = checkpoints.resume_point(out, required, 0 if cfg.eval.every else 1) if resume else (None, None)
    if resume and state is None:
        checkpoints.refuse_lost_checkpoints(out, cfg.train.checkpoint_every)
    start = int(state["trainer"]["step"]) if state else 0
    # loads the model and checks the prompts: a refusal writes nothing
    run = Run(cfg, out, start_step=start, method=method)
    if resume:
        rundir.truncate_logs(out, start if state else -1)
    else:
        rundir.atomic_write_text(out / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    where = dict(python=sys.version.split()[0], torch=torch.__version__, device=device_name(run.device))
    t_start = time.monotonic()
    rundir.write_status(out, "running", start_step=start, max_steps=cfg.train.max_steps, **where)
    if state is not None:
        run.load_state(state)
    # a resume purges the trackers' events after the checkpoint (all of them when it starts again from step 0)
    logger = Logger(out, cfg, purge_step=(start + 1 if state else 0) if resume else None)
    handlers = _install_signal_handlers(run)
    last: dict[str, Any] = {}
    status = "failed"
    try:
        with progress_bar(cfg, start) as bar:
            run.progress_note = bar.note
            if start == 0 and cfg.eval.every:
                last = {"step": 0, **run.evaluate()}
                logger.log(last)
            for step in range(start + 1, cfg.train.max_steps + 1):
                run.step = step
                try:
                    last = train_step(run, logger)
                except NonFiniteLogits as e:
                    clip = "" if cfg.optim.max_grad_norm is not None else " or set optim.max_grad_norm"
                    raise UserError(
                        f"step {step}: the policy's logits are not finite ({e}): training diverged, or the model's "
                        f"weights are damaged; lower optim.lr (now {cfg.optim.lr:g}){clip} and start a new run "
                        "(the checkpoints before this step are kept)") from None
                rundir.fault_point("after_row", step)
                bar(last)
                if on_step is not None:
                    on_step(run, last)
                if step % cfg.train.checkpoint_every == 0 or step == cfg.train.max_steps or run.stop_signal:
                    logger.sync()
                    run.save()
                if run.stop_signal:
                    status = "stopped"
                    print(f"stopped at step {step}, checkpoint saved; continue with `erft train --resume {out}`",
                          file=sys.stderr, flush=True)
                    raise SystemExit(128 + run.stop_signal)
        _export_final(run)
        status = "finished"
    finally:
        logger.close(quiet=status != "finished")
        _restore_signal_handlers(handlers)
        with contextlib.suppress(OSError):  # a read-only or full disk must not hide the first error
            rundir.write_status(out, status, step=run.step, start_step=start, max_steps=cfg.train.max_steps, **where,
                                wall_s=round(time.monotonic() - t_start, 1))  # this session's, from start_step
    return last


def train_step(run: Run, logger: Logger) -> dict[str, Any]:
    """One step: the ten stages of DESIGN.md's data path, each a function of the records before it."""
    cfg, step = run.cfg, run.step
    t0 = time.perf_counter()
    # 1. prompts, G samples each
    examples = run.sample_prompts()
    group = [ex for ex in examples for _ in range(cfg.rollout.group_size)]
    # 2. roll out
    rb = run.rollout([ex.prompt for ex in group])
    t_gen = time.perf_counter()
    # 3. score
    s = run.score(group, rb)
    # 4-5. old-policy forward (TokenStats), reference log-probs, values and advantages; with one update per
    #      batch it is that update's forward too (not when the counterfactual first takes a vanilla update)
    counterfactual = due(cfg.probe.counterfactual_every, step)
    old = run.old_policy(s, live=run.single_update and not counterfactual)
    # 6. the autopilot sets the knob; the method's rollout-level masks (ClipB, ClipV, high-entropy, grad-mask)
    sel = run.select(s, old)
    rule = run.rule()
    t_fwd = time.perf_counter()
    # 6'. what the probes need from the pre-update state: the parameters for the JVP, and the vanilla update
    #     from this very state (taken, measured, and undone) for the counterfactual
    before = run.params_snapshot() if due(cfg.probe.jvp_every, step) else None
    dh_vanilla = run.vanilla_counterfactual(s, old) if counterfactual else None
    t_cf = time.perf_counter()
    # 7-8. policy_loss and the optimizer updates (Clip-Cov / KL-Cov select per minibatch inside)
    upd = run.update(s, old, sel, rule)
    trained = trained_mask(s, sel, upd)
    t_bwd = time.perf_counter()
    # 9. probe: actual vs predicted entropy change on the same tokens (tabular; the JVP and the
    #    counterfactual every k steps: this update is the method's, so its batch ΔH is dH_method)
    probed = run.probe(s, old, trained)
    probe_m = dict(probed.metrics)
    if before is not None:
        probe_m.update(run.jvp_probe(s, probed, before))
    if counterfactual:
        probe_m.update(counterfactual_metrics(masked_mean(probed.actual, s.mask), dh_vanilla))
    t_probe = time.perf_counter()
    # 10. log (the batch-level control fractions win over the per-minibatch averages of the loss)
    row: dict[str, Any] = {"step": step, **upd.metrics,
                           **batch_metrics(s, old, trained, upd.zeroed, run.tok.eos_token_id),
                           **probe_m, **sel.control,
                           **lens_metrics(s, old, probed, trained, rule, sel, upd, run.rule(run.vanilla))}
    if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.train.max_steps):
        te = time.perf_counter()
        row.update(run.evaluate())
        row["time/eval"] = time.perf_counter() - te
    row.update({"time/generate": t_gen - t0, "time/forward": t_fwd - t_gen, "time/backward": t_bwd - t_cf,
                "time/counterfactual": t_cf - t_fwd, "time/probe": t_probe - t_bwd,
                "time/step": time.perf_counter() - t0,
                "perf/tokens_per_s": int(rb.response_mask.sum()) / max(1e-9, t_probe - t0)})
    log_step(logger, cfg, row, s, old, probed, trained)
    return row


# ----------------------------------------------------------------------------- plumbing


def _export_final(run: Run) -> None:
    """Save the final policy in HF format, atomically (temp folder, then rename)."""
    import shutil
    import tempfile

    final = run.out / "final"
    tmp = Path(tempfile.mkdtemp(prefix=".final_", dir=run.out))
    try:
        run.model.save_pretrained(tmp)
        run.tok.save_pretrained(tmp)
    except Exception as e:  # a full disk: safetensors' and torch's writers hide the OSError
        shutil.rmtree(tmp, ignore_errors=True)
        err = rundir.as_os_error(e, final)
        if err is e:
            raise
        raise err from None
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _install_signal_handlers(run: Run):
    def handler(signum, _frame):
        if run.stop_signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        run.stop_signal = signum

    old = {}
    for s in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError):  # not the main thread
            old[s] = signal.signal(s, handler)
    return old


def _restore_signal_handlers(old) -> None:
    for s, h in old.items():
        signal.signal(s, h)
