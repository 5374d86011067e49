"""TRL integration: ``EntropyControlGRPOTrainer``, a ``trl.GRPOTrainer`` with entropy-rft's statistics,
masks and loss, and ``train_trl``, the ``erft train --engine trl`` entry point.

Thin by design: the maths comes from ``dynamics`` (TokenStats via ``fused_logp``), ``control`` (the method
registry's masks) and ``loss`` (``policy_loss``, ``agg_weights``, ``ppo_clipped_mask``). What this file
adds is only *where* TRL's pipeline gets them:

- ``_get_per_token_logps_and_entropies`` (TRL's per-token log-prob/entropy method) runs the backbone and
  ``dynamics.fused_logp`` in chunks: log-probs with grad and the full TokenStats (H, log p, S, E_p[S], S_c)
  without ever materialising the ``[tokens, V]`` logits. The reference model keeps TRL's own path.
- ``_generate_and_score_completions`` (where TRL computes ``old_per_token_logps``) gets the old-policy
  TokenStats of the whole local generation batch (reusing TRL's old-logp forward when TRL runs one), then
  the rollout-stage masks (ClipB, ClipV, 80/20, grad-mask) over the *global* generation batch: the per-token
  statistics of every process are all-gathered (``integrations.dist``) and the unchanged ``control``
  functions run on the concatenation. Selected once per generation batch, from old-policy statistics.
- ``_compute_loss`` replaces TRL's per-token loss by ``policy_loss`` with those masks. At the start of each
  optimizer step (TRL's gradient-accumulation window) ``control.select_minibatch`` (the one rule of all
  engines) runs over the window's micro-batches of *all* processes: Clip-Cov and KL-Cov select there,
  from the current log-probs (the stored old ones when no update happened since generation, else one
  no-grad forward), with a generator seeded from ``args.seed`` and identical on every rank. Each
  micro-batch loss is re-weighted (``control.microbatch_loss_scale``) so that the accumulated,
  DDP-averaged gradient is exactly that of the window's loss under ``agg`` over the global counted tokens.

What stays per micro-batch: only when an optimizer window spans more than one generation batch (that is
``steps_per_generation * num_iterations`` not a multiple of ``gradient_accumulation_steps``) do Clip-Cov /
KL-Cov select, and the aggregation normalise, per micro-batch (still global over processes); a warning says
so. ``erft train --engine trl`` never configures that case.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from entropy_rft import control, dynamics
from entropy_rft.control import Masks, Method, MinibatchSelection, microbatch_loss_scale, select_minibatch
from entropy_rft.dynamics import TokenStats
from entropy_rft.forward import supports_fused
from entropy_rft.integrations._compat import in_range
from entropy_rft.integrations.dist import all_gather_rows, all_reduce_sum, rank_and_world
from entropy_rft.loss import agg_weights, policy_loss
from entropy_rft.metrics import stats_metrics

# TRL versions this integration was tested with: it overrides private methods of GRPOTrainer, whose
# signatures change between minor releases.
TRL_MIN, TRL_MAX_EXCLUSIVE = (1, 16, 0), (1, 17, 0)

__all__ = [
    "EntropyControlGRPOTrainer",
    "GlobalBatch",
    "check_trl_version",
    "global_loss_scales",
    "global_minibatch_masks",
    "global_minibatch_selection",
    "global_rollout_batch",
    "train_trl",
]


def check_trl_version(version: str) -> None:
    """Raise ImportError unless TRL ``version`` lies in the tested range [TRL_MIN, TRL_MAX_EXCLUSIVE)."""
    if not in_range(version, TRL_MIN, TRL_MAX_EXCLUSIVE):
        lo, hi = ".".join(map(str, TRL_MIN)), ".".join(map(str, TRL_MAX_EXCLUSIVE))
        raise ImportError(
            f"entropy_rft.integrations.trl supports trl>={lo},<{hi} (it overrides GRPOTrainer internals); "
            f"found trl {version}. Install a tested version: pip install 'trl>={lo},<{hi}'"
        )


import trl  # noqa: E402

check_trl_version(trl.__version__)

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

# TRL loss_type -> our aggregation mode (DESIGN.md, "Semantics of policy_loss").
AGG_FOR_LOSS_TYPE = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
                     "dr_grpo": "seq-mean-token-sum-norm"}
# policy_loss metrics that are per micro-batch counts; the trainer logs batch-level ones instead.
_BATCH_LEVEL = ("loss/counted_frac", "loss/zeroed_frac", "tokens/counted")


# ----------------------------------------------------------------------------- the statistics forward


def _cat_stats(parts: list[TokenStats]) -> TokenStats:
    """Concatenate TokenStats along dim 0."""
    names = [f.name for f in dataclasses.fields(TokenStats)]
    return TokenStats(**{n: torch.cat([getattr(p, n) for p in parts]) for n in names})


def _map_stats(st: TokenStats, fn) -> TokenStats:
    return TokenStats(**{f.name: fn(getattr(st, f.name)) for f in dataclasses.fields(TokenStats)})


def fused_policy_out(model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, temperature: float,
                     with_entropy: bool = False) -> dynamics.FusedOut:
    """Log-probs (grad), optional entropy (grad) and TokenStats of the last ``logits_to_keep`` tokens.

    The backbone runs exactly as TRL's fused head runs it (input ids and attention mask, no position ids),
    then ``dynamics.fused_logp`` works in token chunks from the hidden states and the LM-head weight.
    Models whose logits are not ``hidden @ W.T`` (soft-capping, logit scales) take the materialised path.
    """
    targets = input_ids[:, -logits_to_keep:]
    if supports_fused(model):
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = hidden.last_hidden_state[:, -logits_to_keep - 1 : -1]
        head = model.get_output_embeddings()
        return dynamics.fused_logp(hidden, head.weight, targets, temperature, bias=head.bias,
                                   with_entropy=with_entropy)
    logits = model._erft_prev_forward(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -logits_to_keep - 1 : -1]
    stats = dynamics.token_stats(logits.detach(), targets, temperature)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1) if with_entropy else None
    return dynamics.FusedOut(logp, entropy, stats)


def install_stats_forward(model) -> None:
    """Let ``model(..., erft=dict(logits_to_keep=, temperature=, with_entropy=))`` return ``FusedOut``.

    Patched on the instance (as TRL patches its fused head), so that calls through a DDP/FSDP wrapper reach
    it and gradient synchronisation is kept. Without ``erft`` the previous forward runs unchanged.
    """
    if getattr(model, "_erft_prev_forward", None) is not None:
        return
    prev = model.forward
    model._erft_prev_forward = prev

    @functools.wraps(prev)  # keep the signature: ``generate`` validates its kwargs against it
    def forward(*args, erft: dict | None = None, **kwargs):
        if erft is None:
            return prev(*args, **kwargs)
        return fused_policy_out(model, kwargs["input_ids"], kwargs["attention_mask"], **erft)

    model.forward = forward


# ----------------------------------------------------------------------------- global selections


class GlobalBatch(NamedTuple):
    """A generation batch gathered over all processes, and the rollout-stage masks chosen on it."""

    stats: TokenStats  # [N, T] over all ranks
    adv: Tensor  # [N] sequence advantages
    mask: Tensor  # [N, T] bool
    masks: Masks  # global rollout-stage masks (keep, ...), [N, T]
    rows: slice  # this rank's rows


def global_rollout_batch(method: Method, stats: TokenStats, adv: Tensor, mask: Tensor) -> GlobalBatch:
    """All-gather the old-policy TokenStats, advantages and mask, and build the rollout-stage masks on the
    global batch (identical on every rank). ``mask`` must be bool; ``adv`` per sequence ([B])."""
    g_stats = _map_stats(stats, lambda x: all_gather_rows(x.float(), 0.0)[0])
    g_adv, rows = all_gather_rows(adv.float(), 0.0)
    g_mask, _ = all_gather_rows(mask, False)
    masks = method.rollout_masks(g_stats, g_adv, g_mask) if method.stage == "rollout" else Masks()
    return GlobalBatch(g_stats, g_adv, g_mask, masks, rows)


def _local(x: Tensor | None, rows: slice, width: int) -> Tensor | None:
    return None if x is None else x[rows, :width]


def _pad_cols(x: Tensor, width: int, value: float | bool) -> Tensor:
    if x.shape[1] == width:
        return x
    out = torch.full((x.shape[0], width), value, dtype=x.dtype, device=x.device)
    out[:, : x.shape[1]] = x
    return out


def _cat_rows(xs: list[Tensor], value: float | bool) -> Tensor:
    width = max(x.shape[1] for x in xs)
    return torch.cat([_pad_cols(x, width, value) for x in xs])


def _split_rows(x: Tensor | None, like: list[Tensor]) -> list[Tensor | None]:
    if x is None:
        return [None] * len(like)
    out, r = [], 0
    for m in like:
        out.append(x[r : r + m.shape[0], : m.shape[1]])
        r += m.shape[0]
    return out


def global_minibatch_selection(method: Method, cur: list[Tensor] | None, old: list[Tensor], adv: list[Tensor],
                               mask: list[Tensor], keep: list[Tensor | None], loss_kwargs: dict[str, Any],
                               generator: torch.Generator | None) -> list[MinibatchSelection]:
    """``control.select_minibatch`` over one optimizer step's micro-batches of all ranks.

    Each argument lists this rank's micro-batches ([b_j, T_j]; ``adv`` [b_j]; ``keep`` the rollout keep,
    or None). A minibatch-stage method (Clip-Cov, KL-Cov) needs ``cur``: the micro-batches are all-gathered
    (``integrations.dist``) and the rule runs once on the concatenation; any other method selects nothing
    per minibatch, so the rule runs on each local micro-batch as it is. Returns one selection per local
    micro-batch.
    """
    eps = loss_kwargs.get("eps_low"), loss_kwargs.get("eps_high")
    if method.stage != "minibatch":
        return [select_minibatch(None, o, a, m, k, method, *eps, generator) for o, a, m, k in zip(old, adv, mask, keep)]
    g_cur, rows = all_gather_rows(_cat_rows([c.detach().float() for c in cur], 0.0), 0.0)
    g_old, _ = all_gather_rows(_cat_rows([o.float() for o in old], 0.0), 0.0)
    g_mask, _ = all_gather_rows(_cat_rows(mask, False), False)
    g_adv, _ = all_gather_rows(torch.cat([a.float() for a in adv]), 0.0)
    g_keep = None
    if any(k is not None for k in keep):
        g_keep, _ = all_gather_rows(_cat_rows([m if k is None else k for m, k in zip(mask, keep)], False), False)
    sel = select_minibatch(g_cur, g_old, g_adv, g_mask, g_keep, method, *eps, generator)
    width = g_mask.shape[1]

    def split(m: Masks) -> list[Masks]:
        parts = (_split_rows(_local(x, rows, width), mask) for x in (m.keep, m.zeroed, m.kl_cov_select))
        return [Masks(k, z, s) for k, z, s in zip(*parts)]

    counted = _split_rows(_local(sel.counted, rows, width), mask)
    return [MinibatchSelection(m, c, x) for m, c, x in zip(split(sel.masks), counted, split(sel.method))]


def global_minibatch_masks(method: Method, cur: list[Tensor], old: list[Tensor], adv: list[Tensor],
                           mask: list[Tensor], loss_kwargs: dict[str, Any],
                           generator: torch.Generator | None) -> list[Masks]:
    """The method's minibatch-stage masks (Clip-Cov, KL-Cov) over one optimizer step's micro-batches of all
    ranks (``global_minibatch_selection`` without a rollout keep). Returns one ``Masks`` per local
    micro-batch."""
    return [s.method for s in global_minibatch_selection(method, cur, old, adv, mask, [None] * len(mask),
                                                         loss_kwargs, generator)]


def global_loss_scales(counted: list[Tensor], agg: str, width: int | None = None) -> list[float]:
    """Factors c_j such that sum over ranks and micro-batches of c_j·policy_loss_j, averaged over ranks (as
    DDP averages gradients), equals ``aggregate(ℓ, m_global, agg)`` over all counted tokens of the window.

    ``counted[j]`` is micro-batch j's counting mask (mask & keep), at the width it has in ``policy_loss``.
    ``width`` is the common padded length T for ``seq-mean-token-sum-norm`` (Dr.GRPO's constant; default:
    the widest micro-batch). The minibatch-level weights come from ``loss.agg_weights`` on the gathered
    masks; each factor is ``control.microbatch_loss_scale`` times the world size (DDP's average).
    """
    _, world = rank_and_world()
    w = max([width or 0] + [c.shape[1] for c in counted])
    g, rows = all_gather_rows(_cat_rows([_pad_cols(c, w, False) for c in counted], False), False)
    mine = agg_weights(g, agg, torch.float64)[rows]
    scales, r = [], 0
    for c in counted:
        scales.append(microbatch_loss_scale(mine[r : r + c.shape[0]], c, agg) * world)
        r += c.shape[0]
    return scales


def batch_metrics(gb: GlobalBatch, truncated: Tensor | None = None) -> dict[str, float | None]:
    """The native trainer's per-step batch metrics (same names), over the global generation batch."""
    st, m = gb.stats, gb.mask
    adv = gb.adv[:, None].expand_as(m).float() * m
    n_valid = int(m.sum())
    keep = m if gb.masks.keep is None else m & gb.masks.keep
    out = {
        **stats_metrics(st, adv, m),
        "control/rollout_kept_frac": int(keep.sum()) / n_valid if n_valid else None,
        "response/length": float(m.sum(-1).float().mean()) if m.shape[0] else None,
    }
    if truncated is not None:
        out["response/truncated_frac"] = float(truncated.float().mean()) if truncated.numel() else None
    return out


# ----------------------------------------------------------------------------- the trainer


class _Window(NamedTuple):
    start: int
    selections: list[MinibatchSelection]  # per micro-batch: masks with the rollout keep, counted, the method's
    scales: list[float]

    @property
    def masks(self) -> list[Masks]:
        """The method's own minibatch masks per micro-batch (for inspection)."""
        return [s.method for s in self.selections]


class EntropyControlGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose token statistics, masks and loss are entropy-rft's.

    Extra keyword arguments (everything else is GRPOTrainer's):

    - ``method``: a registered method name (``erft methods``) or a built ``control.Method``;
    - ``method_params``: parameters for ``control.build_method`` when ``method`` is a name;
    - ``agg``: loss aggregation (token-mean, seq-mean-token-mean, seq-mean-token-sum-norm); default from
      ``args.loss_type`` (dapo/bnpo: token-mean, grpo: seq-mean-token-mean, dr_grpo: sum-norm);
    - ``dual_clip``: dual-clip constant c > 1, or None.

    The ratio clip is ``args.epsilon`` / ``args.epsilon_high`` unless the method overrides it (clip-higher,
    KL-Cov); the reference KL is ``args.beta`` with the k3 estimator, as TRL. Logs entropy-rft's metric
    names (``entropy/mean``, ``dynamics/*``, ``control/*``, ``loss/*``, ``clip/*``, ``ratio/*``) next to TRL's.
    """

    def __init__(self, *args: Any, method: str | Method = "none", method_params: dict[str, Any] | None = None,
                 agg: str | None = None, dual_clip: float | None = None, **kwargs: Any) -> None:
        if isinstance(method, Method):
            if method_params:
                raise ValueError("pass method_params only with a method name, not with a built Method")
            self.method = method
        else:
            self.method = control.build_method(method, **(method_params or {}))
        super().__init__(*args, **kwargs)
        self._check_supported()
        self.agg = agg or AGG_FOR_LOSS_TYPE[self.loss_type]
        self.loss_kwargs: dict[str, Any] = dict(
            eps_low=self.epsilon_low, eps_high=self.epsilon_high, dual_clip=dual_clip, agg=self.agg,
            ref_kl_coef=float(self.beta), ref_kl_estimator="k3")
        self.loss_kwargs.update(self.method.loss_kwargs())
        self.method_generator = torch.Generator().manual_seed(int(self.args.seed) + 2)
        install_stats_forward(self.model)
        self._erft_captured: tuple[Tensor, TokenStats] | None = None
        self._erft_window: _Window | None = None
        self._erft_acc: dict[str, list[float]] = defaultdict(list)
        self._erft_counts = torch.zeros(3, dtype=torch.float64)  # valid, kept (counted & live), zeroed
        self.last_global_batch: GlobalBatch | None = None  # for inspection and tests
        ga, gen_every = self.args.gradient_accumulation_steps, self.args.steps_per_generation * self.num_iterations
        if gen_every % ga != 0:
            warnings.warn(
                f"steps_per_generation*num_iterations ({gen_every}) is not a multiple of "
                f"gradient_accumulation_steps ({ga}): an optimizer step spans several generation batches, so "
                "Clip-Cov/KL-Cov select and the loss is normalised per micro-batch (still over all processes)",
                stacklevel=2)

    # ------------------------------------------------------------------ configuration checks

    def _check_supported(self) -> None:
        """Reject GRPOConfig options whose loss terms this trainer's ``policy_loss`` does not reproduce."""
        a = self.args
        bad = []
        if self.loss_type not in AGG_FOR_LOSS_TYPE:
            bad.append(f"loss_type={self.loss_type!r} (supported: {sorted(AGG_FOR_LOSS_TYPE)})")
        if self.importance_sampling_level != "token":
            bad.append("importance_sampling_level='sequence'")
        if self.top_entropy_quantile < 1.0:
            bad.append("top_entropy_quantile<1 (use method='high_entropy')")
        if self.off_policy_mask_threshold is not None:
            bad.append("off_policy_mask_threshold")
        if a.delta is not None:
            bad.append("delta (use dual_clip=...)")
        if getattr(a, "entropy_coef", 0.0) or getattr(self, "use_adaptive_entropy", False):
            bad.append("entropy_coef / adaptive entropy (use method='entropy_bonus')")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            bad.append("vllm_importance_sampling_correction=True (set it to False)")
        if getattr(a, "use_bias_correction_kl", False) and self.beta != 0.0:
            bad.append("use_bias_correction_kl")
        if self.aux_loss_enabled:
            bad.append("MoE router aux loss")
        if bad:
            raise ValueError("EntropyControlGRPOTrainer does not support: " + "; ".join(bad))

    # ------------------------------------------------------------------ forward

    def _policy_pass(self, model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
                     batch_size: int | None, with_entropy: bool) -> dynamics.FusedOut:
        """Our statistics forward in row chunks of ``batch_size`` (as TRL chunks its own)."""
        bs = batch_size or input_ids.shape[0]
        outs = []
        for i in range(0, input_ids.shape[0], bs):
            with self.accelerator.autocast():
                outs.append(model(input_ids=input_ids[i : i + bs], attention_mask=attention_mask[i : i + bs],
                                  erft=dict(logits_to_keep=logits_to_keep, temperature=self.temperature,
                                            with_entropy=with_entropy)))
        entropy = torch.cat([o.entropy for o in outs]) if with_entropy else None
        return dynamics.FusedOut(torch.cat([o.logp for o in outs]), entropy, _cat_stats([o.stats for o in outs]))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        """TRL's hook: log-probs and entropies. The policy goes through ``fused_logp`` (full TokenStats);
        the reference model, and multimodal inputs, keep TRL's path."""
        if model is self.ref_model or any(v is not None for v in multimodal.values()) or compute_aux_loss:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        out = self._policy_pass(model, input_ids, attention_mask, logits_to_keep, batch_size, False)
        if not torch.is_grad_enabled():
            self._erft_captured = (out.logp, out.stats)
        return out.logp, (out.stats.entropy if compute_entropy else None), None

    # ------------------------------------------------------------------ generation: old-policy stats

    @staticmethod
    def _loss_mask(inputs: dict[str, Any]) -> Tensor:
        m = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            m = m * inputs["tool_mask"]
        return m.bool()

    def _generate_and_score_completions(self, inputs):
        self._erft_captured = None
        out = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return out
        ids, pm, cm = out["prompt_ids"], out["prompt_mask"], out["completion_mask"]
        captured, old = self._erft_captured, out.get("old_per_token_logps")
        if captured is not None and old is not None and captured[0] is old:
            stats = captured[1]
        else:  # TRL skipped its old-policy forward (on-policy step): run ours, once per generation batch
            with torch.no_grad():
                res = self._policy_pass(self.model, torch.cat([ids, out["completion_ids"]], 1),
                                        torch.cat([pm, cm], 1), out["completion_ids"].shape[1],
                                        self.args.per_device_train_batch_size, False)
            out["old_per_token_logps"], stats = res.logp.detach(), res.stats
        self._erft_captured = None
        mask = self._loss_mask(out)
        gb = global_rollout_batch(self.method, stats, out["advantages"], mask)
        width = mask.shape[1]
        keep = _local(gb.masks.keep, gb.rows, width)
        out["erft_keep"] = mask.clone() if keep is None else keep & mask
        self.last_global_batch = gb
        eos = torch.tensor(self.eos_token_ids, device=mask.device)
        ended = (torch.isin(out["completion_ids"], eos) & mask).any(-1)
        truncated, _ = all_gather_rows(~ended, False)
        metrics = batch_metrics(gb, truncated)
        reward = self._metrics["train"].get("reward")
        metrics["reward/mean"] = reward[-1] if reward else None
        self._record(metrics)
        return out

    # ------------------------------------------------------------------ loss

    def _grad_accum(self) -> int:
        """Micro-batches in the current optimizer step (set by Trainer.train; the config value before)."""
        return getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def _window_inputs(self) -> tuple[int, list[dict[str, Any]]] | None:
        """(window start, micro-batches) of the current optimizer step, when they all come from the current
        generation buffer; None otherwise (then selections fall back to the micro-batch)."""
        ga = self._grad_accum()
        spg = self.args.steps_per_generation
        if (spg * self.num_iterations) % ga != 0 or self._buffered_inputs is None:
            return None
        start = self._step - self._step % ga
        return start, [self._buffered_inputs[(start + i) % spg] for i in range(ga)]

    def _build_window(self, model, start: int, micro: list[dict[str, Any]], cur_here: Tensor | None) -> _Window:
        """Minibatch-stage masks and loss scales of one optimizer step (global over ranks)."""
        masks = [self._loss_mask(m) for m in micro]
        gen_every = self.args.steps_per_generation * self.num_iterations
        cur = None
        if self.method.stage == "minibatch":
            if start % gen_every == 0:  # no update since generation: current log-probs are the old ones
                cur = [m["old_per_token_logps"] for m in micro]
            elif len(micro) == 1 and cur_here is not None:
                cur = [cur_here]
            else:
                with torch.no_grad():
                    cur = [self._policy_pass(model, *self._model_inputs(m), None, False).logp for m in micro]
        sel = global_minibatch_selection(self.method, cur, [m["old_per_token_logps"] for m in micro],
                                         [m["advantages"] for m in micro], masks, [m["erft_keep"] for m in micro],
                                         self.loss_kwargs, self.method_generator)
        counted = [x.counted for x in sel]
        scales = global_loss_scales(counted, self.agg, self.max_completion_length)
        if (start % gen_every) < self.args.steps_per_generation:  # first pass over this generation batch
            mb = [x.masks for x in sel]
            live = [c if x.zeroed is None else c & ~x.zeroed for c, x in zip(counted, mb)]
            zeroed = [torch.zeros_like(c) if x.zeroed is None else x.zeroed & c for c, x in zip(counted, mb)]
            local = torch.tensor([sum(float(k.sum()) for k in masks), sum(float(v.sum()) for v in live),
                                  sum(float(z.sum()) for z in zeroed)], dtype=torch.float64,
                                 device=masks[0].device)
            glob = all_reduce_sum(local).cpu()
            self._erft_counts += glob
            if glob[0] > 0:  # TRL's log: this optimizer step's fractions (metrics.jsonl: the whole batch's)
                self._metrics["train"]["control/kept_frac"].append(float(glob[1] / glob[0]))
                self._metrics["train"]["control/zeroed_frac"].append(float(glob[2] / glob[0]))
        return _Window(start, sel, scales)

    @staticmethod
    def _model_inputs(inputs: dict[str, Any]) -> tuple[Tensor, Tensor, int]:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        return ids, am, inputs["completion_ids"].shape[1]

    def _compute_loss(self, model, inputs):
        """TRL's loss hook, replaced by ``policy_loss`` with the method's masks."""
        mask = self._loss_mask(inputs)
        out = self._policy_pass(model, *self._model_inputs(inputs), None, self.method.needs_entropy_grad())
        training = self.model.training and "erft_keep" in inputs
        masks, scale = Masks(), 1.0  # evaluation: no selection
        if training:  # the window's selection (control.select_minibatch): rollout keep ∧ minibatch masks
            win = self._window_inputs()
            if win is None:  # fallback: this micro-batch is the window (global over ranks)
                w = self._build_window(model, self._step, [inputs], out.logp.detach())
                masks, scale = w.selections[0].masks, w.scales[0] / self._grad_accum()
            else:
                start, micro = win
                if self._erft_window is None or self._erft_window.start != start:
                    self._erft_window = self._build_window(model, start, micro, out.logp.detach())
                j = self._step - start
                masks, scale = self._erft_window.selections[j].masks, self._erft_window.scales[j]
        loss, met = policy_loss(out.logp, inputs["old_per_token_logps"] if "old_per_token_logps" in inputs
                                else out.logp.detach(), inputs["advantages"], mask, keep=masks.keep,
                                zeroed=masks.zeroed, kl_cov_select=masks.kl_cov_select,
                                ref_logp=inputs.get("ref_per_token_logps"), entropy=out.entropy,
                                **self.loss_kwargs)
        self._record({k: v for k, v in met.items() if k not in _BATCH_LEVEL}, mode=None)
        return loss * scale

    # ------------------------------------------------------------------ metrics and state

    def _record(self, metrics: dict[str, float | None], mode: str | None = "train") -> None:
        """Append to TRL's log buffer (undefined values are left out, so TRL's loggers never see a None)
        and to ours (None kept as NaN until ``pop_step_metrics`` turns it back into None)."""
        mode = mode or ("train" if self.model.training else "eval")
        for k, v in metrics.items():
            val = float("nan") if v is None else float(v)
            if v is not None:
                self._metrics[mode][k].append(val)
            if mode == "train":
                self._erft_acc[k].append(val)

    def pop_step_metrics(self) -> dict[str, float | None]:
        """Our metrics since the last call, averaged (NaN-free; None when undefined), as one row."""
        row: dict[str, float | None] = {}
        for k, vals in self._erft_acc.items():
            ok = [v for v in vals if not math.isnan(v)]
            row[k] = sum(ok) / len(ok) if ok else None
        valid, live, zeroed = self._erft_counts.tolist()
        row["control/kept_frac"] = live / valid if valid else None
        row["control/zeroed_frac"] = zeroed / valid if valid else None
        self._erft_acc.clear()
        self._erft_counts.zero_()
        return row

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            state = {"method_generator": self.method_generator.get_state(),
                     "knob": self.method.get_knob() if self.method.knob else None}
            torch.save(state, folder / "erft_state.pt")

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        path = Path(checkpoint) / "erft_state.pt" if checkpoint else None
        if path is not None and path.is_file():
            state = torch.load(path, weights_only=False)
            self.method_generator.set_state(state["method_generator"])
            if state.get("knob") is not None:
                self.method.set_knob(state["knob"])


# ----------------------------------------------------------------------------- erft train --engine trl


def _trl_step_factor(cfg) -> int:
    """TRL optimizer steps per erft step (one rollout batch): minibatches × PPO epochs."""
    return cfg.algo.minibatches * cfg.algo.ppo_epochs


def grpo_config(cfg, out: Path, world: int) -> GRPOConfig:
    """The GRPOConfig equivalent of an erft ``Config`` (one erft step = one generation batch)."""
    from entropy_rft.errors import UserError

    r, a, o, t = cfg.rollout, cfg.algo, cfg.optim, cfg.train
    if a.algorithm == "ppo":
        raise UserError("engine 'trl' runs GRPO / Dr.GRPO only; algo.algorithm 'ppo' needs engine 'native'")
    if a.drop_uniform_groups:
        raise UserError("engine 'trl' does not support algo.drop_uniform_groups; use engine 'native'")
    n_seq = r.prompts_per_step * r.group_size
    per_update = a.minibatches * a.grad_accum * world
    if n_seq % per_update:
        raise UserError(f"engine 'trl': prompts_per_step*group_size ({n_seq}) must be divisible by "
                        f"algo.minibatches*algo.grad_accum*processes ({per_update})")
    k = _trl_step_factor(cfg)
    sched = {"constant": "constant_with_warmup" if o.warmup_steps else "constant", "linear": "linear",
             "cosine": "cosine"}[o.schedule]
    cpu = cfg.model.device == "cpu"
    return GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=cpu, bf16=cfg.model.autocast_bf16 and not cpu,
        per_device_train_batch_size=n_seq // per_update, gradient_accumulation_steps=a.grad_accum,
        steps_per_generation=a.minibatches * a.grad_accum, num_iterations=a.ppo_epochs,
        num_generations=r.group_size, max_completion_length=r.max_new_tokens, temperature=r.temperature,
        top_p=r.top_p, top_k=0, beta=a.ref_kl_coef,
        epsilon=a.eps_low if a.eps_low is not None else 0.2,
        epsilon_high=a.eps_high if a.eps_high is not None else 0.2,
        scale_rewards="group" if a.algorithm == "grpo" else "none", loss_type="dapo",
        learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1], weight_decay=o.weight_decay,
        warmup_steps=o.warmup_steps, lr_scheduler_type=sched,
        max_grad_norm=o.max_grad_norm if o.max_grad_norm is not None else 0.0,
        max_steps=t.max_steps * k, logging_steps=1, save_strategy="steps", save_steps=t.checkpoint_every * k,
        save_total_limit=t.keep_checkpoints, seed=t.seed, data_seed=t.seed,
        report_to=["tensorboard"] if t.tensorboard else [],
        disable_tqdm=not t.progress, disable_dropout=True, dataloader_num_workers=0, log_completions=False,
        # GRPOConfig turns checkpointing on by default; erft's setting decides, as on the native engine.
        gradient_checkpointing=cfg.model.gradient_checkpointing,
    )


def _metrics_callback(trainer: EntropyControlGRPOTrainer, out: Path, k: int):
    """A TrainerCallback writing one metrics.jsonl row per erft step (every ``k`` optimizer steps)."""
    from transformers import TrainerCallback

    from entropy_rft import rundir

    class MetricsJsonl(TrainerCallback):
        def __init__(self) -> None:
            self.writer = rundir.JsonlWriter(out / "metrics.jsonl") if trainer.accelerator.is_main_process else None
            self.trl: dict[str, list[float]] = defaultdict(list)

        def on_log(self, args, state, control, logs=None, **kw):
            for src, dst in (("grad_norm", "optim/grad_norm"), ("learning_rate", "optim/lr"),
                             ("step_time", "time/step")):
                if logs and isinstance(logs.get(src), (int, float)):
                    self.trl[dst].append(float(logs[src]))
            if state.global_step % k or "train_runtime" in (logs or {}):
                return
            row = trainer.pop_step_metrics()
            row.update({d: sum(v) / len(v) for d, v in self.trl.items() if v})
            if "time/step" in row:
                row["time/step"] *= len(self.trl["time/step"])  # TRL's step time is per optimizer step
            self.trl.clear()
            if self.writer is not None:
                self.writer.write({"step": state.global_step // k, **row})

        def on_train_end(self, args, state, control, **kw):
            if self.writer is not None:
                self.writer.close()

    return MetricsJsonl()


def _latest_trl_checkpoint(out: Path) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    d = out / "trl"
    last = get_last_checkpoint(str(d)) if d.is_dir() else None
    return Path(last) if last else None


def prompt_dataset(examples, tokenizer):
    """The ``datasets.Dataset`` TRL trains on: a ``prompt`` column and ``erft_index`` back into ``examples``.

    Chat prompts (math tasks) become conversations when the tokenizer has a chat template, so TRL applies
    the template itself; anything else stays plain text.
    """
    from datasets import Dataset

    from entropy_rft.prompts import ChatPrompt, as_conversation, has_chat_template

    chat = has_chat_template(tokenizer) and all(isinstance(ex.prompt, ChatPrompt) for ex in examples)
    prompts = [as_conversation(ex.prompt) if chat else str(ex.prompt) for ex in examples]
    return Dataset.from_dict({"prompt": prompts, "erft_index": list(range(len(examples)))})


def train_trl(cfg, out: str | Path, resume: bool = False) -> dict[str, Any]:
    """``erft train --engine trl``: train ``cfg`` into run directory ``out`` with EntropyControlGRPOTrainer.

    ``out`` must already be prepared (``launch.start`` refuses to overwrite). Writes ``config.yaml``,
    ``run.json``, ``metrics.jsonl`` (one row per erft step = one generation batch), TRL checkpoints under
    ``out/trl`` and the final policy in ``out/final``. ``resume=True`` continues from the last TRL checkpoint,
    dropping metrics rows after it. Run under ``accelerate launch`` for several processes.
    """
    import sys

    import yaml
    from accelerate import PartialState

    from entropy_rft import rundir
    from entropy_rft.config import config_to_dict
    from entropy_rft.policies import load_policy
    from entropy_rft.tasks import build_task

    out = Path(out)
    state = PartialState()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    k = _trl_step_factor(cfg)
    ckpt = _latest_trl_checkpoint(out) if resume else None
    start = 0
    if ckpt is not None:
        start = int(ckpt.name.split("-")[1]) // k
    if state.is_main_process:
        if resume:
            rundir.truncate_logs(out, start if ckpt is not None else -1)
        else:
            rundir.atomic_write_text(out / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        rundir.write_status(out, "running", engine="trl", start_step=start, max_steps=cfg.train.max_steps,
                            python=sys.version.split()[0], torch=torch.__version__, trl=trl.__version__)
    state.wait_for_everyone()
    task = build_task(cfg.task.name, **cfg.task.params)
    train_set, _ = task.split(cfg.train.seed)
    model, tok = load_policy(cfg.model.name, device="cpu", dtype=getattr(torch, cfg.model.dtype))
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    dataset = prompt_dataset(train_set, tok)

    def task_reward(prompts, completions, erft_index, **_kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(task.reward(c, train_set[i])) for c, i in zip(texts, erft_index)]

    task_reward.__name__ = "task"
    trainer = EntropyControlGRPOTrainer(
        model=model, reward_funcs=task_reward, args=grpo_config(cfg, out, state.num_processes),
        train_dataset=dataset, processing_class=tok, method=cfg.method.name, method_params=cfg.method_params(),
        agg=cfg.algo.agg, dual_clip=cfg.algo.dual_clip)
    trainer.add_callback(_metrics_callback(trainer, out, k))
    trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
    step = trainer.state.global_step // k
    if state.is_main_process:
        final = out / "final"
        trainer.save_model(str(final))
        tok.save_pretrained(str(final))
        rundir.write_status(out, "finished", engine="trl", step=step, max_steps=cfg.train.max_steps)
    state.wait_for_everyone()
    rows = rundir.read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    return rows[-1] if rows else {"step": step}

