"""The native engine's loop: single-process GRPO / Dr.GRPO / PPO on CPU or one GPU, with entropy control and
the probes.

Read ``train_step`` top to bottom: each step samples prompts, rolls out, scores, runs the old-policy forward
(TokenStats) and the advantages, lets the autopilot set the method's knob (when an entropy target is set),
builds the method's masks, takes the optimizer updates with ``policy_loss``, probes the entropy change
(tabular every step; the JVP and the counterfactual every k steps) and logs. Each stage is a function of
``stages`` that takes the run's state (``state.Run``) and the frozen records before it (``records``); what a
step reports is ``step_log``'s. ``train`` is the loop over the steps; the run directory's files around it
(resume, run.json's status, SIGTERM/SIGINT) are ``launch.run``'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from entropy_rft.common.errors import UserError
from entropy_rft.core.dynamics import NonFiniteLogits
from entropy_rft.core.metrics import masked_mean
from entropy_rft.rundir import files as rundir
from entropy_rft.rundir.guard import follow_umask
from entropy_rft.rundir.logger import Logger
from entropy_rft.training import stages
from entropy_rft.training.probe import counterfactual_metrics, due
from entropy_rft.training.records import trained_mask
from entropy_rft.training.state import Run, save_checkpoint
from entropy_rft.training.step_log import StepTimer, log_step, progress_bar, step_row
from entropy_rft.training.token_view import native_rows


def train(run: Run, logger: Logger, *, stop: Callable[[], bool] = lambda: False,
          on_step: Callable[[Run, dict], None] | None = None) -> tuple[dict[str, Any], bool]:
    """Take the steps after ``run.step`` up to ``train.max_steps``, logging each and checkpointing every
    ``train.checkpoint_every`` steps and at the last; then save the final policy (``final/``); neither when
    ``train.checkpoints`` is false (the logs are still synced at those steps).

    After each step ``stop()`` may ask to stop: the step's checkpoint is saved and the loop returns. Returns
    the last metrics row and whether the run finished (False: stopped).
    """
    cfg, start = run.cfg, run.step
    last: dict[str, Any] = {}
    with progress_bar(cfg, start) as bar:
        if start == 0 and cfg.eval.every:
            last = {"step": 0, **stages.evaluate(run, bar.note)}
            logger.log(last)
        for step in range(start + 1, cfg.train.max_steps + 1):
            run.step = step
            try:
                last = train_step(run, logger, bar.note)
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
            stopping = stop()
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.max_steps or stopping:
                logger.sync()
                if cfg.train.checkpoints:
                    save_checkpoint(run)
            if stopping:
                return last, False
    if cfg.train.checkpoints:
        export_final(run)
    return last, True


def train_step(run: Run, logger: Logger, note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One step: the ten stages of DESIGN.md's data path, each a function of the records before it.
    ``note(text)`` shows an evaluation's progress."""
    cfg, step = run.cfg, run.step
    timer = StepTimer()
    with timer("generate"):
        # 1. prompts, G samples each; 2. roll out
        examples = stages.sample_prompts(run)
        group = [ex for ex in examples for _ in range(cfg.rollout.group_size)]
        rb = stages.rollout(run, [ex.prompt for ex in group])
    with timer("forward"):
        # 3. score; 3'. a method's extra rollouts at another temperature swapped into the batch (AEPO)
        s = stages.resample(run, stages.score(run, group, rb))
        # 4-5. old-policy forward (TokenStats), reference log-probs, values and advantages; with one update per
        #      batch that forward keeps its graph for the update (not when the counterfactual first takes a
        #      vanilla update): ``live`` goes to both stages, the record holds only detached tensors
        counterfactual = due(cfg.probe.counterfactual_every, step)
        live = stages.live_forward(run, s) if stages.single_update(run) and not counterfactual else None
        old = stages.old_policy(run, s, live)
        # 6. the autopilot sets the knob; the method's rollout-level masks (ClipB, ClipV, high-entropy, grad-mask)
        sel = stages.select(run, s, old)
        rule = stages.loss_rule(run)
    with timer("counterfactual"):
        # 6'. what the probes need from the pre-update state: the parameters for the JVP, and the vanilla update
        #     from this very state (taken, measured, and undone) for the counterfactual
        before = stages.params_snapshot(run) if due(cfg.probe.jvp_every, step) else None
        dh_vanilla = stages.vanilla_counterfactual(run, s, old) if counterfactual else None
    with timer("backward"):
        # 7-8. the loss and the optimizer updates (Clip-Cov / KL-Cov select per minibatch inside)
        upd = stages.update(run, s, old, sel, rule, live)
        del live  # the graph is spent
        trained = trained_mask(s, sel, upd)
    with timer("probe"):
        # 9. probe: actual vs predicted entropy change on the same tokens (tabular; the JVP and the
        #    counterfactual every k steps: this update is the method's, so its batch ΔH is dH_method)
        probed = stages.probe(run, s, old, trained)
        probe_m = dict(probed.metrics)
        if before is not None:
            probe_m.update(stages.jvp_probe(run, s, probed, before))
        if counterfactual:
            probe_m.update(counterfactual_metrics(masked_mean(probed.actual, s.mask), dh_vanilla))
    # 10. log
    row = step_row(step, s, old, sel, rule, stages.loss_rule(run, run.vanilla), upd, probed, trained, probe_m,
                   run.tok.eos_token_id)
    if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.train.max_steps):
        with timer("eval"):
            row.update(stages.evaluate(run, note))
    row.update(timer.metrics(int(rb.response_mask.sum())))
    log_step(logger, cfg, row, s, old, probed, trained)
    if due(cfg.probe.view_every, step):  # the token view: some groups token by token, with the method's marks
        logger.view.write_many(native_rows(step, run.tok, s, old, sel, upd, probed, rule.settings,
                                           cfg.rollout.group_size, cfg.probe.view_groups))
    return row


def export_final(run: Run) -> None:
    """Save the final policy in HF format, atomically (temp folder, then rename)."""
    import shutil
    import tempfile

    final = run.out / "final"
    tmp = Path(tempfile.mkdtemp(prefix=".final_", dir=run.out))
    try:
        follow_umask(tmp, folder=True)  # mkdtemp makes it 0700
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
