"""Stage 10 of a native step: what it reports. The metrics row's batch and lens parts, the samples and the
per-token records written beside it, and the progress bar that shows it. Each is a function of the step's
frozen records (``records``); the trainer only calls them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from entropy_rft import control
from entropy_rft.config import Config
from entropy_rft.loss import ppo_clipped_mask
from entropy_rft.metrics import stats_metrics
from entropy_rft.records import OldPolicy, Probed, Rule, Scored
from entropy_rft.rollout import RolloutBatch
from entropy_rft.rundir import Logger


def batch_metrics(s: Scored, old: OldPolicy, trained: torch.Tensor, zeroed: torch.Tensor,
                  eos_id: int) -> dict[str, Any]:
    m = s.mask
    n_valid = int(m.sum())
    return {
        "reward/mean": float(s.rewards.float().mean()),
        "reward/accuracy": float((s.rewards > 0).float().mean()),
        **stats_metrics(old.stats, old.adv, m),
        "control/kept_frac": int((trained & m).sum()) / n_valid if n_valid else None,
        "control/zeroed_frac": float(zeroed.sum()) / n_valid if n_valid else None,
        "response/length": float(m.sum(-1).float().mean()),
        "response/truncated_frac": truncated_frac(s.rollout, eos_id),
    }


def lens_metrics(s: Scored, old: OldPolicy, probed: Probed, trained: torch.Tensor, rule: Rule) -> dict[str, Any]:
    """Quadrant attribution of the tokens the method kept (``lens/``) and of those PPO's ratio clip left in
    the gradient after the update (``lens_ppo/``)."""
    agg = rule.loss_kwargs["agg"]
    clipped = ppo_clipped_mask(probed.logp, old.logp, old.adv, s.mask, rule.loss_kwargs.get("eps_low"),
                               rule.loss_kwargs.get("eps_high"))
    out = control.lens_attribution(trained, old.adv, old.stats.s_centered, s.mask, agg=agg)
    out.update({k.replace("lens/", "lens_ppo/"): v for k, v in control.lens_attribution(
        ~clipped, old.adv, old.stats.s_centered, s.mask, agg=agg).items()})
    return out


def truncated_frac(rb: RolloutBatch, eos_id: int) -> float:
    """Fraction of responses that ran out of tokens before emitting EOS."""
    ended = (rb.response_ids == eos_id) & rb.response_mask
    return float((~ended.any(-1)).float().mean())


def token_records(s: Scored, old: OldPolicy, probed: Probed, trained: torch.Tensor, step: int, n: int,
                  gen: torch.Generator) -> list[dict]:
    """A random sample of per-token records (S, S_c, A, r, predicted and actual ΔH, kept) for the plots."""
    idx = s.mask.nonzero()
    if idx.shape[0] == 0:
        return []
    pick = idx[torch.randperm(idx.shape[0], generator=gen)[:n]]
    st = old.stats
    return [{"step": step, "seq": b, "pos": t, "entropy": st.entropy[b, t], "logp": st.logp[b, t],
             "s_star": st.s_star[b, t], "s_centered": st.s_centered[b, t], "adv": old.adv[b, t],
             "ratio": probed.ratio[b, t], "pred_dH": probed.pred[b, t], "actual_dH": probed.actual[b, t],
             "kept": bool(trained[b, t])} for b, t in pick.tolist()]


def log_step(logger: Logger, cfg: Config, row: dict[str, Any], s: Scored, old: OldPolicy, probed: Probed,
             trained: torch.Tensor) -> None:
    """Write the step's metrics ``row``, and its samples and token records when they are due."""
    step = row["step"]
    logger.log(row)
    if cfg.train.samples_every and step % cfg.train.samples_every == 0:
        logger.samples.write_many({"step": step, "prompt": ex.prompt, "response": r, "reward": float(rw)}
                                  for ex, r, rw in zip(s.group, s.rollout.responses, s.rewards.tolist()))
    if cfg.probe.records_every and step % cfg.probe.records_every == 0:
        gen = torch.Generator().manual_seed(cfg.train.seed * 7919 + step)
        logger.records.write_many(token_records(s, old, probed, trained, step, cfg.probe.records_per_step, gen))


class _NoBar:
    """What ``progress_bar`` yields with ``train.progress`` off: every call does nothing."""

    def __call__(self, row: dict) -> None:
        pass

    def note(self, text: str) -> None:
        pass


@contextlib.contextmanager
def progress_bar(cfg: Config, start: int):
    """A rich progress bar with reward, entropy and kept fraction. Yields ``bar``: ``bar(row)`` advances one
    step; ``bar.note(text)`` shows ``text`` without advancing (an evaluation's progress)."""
    if not cfg.train.progress:
        yield _NoBar()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    cols = [TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*cols, transient=False) as prog:
        task = prog.add_task("train", total=cfg.train.max_steps, completed=start, info="")

        class Bar(_NoBar):
            def __call__(self, row: dict) -> None:
                fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
                info = (f"reward {fmt(row.get('reward/mean'))}  entropy {fmt(row.get('entropy/mean'))}  "
                        f"kept {fmt(row.get('control/kept_frac'))}")
                if "eval/pass@1" in row:
                    info += f"  val pass@1 {fmt(row['eval/pass@1'])}"
                prog.update(task, advance=1, info=info)

            def note(self, text: str) -> None:
                prog.update(task, info=text)

        yield Bar()
