"""The stages of a native step (DESIGN.md's data path), one plain function each.

A stage takes the run's state (``state.Run``: the model, the optimizer, the RNGs it advances) and the frozen
records before it, and returns a new frozen record (``records``); none writes into an earlier record.
``trainer.train_step`` calls them in order:

    sample_prompts -> rollout -> score (Scored) -> old_policy (OldPolicy) -> select (Selection)
    -> update (Update) -> probe (Probed); jvp_probe and vanilla_counterfactual every k steps; evaluate

The maths lives in ``core`` (advantages, ``compute_policy_loss``, the value loss, the dynamics) and ``control``
(the methods, the one minibatch selection rule); this module only wires it. The loss's settings are the run's
(``Run.loss``, built once from the config) with the method's own on top, once per update (``loss_rule``); the
metrics of a step's updates stay on the device until ``update`` reads them all in one transfer.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch

from entropy_rft.common.metric_names import eval_prefix, mean_defined
from entropy_rft.control.carriage import checked_masks
from entropy_rft.control.registry import Method
from entropy_rft.control.selection import MinibatchSelection, microbatch_loss_scale, select_minibatch
from entropy_rft.core import advantages as adv_lib
from entropy_rft.core.loss import agg_weights, compute_policy_loss, value_loss
from entropy_rft.core.loss_types import LossInputs, LossOutputs, read_metrics
from entropy_rft.core.metrics import approx_kl, masked_mean
from entropy_rft.core.tensor_checks import broadcast_advantages
from entropy_rft.policy import evaluation
from entropy_rft.policy.forward import PolicyOut, policy_forward
from entropy_rft.policy.jvp import entropy_jvp
from entropy_rft.policy.rollout import RolloutBatch, concat_batches, pad_columns, pad_token, sample
from entropy_rft.tasks.base import Example
from entropy_rft.training.probe import agreement_metrics, probe_metrics, tabular_prediction
from entropy_rft.training.records import OldPolicy, Probed, Rule, Scored, Selection, Update
from entropy_rft.training.state import Run, check_prompts, checkpoint_state, load_checkpoint_state

# ----------------------------------------------------------------------------- config-derived pieces


def loss_rule(run: Run, method: Method | None = None) -> Rule:
    """``method`` (default: the run's) and the loss's settings as they stand now: the run's (``Run.loss``) with the
    method's own at its current knob (coef / eps_high, which the autopilot moves: ``Method.loss_overrides``),
    validated here, once per update."""
    method = method or run.method
    return Rule(method, method.loss_overrides().apply(run.loss))


def autocast(run: Run):
    if run.cfg.model.autocast_bf16:
        return torch.autocast(device_type=run.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward(run: Run, batch: RolloutBatch, *, with_entropy: bool = False) -> PolicyOut:
    with autocast(run):
        return policy_forward(run.model, batch, run.cfg.rollout.temperature, with_entropy=with_entropy,
                              fused=run.cfg.model.fused_logp)


def single_update(run: Run) -> bool:
    """One optimizer update per rollout batch (one minibatch, one epoch, no accumulation, no critic)."""
    a = run.cfg.algo
    return a.minibatches == 1 and a.ppo_epochs == 1 and a.grad_accum == 1 and run.value_head is None


def _rows(m: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if m is None else m[idx]


# ----------------------------------------------------------------------------- stages 1-6


def sample_prompts(run: Run) -> list[Example]:
    """Stage 1: ``rollout.prompts_per_step`` training examples (the data generator), each checked against the
    context."""
    n = run.cfg.rollout.prompts_per_step
    idx = torch.randint(len(run.train_set), (n,), generator=run.gens["data"]).tolist()
    examples = [run.train_set[i] for i in idx]
    check_prompts([ex.prompt for ex in examples], run.tok, run.model, run.cfg.rollout.max_new_tokens,
                  run.fitting_prompts)
    return examples


def rollout(run: Run, prompts: list[str], temperature: float | None = None) -> RolloutBatch:
    """Stage 2: one sampled response per prompt (the sample generator), at ``rollout.temperature`` unless
    ``temperature`` is given."""
    r = run.cfg.rollout
    with autocast(run):
        return sample(run.model, run.tok, prompts, max_new_tokens=r.max_new_tokens,
                      temperature=r.temperature if temperature is None else temperature,
                      top_p=r.top_p, backend=r.backend, generator=run.gens["sample"],
                      cuda_graphs=r.cuda_graphs, check_every=r.check_every)


def score(run: Run, group: list[Example], rb: RolloutBatch) -> Scored:
    """Stage 3: the task's rewards; with ``algo.drop_uniform_groups`` a group whose rewards are all equal
    does not train (GRPO and Dr.GRPO)."""
    cfg = run.cfg
    rewards = torch.tensor(run.task.rewards(rb.responses, group), dtype=torch.float32, device=run.device)
    mask = rb.response_mask.clone()
    if cfg.algo.drop_uniform_groups and cfg.algo.algorithm != "ppo":
        mask &= ~adv_lib.uniform_groups(rewards, cfg.rollout.group_size)[:, None]
    return Scored(group, rb, rewards, mask)


def resample(run: Run, s: Scored) -> Scored:
    """Stage 3': a method that asks for extra rollouts (AEPO, ``Method.resample_plan``) gets the first
    ``prompt_frac`` of the step's prompts rolled out again at its temperature and scored; the rollouts it picks
    (``Method.splice_rows``, from their own group advantages) replace the batch's first rows, with the advantage
    it gives them, while the other rows keep the advantages of the batch before the swap (the released trainer
    computes those first). ``s`` unchanged when the method asks for none or picks none."""
    plan = run.method.resample_plan()
    if plan is None:
        return s
    a, g = run.cfg.algo, run.cfg.rollout.group_size
    n_rows = max(1, int(len(s.group) // g * plan.prompt_frac)) * g
    extra = score(run, s.group[:n_rows], rollout(run, [ex.prompt for ex in s.group[:n_rows]], plan.temperature))
    scale = a.algorithm == "grpo"
    rows, value = run.method.splice_rows(adv_lib.grpo_advantages(extra.rewards, g, eps=a.adv_eps, scale_std=scale))
    n = int(rows.numel())
    if n == 0:
        return s
    own = adv_lib.grpo_advantages(s.rewards, g, eps=a.adv_eps, scale_std=scale)
    rest = torch.arange(n, len(s.group), device=s.rewards.device)
    rb = concat_batches(extra.rollout.select(rows.cpu()), s.rollout.select(rest.cpu()), pad_token(run.tok))
    width = rb.response_ids.shape[1]
    mask = torch.cat([pad_columns(extra.mask[rows], width, False), pad_columns(s.mask[rest], width, False)])
    return Scored([extra.group[i] for i in rows.tolist()] + s.group[n:], rb,
                  torch.cat([extra.rewards[rows], s.rewards[rest]]), mask & rb.response_mask,
                  torch.cat([torch.full((n,), float(value), device=own.device), own[rest]]))


def live_forward(run: Run, s: Scored) -> PolicyOut:
    """The old-policy forward with its graph kept (only with :func:`single_update`): the old policy *is* the
    policy the single update differentiates, so ``old_policy`` reads its numbers and ``update`` reuses its
    graph instead of recomputing the same numbers (PPO's ratio is then exactly 1, as after a recompute). It
    is passed to both; no record holds it."""
    with torch.enable_grad():
        return forward(run, s.rollout, with_entropy=run.method.needs_entropy_grad())


@torch.no_grad()
def old_policy(run: Run, s: Scored, live: PolicyOut | None = None) -> OldPolicy:
    """Stages 4-5: old-policy log-probs and TokenStats for the whole batch (``live``'s when given), reference
    log-probs, values, and the advantages. Every tensor of the record is detached."""
    out = live if live is not None else forward(run, s.rollout)
    values = run.value_head(out.hidden) if run.value_head is not None else None
    ref_logp = None
    if run.ref is not None:
        with autocast(run):
            ref_logp = policy_forward(run.ref, s.rollout, run.cfg.rollout.temperature,
                                      fused=run.cfg.model.fused_logp).logp.detach()
    a = run.cfg.algo
    if s.seq_advantages is not None:  # fixed before a splice (stage 3')
        adv, returns = s.seq_advantages[:, None].expand_as(s.mask).float() * s.mask, None
    else:
        adv, returns = adv_lib.token_advantages(s.rewards, s.mask, values, algorithm=a.algorithm,
                                                group_size=run.cfg.rollout.group_size, adv_eps=a.adv_eps,
                                                gamma=a.gamma, lam=a.lam)
    return OldPolicy(out.logp.detach(), out.stats, adv, returns, ref_logp)


def select(run: Run, s: Scored, old: OldPolicy) -> Selection:
    """Stage 6: the autopilot (entropy target) sets the method's knob from this batch's measured entropy
    (all response tokens), or, with no autopilot, a controller method runs its own law (``Method.observe``,
    on the tokens that train); then the method's rollout-level masks, from the old-policy statistics."""
    if run.autopilot is not None:
        # whether the method, at its knob as set, drops a token of this batch (methods with a knob train with the
        # engine's advantages, so the masks are asked with those)
        def acts() -> bool:
            keep = checked_masks(run.method, run.method.rollout_masks(old.stats, old.adv, s.mask)).keep
            return keep is not None and bool((s.mask & ~keep.bool()).any())

        control_m = run.autopilot.update(run.step, masked_mean(old.stats.entropy, s.rollout.response_mask),
                                         run.autopilot.edge(acts))
    else:
        control_m = run.method.observe(old.stats, s.mask, run.loss.agg)
    own = run.method.rollout_advantages(s.rewards, old.adv, s.mask)  # a method that is its own estimator
    masks = checked_masks(run.method, run.method.rollout_masks(old.stats, old.adv if own is None else own, s.mask))
    shift = masks.adv_shift
    if own is not None:  # the method's advantages enter the loss as a shift of the engine's
        swap = torch.where(s.mask, own - broadcast_advantages(old.adv, s.mask), 0.0)
        shift = swap if shift is None else shift + swap
    return Selection(masks.keep, control_m, shift, masks.weight_select)


# ----------------------------------------------------------------------------- stages 7-8


def minibatches(run: Run, n: int) -> list[torch.Tensor]:
    perm = torch.randperm(n, generator=run.gens["data"])
    return [c for c in perm.chunk(run.cfg.algo.minibatches) if c.numel()]


@dataclass(frozen=True)
class PendingUpdate:
    """One optimizer update's numbers before they leave the device: its micro-batches' loss outputs (no graph),
    the gradient norm (None without clipping), the learning rate, and the critic loss of each micro-batch with its
    rows and the minibatch's (None without a critic)."""

    outs: list[LossOutputs]
    grad_norm: torch.Tensor | None
    lr: float
    value_losses: list[tuple[torch.Tensor, int, int]] | None

    def tensors(self) -> list[torch.Tensor]:
        """Its one-element tensors beside the loss outputs, in the order ``row`` takes their numbers."""
        norm = [] if self.grad_norm is None else [self.grad_norm]
        return norm + [v for v, _, _ in self.value_losses or []]

    def row(self, loss_rows: list[dict[str, Any]], numbers: Any) -> dict[str, Any]:
        """The update's metrics row: the mean of each loss metric over its micro-batches (``loss_rows``), then
        ``optim/grad_norm``, ``optim/lr`` and ``loss/value``, the numbers of ``tensors()`` taken from ``numbers``."""
        row = mean_rows(loss_rows)
        row["optim/grad_norm"] = None if self.grad_norm is None else next(numbers)
        row["optim/lr"] = self.lr
        if self.value_losses is not None:
            row["loss/value"] = weighted_sum([(next(numbers), n, of) for _, n, of in self.value_losses])
        return row


def read_updates(updates: list[PendingUpdate]) -> list[dict[str, Any]]:
    """The metrics rows of a step's optimizer updates, every number read in one device-to-host transfer
    (``core.loss_types.read_metrics``: one host sync for all of the updates' micro-batches)."""
    pending = [o.pending() for u in updates for o in u.outs]
    rows, numbers = read_metrics(pending, [t for u in updates for t in u.tensors()])
    loss_rows, left = iter(rows), iter(numbers)
    return [u.row([next(loss_rows) for _ in u.outs], left) for u in updates]


def update(run: Run, s: Scored, old: OldPolicy, sel: Selection | None = None, rule: Rule | None = None,
           live: PolicyOut | None = None) -> Update:
    """Stages 7-8: PPO epochs × minibatches of optimizer updates with ``rule`` (default: the run's method
    as it stands). Returns the averaged loss metrics (read once, after the last update: ``read_updates``) and
    the tokens a minibatch-level method zeroed. ``live``: the old-policy forward with its graph
    (``live_forward``), used by the first update."""
    rule = rule or loss_rule(run)
    sel = sel or Selection(None, {})
    zeroed = torch.zeros_like(s.mask)  # tokens zeroed by a minibatch-level method (first epoch)
    updates = []
    for epoch in range(run.cfg.algo.ppo_epochs):
        for idx in minibatches(run, s.mask.shape[0]):
            updates.append(update_minibatch(run, s, old, sel, rule, idx, zeroed if epoch == 0 else None, live))
            live = None  # used once
    return Update(mean_rows(read_updates(updates)), zeroed)


def update_minibatch(run: Run, s: Scored, old: OldPolicy, sel: Selection, rule: Rule, idx: torch.Tensor,
                     zeroed: torch.Tensor | None, live: PolicyOut | None) -> PendingUpdate:
    """One optimizer update on the rows ``idx`` (``algo.grad_accum`` micro-batches): select, then for each
    micro-batch forward, loss and backward, then clip and step. Marks the tokens the method zeroed in
    ``zeroed``; returns the update's numbers, still on the device (``PendingUpdate``): nothing is read here."""
    micro = [c for c in torch.arange(len(idx)).chunk(run.cfg.algo.grad_accum) if c.numel()]  # rows of idx
    first, mb = minibatch_selection(run, s, old, sel, rule, idx, live, single=len(micro) == 1)
    if zeroed is not None and mb.masks.zeroed is not None:
        zeroed[idx] |= mb.masks.zeroed & s.mask[idx]
    # with accumulation, the minibatch's aggregation weights, for microbatch_loss_scale
    weights = agg_weights(mb.counted, rule.settings.agg) if len(micro) > 1 else None

    run.optim.zero_grad(set_to_none=True)
    outs, value_losses = [], []
    for local in micro:
        mi = idx[local]
        out = first if first is not None else forward(run, s.rollout.select(mi),
                                                      with_entropy=rule.method.needs_entropy_grad())
        loss, lo, vloss = micro_loss(run, s, old, sel, rule, mb, weights, mi, local, out)
        loss.backward()
        rule.method.observe_update(out.logp.detach(), s.mask[mi])
        outs.append(replace(lo, loss=lo.loss.detach()))  # the metrics' tensors, without the spent graph
        if vloss is not None:
            value_losses.append((vloss.detach(), len(mi), len(idx)))
    grad_norm = None
    if run.cfg.optim.max_grad_norm is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.optim.max_grad_norm)
    run.optim.step()
    run.sched.step()
    if run.value_optim is not None:
        run.value_optim.step()
        run.value_optim.zero_grad(set_to_none=True)
    critic = value_losses if run.value_head is not None else None
    return PendingUpdate(outs, grad_norm, run.sched.get_last_lr()[0], critic)


def minibatch_selection(run: Run, s: Scored, old: OldPolicy, sel: Selection, rule: Rule, idx: torch.Tensor,
                        live: PolicyOut | None, single: bool) -> tuple[PolicyOut | None, MinibatchSelection]:
    """The one selection rule (``control.select_minibatch``) over the minibatch ``idx``: Clip-Cov / KL-Cov select
    over all its rows from their current log-probs. With one micro-batch (``single``) its forward with grad is
    taken here (or ``live``'s rows) and returned for the loss; with accumulation a minibatch-level method
    reads a forward without grad first, and None is returned."""
    first, cur = None, None
    if single:  # one forward with grad; the selection uses its detached log-probs
        first = live.rows(idx) if live is not None else forward(run, s.rollout.select(idx),
                                                                  with_entropy=rule.method.needs_entropy_grad())
        cur = first.logp.detach()
    elif rule.minibatch_masks:
        with torch.no_grad():
            cur = forward(run, s.rollout.select(idx)).logp
    st = rule.settings
    mb = select_minibatch(cur if rule.minibatch_masks else None, old.logp[idx], old.adv[idx], s.mask[idx],
                                  _rows(sel.keep, idx), rule.method, st.eps_low, st.eps_high, run.gens["method"])
    return first, mb


def micro_loss(run: Run, s: Scored, old: OldPolicy, sel: Selection, rule: Rule, mb: MinibatchSelection,
               weights: torch.Tensor | None, mi: torch.Tensor, local: torch.Tensor, out: PolicyOut
               ) -> tuple[torch.Tensor, LossOutputs, torch.Tensor | None]:
    """The loss of the micro-batch ``mi`` (the batch's rows; ``local``: the same rows within the minibatch) from
    its forward ``out``: the policy loss, re-weighted with accumulation (``weights``: the minibatch's aggregation
    weights) so that the summed gradient is the whole minibatch's (``control.microbatch_loss_scale``), plus the
    critic's share. Returns it, the policy loss's outputs and the critic loss (None without one)."""
    a = run.cfg.algo
    m = mb.masks
    # the minibatch's masks at these rows, with the rollout stage's advantage shift and weight selection
    masks = replace(m.map(lambda x: x[local]), adv_shift=_rows(sel.adv_shift, mi),
                    weight_select=_rows(sel.weight_select, mi))
    lo = compute_policy_loss(LossInputs(out.logp, old.logp[mi], old.adv[mi], s.mask[mi], masks,
                                        _rows(old.ref_logp, mi), out.entropy), rule.settings)
    loss = lo.loss
    if weights is not None:  # re-weight so the accumulated gradient equals the whole minibatch's loss
        loss = loss * microbatch_loss_scale(weights[local], mb.counted[local], rule.settings.agg)
    vloss = None
    if run.value_head is not None:
        assert old.returns is not None  # PPO's value targets come with the value head
        vloss = value_loss(run.value_head(out.hidden), old.returns[mi], s.mask[mi])
        loss = loss + a.value_coef * vloss * (len(mi) / len(mb.counted))
    return loss, lo, vloss


def mean_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each key of the first row: the mean of the rows' defined values (``metric_names.mean_defined``, the
    aggregation TRL's rows use too)."""
    return {k: mean_defined(r.get(k) for r in rows) for k in rows[0]}


def weighted_sum(parts: list[tuple[float, int, int]]) -> float:
    """Σ value·rows/total: the critic loss of the micro-batches, each weighted by its share of the minibatch's
    rows."""
    total = 0.0
    for value, rows, of in parts:
        total += value * rows / of
    return total


# ----------------------------------------------------------------------------- stage 9: the probes


@torch.no_grad()
def probe(run: Run, s: Scored, old: OldPolicy, trained: torch.Tensor) -> Probed:
    """Stage 9: entropy after the updates, on the same tokens, against the tabular prediction for the
    tokens that ``trained``."""
    after = forward(run, s.rollout)
    mask = s.mask
    w = agg_weights(trained, run.loss.agg)
    pred = tabular_prediction(old.stats.s_centered, old.adv, w)
    actual = after.stats.entropy - old.stats.entropy
    m = probe_metrics(pred, actual, mask) if run.cfg.probe.enabled else {}
    m["policy/approx_kl"] = approx_kl(after.logp, old.logp, mask)
    return Probed(pred, actual, after.logp, torch.exp((after.logp - old.logp).double()), m)


def params_snapshot(run: Run) -> dict[str, torch.Tensor]:
    """The pre-update parameters, for the JVP probe."""
    return {n: p.detach().clone() for n, p in run.model.named_parameters()}


@torch.no_grad()
def jvp_probe(run: Run, s: Scored, probed: Probed, before: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The network's first-order ΔH per token (∇θH·Δθ by forward-mode AD at the pre-update parameters,
    along the step's actual update) against the actual ΔH that ``probe`` measured on the same tokens."""
    delta = {n: p.detach() - before[n] for n, p in run.model.named_parameters()}
    _, pred = entropy_jvp(run.model, s.rollout, run.cfg.rollout.temperature, before, delta)
    m = agreement_metrics(pred, probed.actual, s.mask, "probe/jvp_")
    m["probe/dH_jvp"] = masked_mean(pred, s.mask)
    return m


def vanilla_counterfactual(run: Run, s: Scored, old: OldPolicy) -> float | None:
    """From this exact state (parameters, optimizer, scheduler, RNGs, knob), take the vanilla update on
    the same records, measure the batch-mean entropy change, then restore the state: training is
    unaffected. The vanilla rule is a value passed to ``update``; nothing of the run is swapped."""
    saved = copy.deepcopy(checkpoint_state(run))
    rule = loss_rule(run, run.vanilla)
    try:
        update(run, s, old, None, rule)
        with torch.no_grad():
            after = forward(run, s.rollout)
        return masked_mean(after.stats.entropy - old.stats.entropy, s.mask)
    finally:
        load_checkpoint_state(run, saved)


# ----------------------------------------------------------------------------- evaluation


def extra_due(cfg_eval: Any, step: int) -> bool:
    """Whether the evaluation at ``step`` also samples at ``eval.extra_temperature``: set (> 0) and ``step`` <=
    ``eval.extra_until_step`` (null: every evaluation)."""
    until = cfg_eval.extra_until_step
    return cfg_eval.extra_temperature > 0 and (until is None or step <= until)


def extra_seed(seed: int, step: int) -> int:
    """The extra temperature's generator seed at ``step``: 63 bits of a hash of (seed, step), apart from the main
    evaluation's ``seed * 1_000_003 + step`` (a CPU generator keeps the low 32 bits of either)."""
    digest = hashlib.sha256(f"erft eval extra temperature {seed} {step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def evaluate(run: Run, note=None) -> dict[str, Any]:
    """Avg@K, Pass@K, Maj@K, distinct correct answers, pass-rate histogram, per-question correct counts and
    entropy on validation (at step 0 also the questions' ids); at ``eval.extra_temperature`` where due
    (``extra_due``) the same under ``eval_t<T>/``; with ``eval.greedy`` greedy pass@1. ``note(text)`` shows its
    progress (the progress bar's).

    Sampling uses its own generator seeded from (seed, step), so evaluation never moves the training RNG; the
    extra temperature's has its own seed (``extra_seed``) and runs after the main evaluation, and greedy decoding
    draws nothing, so neither moves the main evaluation's figures.
    """
    e = run.cfg.eval
    examples = run.val_set[: e.prompts]
    note = note or (lambda text: None)

    def sampled(temperature: float, seed: int, prefix: str, what: str) -> dict[str, Any]:
        gen = torch.Generator(device=run.device).manual_seed(seed)
        with autocast(run):
            out = evaluation.evaluate_policy(
                run.model, run.tok, run.task, examples, n_samples=e.samples,
                temperature=temperature, max_new_tokens=run.cfg.rollout.max_new_tokens, generator=gen,
                batch_size=e.batch_size, prefix=prefix, cuda_graphs=run.cfg.rollout.cuda_graphs,
                check_every=run.cfg.rollout.check_every,
                on_progress=lambda done, total: note(f"step {run.step} {what}: {done}/{total} prompts"))
        for k in ("samples", "seconds"):
            out.pop(prefix + k)
        return out

    out = sampled(e.temperature, run.cfg.train.seed * 1_000_003 + run.step, "eval/", "evaluation")
    if run.step == 0:
        out["eval/question_ids"] = evaluation.question_ids(examples)
    if extra_due(e, run.step):
        out.update(sampled(e.extra_temperature, extra_seed(run.cfg.train.seed, run.step),
                           eval_prefix(e.extra_temperature), f"evaluation at T={e.extra_temperature:g}"))
    if e.greedy:
        note(f"step {run.step} greedy evaluation")
        with autocast(run):
            greedy = evaluation.greedy_correct(
                run.model, run.tok, run.task, examples, max_new_tokens=run.cfg.rollout.max_new_tokens,
                batch_size=e.batch_size, cuda_graphs=run.cfg.rollout.cuda_graphs,
                check_every=run.cfg.rollout.check_every)
        out["eval/greedy_pass@1"] = sum(greedy) / len(greedy)
        out["eval/greedy_correct_per_question"] = greedy
    return out
