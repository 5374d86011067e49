"""Stage 10 of a native step: what it reports. The metrics row's batch and lens parts, the samples and the
per-token records written beside it, and the progress bar that shows it (with no terminal: one plain line
per step, ``train.log_every``). Each is a function of the step's frozen records (``records``); the trainer only
calls them. ``prompt_progress`` is the same progress over prompts for ``erft eval`` and ``erft filter``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from entropy_rft.config.schema import Config
from entropy_rft.control.lens import lens_attribution, loss_gradient, weight_lens
from entropy_rft.core.loss import ppo_clipped_mask
from entropy_rft.core.loss_types import LossInputs, LossSettings, Masks
from entropy_rft.core.metrics import stats_metrics
from entropy_rft.policy.rollout import RolloutBatch
from entropy_rft.rundir.logger import Logger
from entropy_rft.training.records import OldPolicy, Probed, Rule, Scored, Selection, Update


class StepTimer:
    """Wall time of a step's phases: ``with timer("generate"): ...`` adds the block's seconds to that phase;
    ``metrics(tokens)`` gives ``time/<phase>``, ``time/step`` (since the timer was made) and
    ``perf/tokens_per_s`` (response tokens over the five training phases, evaluation left out) and
    ``perf/peak_memory_gb`` (:func:`peak_memory_gb`)."""

    PHASES = ("generate", "forward", "backward", "counterfactual", "probe")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def metrics(self, tokens: int) -> dict[str, float]:
        out = {"time/eval": self.seconds["eval"]} if "eval" in self.seconds else {}
        out.update({f"time/{k}": self.seconds.get(k, 0.0) for k in self.PHASES})
        out["time/step"] = time.perf_counter() - self.start
        out["perf/tokens_per_s"] = tokens / max(1e-9, sum(self.seconds.get(k, 0.0) for k in self.PHASES))
        out["perf/peak_memory_gb"] = peak_memory_gb()
        return out


def peak_memory_gb() -> float:
    """This process's peak memory so far, in GiB: on a GPU the CUDA caching allocator's peak reservation
    (``torch.cuda.max_memory_reserved``, as verl's ``perf/max_memory_reserved_gb``; the CUDA context is not in
    it), else the peak resident set (``getrusage``'s ``ru_maxrss``: KiB on Linux, bytes on macOS). What a lease's
    wave reads to know how many runs the device's memory holds (benchmarks/gpu/realm_wave.py)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved() / 2**30
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def step_row(step: int, s: Scored, old: OldPolicy, sel: Selection, rule: Rule, vanilla: Rule, upd: Update,
             probed: Probed, trained: torch.Tensor, probe_m: dict[str, Any], eos_id: int) -> dict[str, Any]:
    """The step's metrics row: the update's loss metrics (each the mean over the step's loss calls: the metric
    table's aggregation column), then the batch's, the probes', the controller's and the lens's; each key from one
    of them (``one_source``)."""
    lens = lens_metrics(s, old, probed, trained, rule, sel, upd, vanilla)
    return one_source({"step": {"step": step}, "update": upd.metrics,
                       "batch": batch_metrics(s, old, trained, upd.zeroed, eos_id), "probes": probe_m,
                       "controller": sel.control, "lens": lens})


def one_source(parts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The union of a row's parts, in their order; a key two parts write is a bug of the engine (one metric, one
    source: which would win is not a meaning), raised naming both."""
    row: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, part in parts.items():
        if twice := sorted(source.keys() & part.keys()):
            raise RuntimeError(f"metric {twice[0]!r} is written by both the {source[twice[0]]} and the {name} part of "
                               "the step's row")
        row.update(part)
        source.update(dict.fromkeys(part, name))
    return row


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


def lens_metrics(s: Scored, old: OldPolicy, probed: Probed, trained: torch.Tensor, rule: Rule,
                 sel: Selection | None = None, upd: Update | None = None,
                 vanilla: Rule | None = None) -> dict[str, Any]:
    """Quadrant attribution of the tokens the method kept (``lens/``) and of those PPO's ratio clip left in
    the gradient after the update (``lens_ppo/``); with ``sel``, ``upd`` and the ``vanilla`` rule, the first-order
    ΔH of the method's change in token weights (``lensw/``, ``weight_lens_metrics``)."""
    agg = rule.settings.agg
    clipped = ppo_clipped_mask(probed.logp, old.logp, old.adv, s.mask, rule.settings.eps_low, rule.settings.eps_high)
    out = lens_attribution(trained, old.adv, old.stats.s_centered, s.mask, agg=agg)
    out.update({k.replace("lens/", "lens_ppo/"): v for k, v in lens_attribution(
        ~clipped, old.adv, old.stats.s_centered, s.mask, agg=agg).items()})
    if sel is not None and upd is not None and vanilla is not None:
        out.update(weight_lens_metrics(s, old, probed, rule, sel, upd, vanilla))
    return out


def token_weight_settings(settings: LossSettings) -> LossSettings:
    """``settings`` without the terms whose gradient does not flow through the sampled token's log-prob (not token
    weights): the entropy bonus, the reference KL and KL-Cov's pull, at their defaults."""
    return replace(settings, entropy_coef=0.0, ref_kl_coef=0.0, ref_kl_estimator="k3", kl_cov_coef=0.0)


def weight_lens_metrics(s: Scored, old: OldPolicy, probed: Probed, rule: Rule, sel: Selection, upd: Update,
                        vanilla: Rule) -> dict[str, Any]:
    """``control.weight_lens`` of the step: the gradient coefficients of the method's loss (its rollout masks,
    the tokens it zeroed, its loss settings) against the vanilla loss's, on the whole batch at the update's end
    point (the ratios ``probed.ratio``, as ``lens_ppo/``: where a clip binds), over the tokens that train.
    Not token weights and so not in it: the entropy bonus (gradient through H), the reference KL (the same in
    both) and KL-Cov's |log-ratio| pull (selected per minibatch)."""
    masks = Masks(keep=sel.keep, zeroed=upd.zeroed, adv_shift=sel.adv_shift, weight_select=sel.weight_select)
    g_m = loss_gradient(LossInputs(probed.logp, old.logp, old.adv, s.mask, masks),
                                token_weight_settings(rule.settings))
    g_v = loss_gradient(LossInputs(probed.logp, old.logp, old.adv, s.mask),
                                token_weight_settings(vanilla.settings))
    return weight_lens(g_m, g_v, old.adv, old.stats.s_centered, s.mask)


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
        logger.samples.write_many(sample_rows(step, s.group, s.rollout.responses, s.rewards.tolist()))
    if cfg.probe.records_every and step % cfg.probe.records_every == 0:
        gen = torch.Generator().manual_seed(cfg.train.seed * 7919 + step)
        logger.records.write_many(token_records(s, old, probed, trained, step, cfg.probe.records_per_step, gen))


class _NoBar:
    """What ``progress_bar`` yields with ``train.progress`` off: every call does nothing."""

    def __call__(self, row: dict) -> None:
        pass

    def note(self, text: str) -> None:
        pass


def is_live() -> bool:
    """Whether stdout is a live terminal (or a notebook) that can redraw a progress bar. False under nohup,
    SLURM, a pipe or a captured test; rich's rule, so FORCE_TERMINAL and TTY_COMPATIBLE are honoured."""
    from rich.console import Console

    console = Console()
    return console.is_terminal or console.is_jupyter


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}"


