"""TRL integration: ``EntropyControlGRPOTrainer``, a ``trl.GRPOTrainer`` with entropy-rft's statistics, masks
and loss. Thin by design: the maths comes from ``dynamics``, ``control`` and ``loss``, the policy forward from
``integrations.stats_forward``, the selections over all processes from ``integrations.window``; this file adds
only *where* TRL's pipeline gets them (docs/trl.md: what each hook does).

A guest in TRL: no module, class or function of TRL is modified (``trl_script`` rebinds ``trl.GRPOTrainer`` for
its run only). The subclass overrides those three hooks and ``_save_checkpoint`` / ``_load_rng_state``
(tests/test_trl_contract.py pins each, with its parameters, against the installed TRL). What the caller asked for is
decided once, before TRL reads a weight, into ``self.plan`` (``trl_support.TrlPlan``): whose loss trains, the
``GRPOConfig`` TRL receives (a composing method's clip and entropy coefficient in a copy of ``args``), the loss's
base settings; the one write into TRL's attributes is ``_apply_knob_to_trl``, for a knob that moves after TRL read its
config. State between the hooks lives in three typed places, each with a visible start and end:

- per row of a generation batch, ``trl_support.RolloutRows`` (the old log-probs and the keep mask) in TRL's own
  ``inputs``, set in ``_generate_and_score_completions``, so TRL's shuffle and split carry them; TRL's own keys are
  set once there too (a drop as the loss mask), and never during a loss (Clip-Cov's zero advantages go into a copy
  that TRL's loss reads);
- per generation batch, ``trl_support.GenerationState`` on the trainer (statistics deferred to the training
  forwards, the optimizer window being trained), made anew with each training generation batch;
- per call of a hook that TRL's forward hook serves, a ``trl_support.HookCall`` made when the hook starts and dropped
  when it returns (``_serving``).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from entropy_rft.common.metric_names import NATIVE_CALL, names_per
from entropy_rft.config.trl import grpo_config
from entropy_rft.control.registry import Method, build_method
from entropy_rft.core import dynamics
from entropy_rft.core.loss import compute_policy_loss
from entropy_rft.core.loss_types import LossInputs, LossOutputs, Masks, PendingMetrics, read_metrics
from entropy_rft.integrations import window
from entropy_rft.integrations._compat import TRL_MAX_EXCLUSIVE, TRL_MIN, check_trl_version  # noqa: F401
from entropy_rft.integrations.stats_forward import (
    captured_hidden,
    chunked_policy_out,
    map_stats,
    stats_from_hidden,
)
from entropy_rft.integrations.trl_logging import record_view
from entropy_rft.integrations.trl_support import (
    AGG_FOR_LOSS_TYPE,
    Capture,
    GenerationState,
    HookCall,
    RolloutRows,
    bound_arguments,
    has_active_dropout,
    loss_mask,
    method_refusal,
    model_config_of,
    model_inputs,
    quiet_pass,
    refusals,
    replace_argument,
    surrogate_settings,
    trl_knobs,
    trl_log_metrics,
    trl_plan,
)
from entropy_rft.integrations.trl_task import prompt_dataset, task_reward_func
from entropy_rft.policy.forward import supports_fused

# grpo_config (trl_settings): re-exported for benchmarks
__all__ = ["EntropyControlGRPOTrainer", "check_trl_version", "grpo_config", "prompt_dataset", "task_reward_func"]


import trl  # noqa: E402

check_trl_version(trl.__version__)

from trl import GRPOTrainer  # noqa: E402

_BATCH_LEVEL = names_per(NATIVE_CALL)  # per-call counts the native engine alone logs (ours: the step's global ones)

# GRPOTrainer's own signature: the subclass reads its arguments by name (``model``, ``args``), however the caller
# passed them (positionally or by keyword, as TRL allows).
_TRL_INIT = inspect.signature(GRPOTrainer.__init__)
if missing := [n for n in ("model", "args") if n not in _TRL_INIT.parameters]:
    raise ImportError(f"trl {trl.__version__}: GRPOTrainer.__init__ has no parameter {missing[0]!r}, which "
                      "EntropyControlGRPOTrainer reads by name")


def _hidden_states(core: Any, on: bool) -> contextlib.AbstractContextManager[list[Tensor]]:
    return captured_hidden(core) if on else contextlib.nullcontext([])  # on: capture; off: nothing


class EntropyControlGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose token statistics, masks and loss are entropy-rft's.

    Extra keyword arguments (everything else is GRPOTrainer's):

    - ``method``: a registered method name (``erft methods``) or a built ``control.Method``;
    - ``method_params``: parameters for ``control.build_method`` when ``method`` is a name;
    - ``agg``: loss aggregation (token-mean, seq-mean-token-mean, seq-mean-token-sum-norm); default from
      ``args.loss_type`` (dapo/bnpo: token-mean, grpo: seq-mean-token-mean, dr_grpo: sum-norm);
    - ``dual_clip``: dual-clip constant c > 1, or None; ``loss_base``: other ``LossSettings`` fields over TRL's
      (erft train's: no clip on a side, the KL estimator); ``trainer.plan`` (``trl_support.trl_plan``) holds what
      they decided;
    - ``dynamics_metrics``: log the generation batch's statistics (``dynamics/*``, ``entropy/mean``, ...;
      default True). False skips the statistics altogether, so a method that needs none of them (``none``,
      ``clip_higher``, ``entropy_bonus``) costs exactly what stock GRPOTrainer costs; other methods refuse it.

    GRPOTrainer's arguments are taken by name, positionally or by keyword as TRL's signature allows; its clip,
    reference KL (k3) and loss type are TRL's unless the method overrides them (``trainer.args``: the values that
    train). Logs entropy-rft's metric names (``entropy/mean``, ``dynamics/*``, ``control/*``, ``loss/*``, ...).
    """

    _entropy_bonus_enabled: bool  # TRL's switch of its entropy term (set in its __init__; see _apply_knob_to_trl)
    token_view: Any = None  # where the token view goes (trl_logging.record_view's sink: erft train's ErftLog)

    def __init__(self, *args: Any, method: str | Method = "none", method_params: dict[str, Any] | None = None,
                 agg: str | None = None, dual_clip: float | None = None, dynamics_metrics: bool = True,
                 loss_base: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if isinstance(method, Method) and method_params:
            raise ValueError("pass method_params only with a method name, not with a built Method")
        self.method = method if isinstance(method, Method) else build_method(method, **(method_params or {}))
        if (refused := method_refusal(self.method)) is not None:  # a built Method skips build_method's own checks
            raise ValueError(refused)
        if not dynamics_metrics and self.method.stage != "static":
            raise ValueError(f"dynamics_metrics=False: method {self.method.name!r} selects tokens from the "
                             f"statistics ({self.method.stage} stage); keep dynamics_metrics=True, or use a "
                             "method without selection (none, clip_higher, entropy_bonus)")
        self.dynamics_metrics = bool(dynamics_metrics)
        named = bound_arguments(_TRL_INIT, args, kwargs)
        grpo_args, model = named.get("args"), named.get("model")
        self.plan = trl_plan(self.method, grpo_args, model, agg, dual_clip, loss_base)
        if bad := refusals(self.method, grpo_args, model_config_of(model), self.plan.delegated):  # before any weight
            raise ValueError("EntropyControlGRPOTrainer does not support: " + "; ".join(bad))
        if self.plan.args is not grpo_args:
            args, kwargs = replace_argument(_TRL_INIT, args, kwargs, "args", self.plan.args)
        self._hook = HookCall()  # the hook call TRL's forward hook serves (_serving); idle between them
        self._generation = GenerationState()  # the plug-in's state of TRL's current generation batch
        self._loss_rows: list[tuple[str, PendingMetrics, Callable[[str], bool]]] = []  # until TRL's log (_defer)
        super().__init__(*args, **kwargs)
        # as TRL settled the model; a delegated loss refuses only TRL's own entropy options beside the method's,
        # checked above on the caller's config (the config TRL holds carries the method's own)
        if not self.delegates and (bad := refusals(self.method, self.args, getattr(self.model, "config", None))):
            raise ValueError("EntropyControlGRPOTrainer does not support: " + "; ".join(bad))
        self.method_generator = torch.Generator().manual_seed(int(self.args.seed) + 2)
        self.step_metrics = window.StepMetrics()  # our metrics row of the current erft step
        ga, gen_every = self.args.gradient_accumulation_steps, self.args.steps_per_generation * self.num_iterations
        if gen_every % ga != 0:
            warnings.warn(f"steps_per_generation*num_iterations ({gen_every}) is not a multiple of "
                          f"gradient_accumulation_steps ({ga}): an optimizer step spans several generation batches, "
                          "so Clip-Cov/KL-Cov select and the loss is normalised per micro-batch (still over all "
                          "processes)", stacklevel=2)

    delegates = property(lambda self: self.plan.delegated, doc="Whether TRL's own loss trains (``TrlPlan``)")
    loss_settings = property(lambda self: self.plan.loss_settings(self.method), doc="The loss's settings now: "
                             "the plan's base with the method's own on top, a knob moved since __init__ included")
    loss_kwargs = property(lambda self: self.loss_settings.kwargs(), doc="``loss_settings`` as keywords, to read")

    def _apply_knob_to_trl(self) -> None:
        """A delegated loss: the method's current clip and entropy coefficient in TRL's attributes where they differ
        (a knob moved after TRL read its config has no other way in; docs/trl.md)."""
        if not self.delegates:
            return
        knobs = trl_knobs(self.method)
        for attr, value in knobs.items():
            if getattr(self, attr) != value:
                setattr(self, attr, value)
        if "entropy_coef" in knobs and not self._entropy_bonus_enabled:
            self._entropy_bonus_enabled = True  # TRL's own rule switches it on only for a configured coef != 0

    @contextlib.contextmanager
    def _serving(self, call: HookCall) -> Iterator[HookCall]:
        """Within the block, TRL's forward hook (``_get_per_token_logps_and_entropies``) serves ``call``."""
        outer, self._hook = self._hook, call
        try:
            yield call
        finally:
            self._hook = outer

    def _policy_stats(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
                      batch_size: int | None, compute_entropy: bool = False, quiet: bool = True
                      ) -> tuple[Tensor, Tensor | None, dynamics.TokenStats]:
        """TRL's log-probs and our TokenStats from one backbone pass (``_stats_pass``); ``quiet``: a pass of ours, out
        of the training's way (``trl_support.quiet_pass``: eval mode, random streams forked)."""
        core = self._core(model)
        with quiet_pass(model) if quiet else contextlib.nullcontext():  # ours: out of the training's way
            return self._stats_pass(model, core, input_ids, attention_mask, logits_to_keep, batch_size,
                                    compute_entropy)

    def _stats_pass(self, model, core, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
                    batch_size: int | None, compute_entropy: bool
                    ) -> tuple[Tensor, Tensor | None, dynamics.TokenStats]:
        """No grad: TRL's own log-probs (and entropies) and our TokenStats from the same backbone pass (one more head
        pass; logits that are not ``hidden @ W.T``: ``chunked_policy_out``'s materialised path)."""
        fused = supports_fused(core)
        with torch.no_grad(), _hidden_states(core, fused) as hidden:
            logp, ent, _ = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy)
            if fused:
                stats = stats_from_hidden(core, torch.cat(hidden), input_ids, logits_to_keep, self.temperature)
            else:
                stats = chunked_policy_out(core, input_ids, attention_mask, logits_to_keep, self.temperature,
                                           False, batch_size, self.accelerator.autocast).stats
        return logp, ent, stats

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        """TRL's hook, TRL's own computation (``none`` trains as stock GRPOTrainer), serving the call of the TRL hook
        it runs in (``_serving``), one job each: ``_old_policy_pass``, ``_training_pass``, else ``_trl_pass``."""
        serve = {Capture.OLD_POLICY_STATS: self._old_policy_pass,
                 Capture.TRAINING_LOGPS: self._training_pass}.get(self._hook.capture, self._trl_pass)
        return serve(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                     compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)

    def _trl_pass(self, model, *args, **kwargs):  # TRL's own computation of the hook, nothing added
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _old_policy_pass(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                         compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's no-grad old-policy pass, which also gives our TokenStats (``_policy_stats``), kept in the hook call
        with its log-probs; another model, grad, an aux loss, multimodal input or dropout: TRL's alone."""
        call = self._hook
        if (model is not self.model or torch.is_grad_enabled() or compute_aux_loss
                or any(v is not None for v in multimodal.values()) or has_active_dropout(model)):
            return self._trl_pass(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                                  compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        logp, ent, call.stats = self._policy_stats(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                   compute_entropy, quiet=False)
        call.logp = logp
        return logp, ent, None

    def _training_pass(self, model, *args, **kwargs):
        """A delegated loss's training forward: the hook call keeps its detached log-probs, and a minibatch selection
        zeroes advantages in the copy TRL's loss reads, before TRL reads them (``_zero_selected``)."""
        out = self._trl_pass(model, *args, **kwargs)
        if (call := self._hook).logp is None:
            call.logp = out[0].detach()
            if call.select is not None:
                self._zero_selected(model, call.select, call.logp)
        return out

    def _record_delegated(self, logp: Tensor, inputs: dict[str, Any]) -> None:
        """Our ``ratio/*`` and ``clip/*`` metrics of a loss TRL computed (method ``none``), from its training
        forward's log-probs: the token-level PPO ratio against the old policy and TRL's clip."""
        old = inputs.get("old_per_token_logps")
        old = logp if old is None else old
        with torch.no_grad():
            out = compute_policy_loss(LossInputs(logp, old, inputs["advantages"], loss_mask(inputs)),
                                      surrogate_settings(self.loss_settings))
        self._defer(out, lambda k: k.startswith(("ratio/", "clip/")))

    def _generate_and_score_completions(self, inputs):
        call = HookCall(Capture.OLD_POLICY_STATS if self.dynamics_metrics else Capture.NOTHING)
        with self._serving(call):
            out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out
        self._generation = GenerationState()
        mask, old = loss_mask(out), out.get("old_per_token_logps")
        if not self.dynamics_metrics:  # a static method, no statistics: nothing beyond stock TRL's work
            # static methods select nothing per minibatch, so select_minibatch never reads these log-probs
            RolloutRows(torch.zeros(mask.shape, device=mask.device) if old is None else old, mask.clone()).put(out)
            return out
        if old is not None and call.logp is old and call.stats is not None:  # TRL's old-policy pass gave them
            stats = call.stats
        elif self._defers_stats(old):  # on-policy: the statistics come from TRL's training forward
            RolloutRows(torch.zeros(mask.shape, device=mask.device), mask.clone()).put(out)
            self._generation = GenerationState(True, [None] * self.args.steps_per_generation)
            return out
        else:  # TRL skipped its old-policy forward (on-policy step), or ran it with dropout: ours, once per
            # generation batch, in eval mode with the random streams forked (trl_support.quiet_pass); TRL's loss
            # keeps its own old-policy log-probs (absent on-policy: logp.detach())
            own, _, stats = self._policy_stats(self.model, *model_inputs(out),
                                               self.args.per_device_train_batch_size)
            old = own if old is None else old
        # old: what the selections compare against (Clip-Cov, KL-Cov)
        RolloutRows(old, self._record_batch(stats, out["advantages"], mask, out["completion_ids"],
                                            out["prompt_ids"])).put(out)
        if self.delegates and self.method.stage == "rollout":
            self._compose_keep(out)
        return out

    def _record_batch(self, stats: dynamics.TokenStats, adv: Tensor, mask: Tensor, completion_ids: Tensor,
                      prompt_ids: Tensor) -> Tensor:
        """A generation batch's rollout-stage selection (over all processes), its batch metrics and its token view
        (``trl_logging.record_view``); returns the local keep mask."""
        gb = window.global_rollout_batch(self.method, stats, adv, mask)
        ended = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=mask.device)) & mask
        metrics = window.global_batch_metrics(gb, ~ended.any(-1))
        reward = self._metrics["train"].get("reward")
        metrics["reward/mean"] = reward[-1] if reward else None
        self._record(metrics)
        keep = gb.local_keep(mask)
        record_view(self.token_view, self.processing_class, self.num_generations, stats, adv, mask, keep,
                    completion_ids, prompt_ids)
        return keep

    def _defers_stats(self, old: Tensor | None) -> bool:
        """Whether this generation batch's statistics come from TRL's own training forward (``_deferred_part``)
        instead of a forward of ours: TRL ran no old-policy forward (on-policy: each micro-batch trains once,
        before any update), the method selects nothing, the loss is TRL's, and the head is ``hidden @ W.T``
        with no dropout to add noise. Then the plug-in costs one no-grad head pass per micro-batch."""
        core = self._core(self.model)
        return (old is None and self.delegates and self.method.stage == "static" and supports_fused(core)
                and not has_active_dropout(self.model))

    def _core(self, model) -> Any:
        """The plain transformers model under accelerate's and peft's wrappers."""
        core = self.accelerator.unwrap_model(model)
        return core.get_base_model() if hasattr(core, "get_base_model") else core

    def _deferred_part(self, core, inputs: dict[str, Any], hidden: Tensor) -> None:
        """One micro-batch's statistics from the hidden states of TRL's training forward, kept in the generation
        batch's ``GenerationState`` at its place in the buffer; the generation batch's metrics once its last
        micro-batch has trained (``_record_batch`` on the parts joined, in the buffer's order, which is the order they
        trained in: on-policy, each trains once)."""
        ids, _, keep = model_inputs(inputs)
        state, parts = self._generation, self._buffered_inputs
        state.parts[self._step % self.args.steps_per_generation] = stats_from_hidden(core, hidden, ids, keep,
                                                                                     self.temperature)
        if all(part is not None for part in state.parts):
            stats = map_stats(lambda *x: torch.cat(x), *cast(list[dynamics.TokenStats], state.parts))
            state.parts = [None] * len(state.parts)
            self._record_batch(stats, torch.cat([p["advantages"] for p in parts]),
                               torch.cat([loss_mask(p) for p in parts]),
                               torch.cat([p["completion_ids"] for p in parts]),
                               torch.cat([p["prompt_ids"] for p in parts]))

    def _compose_keep(self, out: dict[str, Any]) -> None:
        """The rollout-stage drops in TRL's own loss inputs (``trl_support.composes_with_trl``): the kept tokens
        are the loss mask (``tool_mask``; the attention mask stays ``completion_mask``) and the normaliser of the
        dapo/cispo/vespo losses counts them over all processes, as TRL counts its loss mask."""
        keep = RolloutRows.on(out).keep
        kept, valid = self.accelerator.reduce(torch.stack([keep.sum(), loss_mask(out).sum()]).float(), "sum")
        self._record(window.kept_fractions(torch.tensor([float(valid), float(kept), 0.0])), ours=False)
        out["tool_mask"] = keep.to(out["completion_mask"].dtype)
        out["num_items_in_batch"] = self.accelerator.gather(keep.sum()).sum()

    def _grad_accum(self) -> int:
        """Micro-batches in the current optimizer step (set by Trainer.train; the config value before)."""
        return getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def _window_inputs(self) -> tuple[int, list[dict[str, Any]]] | None:
        """(window start, micro-batches) of the current optimizer step, when they all come from the current
        generation buffer; None otherwise (then selections fall back to the micro-batch)."""
        ga, spg = self._grad_accum(), self.args.steps_per_generation
        if (spg * self.num_iterations) % ga != 0 or self._buffered_inputs is None:
            return None
        start = self._step - self._step % ga
        return start, [self._buffered_inputs[(start + i) % spg] for i in range(ga)]

    def _build_window(self, model, start: int, micro: list[dict[str, Any]], cur_here: Tensor | None) -> window.Window:
        """Minibatch-stage masks and loss scales of one optimizer step (global over ranks)."""
        masks, rows, cur = [loss_mask(m) for m in micro], [RolloutRows.on(m) for m in micro], None
        gen_every = self.args.steps_per_generation * self.num_iterations
        if self.method.stage == "minibatch":
            if start % gen_every == 0:  # no update since generation: current log-probs are the old ones
                cur = [r.old_logps for r in rows]
            elif len(micro) == 1 and cur_here is not None:
                cur = [cur_here]
            else:
                with torch.no_grad(), quiet_pass(model):
                    cur = [self._trl_pass(model, *model_inputs(m))[0] for m in micro]
        win = window.select_window(start, self.method, cur, [r.old_logps for r in rows],
                                   [m["advantages"] for m in micro], masks, [r.keep for r in rows],
                                   self.loss_settings, self.method_generator, self.max_completion_length)
        if (start % gen_every) < self.args.steps_per_generation:  # first pass over this generation batch
            # TRL's log: this optimizer step's fractions (metrics.jsonl: the whole generation batch's)
            self._record(window.kept_fractions(self.step_metrics.count(masks, win)), ours=False)
        return win

    def _compute_loss(self, model, inputs):
        """TRL's loss hook. Method ``none`` and the methods that compose with TRL's loss (drops as its loss mask,
        Clip-Cov as zero advantages, a clip as its epsilons, the entropy bonus as its ``entropy_coef``:
        ``trl_support.composes_with_trl``): TRL's own ``_compute_loss`` (every loss type, level and option as
        stock), and our ratio/clip metrics from its training forward. Other methods: TRL's training forward
        (log-probs and entropies, as stock computes them), then ``compute_policy_loss`` with the method's masks and
        ``loss_settings`` (its metrics read in one transfer), and TRL's own log keys (``_record_trl_metrics``)."""
        if self.delegates:
            return self._compute_trl_loss(model, inputs)
        mask = loss_mask(inputs)
        logp, entropies, _ = self._get_per_token_logps_and_entropies(model, *model_inputs(inputs),
                                                                     compute_entropy=True)
        masks, scale = self._selection(model, inputs, logp.detach())
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old  # as TRL: absent on-policy and in evaluation
        ref = inputs.get("ref_per_token_logps")
        loss_in = LossInputs(logp, old, inputs["advantages"], mask, masks, ref,
                             entropies if self.method.needs_entropy_grad() else None)  # the bonus's, with its grad
        out = compute_policy_loss(loss_in, self.loss_settings)
        self._defer(out, lambda k: k not in _BATCH_LEVEL)
        self._record_trl_metrics(logp.detach(), old, inputs["advantages"], inputs, entropies.detach(), ref)
        return out.loss * scale

    def _compute_trl_loss(self, model, inputs):
        """TRL's own ``_compute_loss`` with the method composed into its inputs, and the method's current clip and
        entropy coefficient (``_apply_knob_to_trl``). A minibatch-stage selection (Clip-Cov) is made from TRL's
        own training forward (``_get_per_token_logps_and_entropies`` calls ``_zero_selected`` before TRL reads
        the advantages) and goes into a copy of the micro-batch that TRL's loss reads: TRL's buffered micro-batch,
        which it reuses for its next iterations, stays as TRL made it."""
        self._apply_knob_to_trl()
        training = self.model.training and RolloutRows.of(inputs) is not None
        view = dict(inputs)  # TRL's loss reads this one; the selected tokens' zero advantages are written here
        call = HookCall(Capture.TRAINING_LOGPS, select=view if training and self.method.stage == "minibatch" else None)
        defer = training and self._generation.stats_from_training
        core = self._core(model) if defer else None
        with self._serving(call), _hidden_states(core, defer) as hidden:
            loss = super()._compute_loss(model, view)
        if defer:
            self._deferred_part(core, inputs, torch.cat(hidden))
        if call.logp is not None and self.loss_type in AGG_FOR_LOSS_TYPE:
            self._record_delegated(call.logp, inputs)
        return loss

    def _zero_selected(self, model, inputs: dict[str, Any], logp: Tensor) -> None:
        """Clip-Cov in TRL's loss: the selected tokens get advantage 0 (per-token advantages, (B, T)), written into
        ``inputs``, the copy of the micro-batch that TRL's loss reads (``_compute_trl_loss``)."""
        masks, _ = self._selection(model, inputs, logp)
        if masks.zeroed is None:
            return
        adv = inputs["advantages"]
        adv = (adv[:, None] if adv.dim() == 1 else adv).expand(masks.zeroed.shape)
        inputs["advantages"] = torch.where(masks.zeroed, torch.zeros_like(adv), adv)

    def _selection(self, model, inputs: dict[str, Any], logp: Tensor) -> tuple[Masks, float]:
        """This micro-batch's masks and loss scale from its optimizer window's selection (rollout keep ∧
        minibatch selection, global over ranks); no selection in evaluation. ``logp``: the training forward's
        detached log-probs, the current policy's when the window is this micro-batch alone."""
        if not (self.model.training and RolloutRows.of(inputs) is not None):
            return Masks(), 1.0
        win = self._window_inputs()
        if win is None:  # fallback: this micro-batch is the window (global over ranks)
            w = self._build_window(model, self._step, [inputs], logp)
            return w.selections[0].masks, w.scales[0] / self._grad_accum()
        start, micro = win  # inputs is micro[self._step - start]
        built = self._generation.window
        if built is None or built.start != start:  # the window's first micro-batch (in this pass over the buffer)
            built = self._generation.window = self._build_window(model, start, micro, logp)
        j = self._step - start
        return built.selections[j].masks, built.scales[j]

    def _record_trl_metrics(self, logp: Tensor, old: Tensor, adv: Tensor, inputs: dict[str, Any], entropies: Tensor,
                            ref: Tensor | None) -> None:
        """TRL's own log keys with TRL's definitions (``trl_support.trl_log_metrics``), so a stock dashboard keeps
        working whatever clip the method trains with (ours: ``clip/*``)."""
        mask = inputs["completion_mask"]
        mask = mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]
        kl_coef = self.beta if ref is not None else 0.0
        out = trl_log_metrics(logp, old, adv, mask, entropies, ref, kl_coef, bool(self.args.use_bias_correction_kl),
                              self.epsilon_low, self.epsilon_high, self.accelerator)
        self._record(out, mode="train" if self.model.training else "eval", ours=False)

    def _defer(self, out: LossOutputs, keep: Callable[[str], bool]) -> None:
        """One loss call's metrics (those ``keep`` names), left on the device until TRL's ``log`` reads its buffer."""
        self._loss_rows.append(("train" if self.model.training else "eval", out.pending(), keep))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's ``log``, once the loss calls' metrics since the last one are read, all in one host transfer
        (``read_metrics``), into TRL's buffer and this step's row in the order the calls were made."""
        pending, self._loss_rows = self._loss_rows, []
        for (mode, _, keep), row in zip(pending, read_metrics([p for _, p, _ in pending])[0] if pending else []):
            self._record({k: v for k, v in row.items() if keep(k)}, mode=mode)
        super().log(logs, start_time)

    def _record(self, metrics: Mapping[str, float | None], mode: str | None = "train", ours: bool = True) -> None:
        """Append to TRL's log buffer (a None left out) and, in training and when ``ours``, to ``step_metrics``."""
        mode = mode or ("train" if self.model.training else "eval")
        for k, v in metrics.items():
            if v is not None:
                self._metrics[mode][k].append(float(v))
        if mode == "train" and ours:
            self.step_metrics.add(metrics)

    def _save_checkpoint(self, model, trial):
        # Before transformers' files: its trainer_state.json, written last, marks the folder complete
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            state = {"method_generator": self.method_generator.get_state(),
                     "knob": self.method.get_knob() if self.method.knob else None}
            torch.save(state, folder / "erft_state.pt")
        super()._save_checkpoint(model, trial)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        path = Path(checkpoint) / "erft_state.pt" if checkpoint else None
        if path is not None and path.is_file():
            state = torch.load(path, weights_only=True)  # a generator state and a float
            self.method_generator.set_state(state["method_generator"])
            if state.get("knob") is not None:
                self.method.set_knob(state["knob"])