def step_info(row: dict) -> str:
    """``reward 0.938  entropy 0.108  kept 1.000`` (and ``val pass@1 ...`` on a step with an evaluation)."""
    info = (f"reward {_fmt(row.get('reward/mean'))}  entropy {_fmt(row.get('entropy/mean'))}  "
            f"kept {_fmt(row.get('control/kept_frac'))}")
    if "eval/pass@1" in row:
        info += f"  val pass@1 {_fmt(row['eval/pass@1'])}"
    return info


def step_line(row: dict, max_steps: int) -> str:
    """One plain line for a step: ``step 12/30  reward 0.938  entropy 0.108  kept 1.000  29.3 s/step``."""
    line = f"step {row['step']}/{max_steps}  {step_info(row)}"
    t = row.get("time/step")
    if t is not None:
        line += f"  {t:.1f} s/step" if t >= 1 else f"  {t:.2f} s/step"
    return line


class StepLines(_NoBar):
    """The progress with no terminal: one line per step on stdout, every ``every`` steps (and always the first
    step this process runs and the last step), and each evaluation note as a line; ``every`` 0: nothing."""

    def __init__(self, max_steps: int, every: int, start: int = 0, file: Any = None):
        self.max_steps, self.every, self.first, self.file = max_steps, every, start + 1, file

    def _print(self, text: str) -> None:
        print(text, file=self.file if self.file is not None else sys.stdout, flush=True)

    def __call__(self, row: dict) -> None:
        step = int(row["step"])
        if self.every > 0 and (step % self.every == 0 or step in (self.first, self.max_steps)):
            self._print(step_line(row, self.max_steps))

    def note(self, text: str) -> None:
        if self.every > 0:
            self._print(text)


def sample_rows(step: int, examples: list, responses: list[str], rewards: list[float]) -> list[dict]:
    """samples.jsonl rows, the same on both engines: step, prompt, response, reward and the gold answer (as
    JSON when it is a plain value, else its text), so a reward can be audited from the file."""
    def plain(x):
        return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)

    return [{"step": step, "prompt": ex.prompt, "response": r, "reward": float(rw), "answer": plain(ex.answer)}
            for ex, r, rw in zip(examples, responses, rewards)]


@contextlib.contextmanager
def progress_bar(cfg: Config, start: int):
    """A rich progress bar with reward, entropy and kept fraction. Yields ``bar``: ``bar(row)`` advances one
    step; ``bar.note(text)`` shows ``text`` without advancing (an evaluation's progress). With no terminal
    (``is_live``), plain lines instead (``StepLines``, every ``train.log_every`` steps)."""
    if not cfg.train.progress:
        yield _NoBar()
        return
    if not is_live():
        yield StepLines(cfg.train.max_steps, cfg.train.log_every, start)
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
                prog.update(task, advance=1, info=step_info(row))

            def note(self, text: str) -> None:
                prog.update(task, info=text)

        yield Bar()


@contextlib.contextmanager
def prompt_progress(label: str, total: int, unit: str = "prompts") -> Iterator[Callable[[int, int], None]]:
    """Progress over the prompts of an evaluation or a filter (``erft eval``, ``erft filter``). Yields
    ``on_progress(done, total)`` (``evaluation.evaluate_policy``'s callback): a transient rich bar on a
    terminal; with none, one line per call, ``label: done/total prompts  12 s``."""
    if not is_live():
        t0 = time.perf_counter()

        def line(done: int, n: int) -> None:
            print(f"{label}: {done}/{n} {unit}  {time.perf_counter() - t0:.0f} s", flush=True)

        yield line
        return
    from rich import progress as rp

    with rp.Progress(rp.TextColumn(label, markup=False), rp.BarColumn(), rp.MofNCompleteColumn(), rp.TextColumn(unit),
                     rp.TimeElapsedColumn(), rp.TimeRemainingColumn(), transient=True) as prog:
        bar = prog.add_task(label, total=total)
        yield lambda done, n: prog.update(bar, completed=done, total=n)
