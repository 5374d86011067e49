"""What ``erft train --engine trl`` logs, in the native engine's layout: one metrics row per erft step (one
generation batch = ``minibatches × ppo_epochs`` optimizer steps) with the native key names, written through
``rundir.Logger`` to ``metrics.jsonl`` and erft's trackers (``train.report_to``: TensorBoard in ``<out>/tb``, W&B,
MLflow, trackio; :mod:`entropy_rft.rundir.trackers`) on the erft step axis, and the completions with their prompt, gold
answer and reward to ``samples.jsonl`` every ``train.samples_every`` steps. TRL's own trackers are only what
``trl.report_to`` asks for (``trl_settings.report_to``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from entropy_rft.rundir.logger import Logger
from entropy_rft.training.step_log import sample_rows

# TRL's log keys -> erft's (averaged over the erft step's optimizer steps; time/step summed)
_TRL_KEYS = (("grad_norm", "optim/grad_norm"), ("learning_rate", "optim/lr"), ("step_time", "time/step"))


class ErftLog(TrainerCallback):
    """The TRL engine's metrics rows and samples (see the module docstring). ``k``: optimizer steps per erft
    step; ``purge_step``: the first step a resume rewrites (TensorBoard drops its events from there); ``on_row``:
    called with each row after it is logged, on the main process."""

    def __init__(self, trainer: Any, cfg: Any, out: Path, k: int, purge_step: int | None,
                 on_row: Callable[[dict], None] | None = None) -> None:
        self.trainer, self.cfg, self.k, self.on_row = trainer, cfg, k, on_row
        self.logger = Logger(Path(out), cfg, purge_step) if trainer.accelerator.is_main_process else None
        self.trl: dict[str, list[float]] = defaultdict(list)
        self.viewed: set[int] = set()  # the steps whose token view is written

    def erft_step(self) -> int:
        """The erft step being generated or trained (numbered from 1)."""
        return self.trainer.state.global_step // self.k + 1

    def samples(self, examples: list[Any], responses: list[str], rewards: list[float]) -> None:
        """Called by the reward function, on every process with its share of the generation batch: the rows of
        all processes go to samples.jsonl when the step is due (the same decision on every rank)."""
        every, step = self.cfg.train.samples_every, self.erft_step()
        if not every or step % every:
            return
        rows = sample_rows(step, examples, responses, rewards)
        if self.trainer.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            rows = gather_object(rows)
        if self.logger is not None:
            self.logger.samples.write_many(rows)

    @property
    def view_groups(self) -> int:
        return self.cfg.probe.view_groups

    def view_step(self) -> int | None:
        """The erft step being generated when its token view is due (``probe.view_every``) and not yet written,
        on the main process; else None."""
        every, step = self.cfg.probe.view_every, self.erft_step()
        if self.logger is None or not every or step % every or step in self.viewed:
            return None
        return step

    def write_view(self, rows: list[dict]) -> None:
        """The token view's rows of the step ``view_step`` named (``training.token_view``), once."""
        if self.logger is not None and rows:
            self.viewed.add(int(rows[0]["step"]))
            self.logger.view.write_many(rows)

    def on_log(self, args, state, control, logs=None, **kw):
        for src, dst in _TRL_KEYS:
            if logs and isinstance(logs.get(src), (int, float)):
                self.trl[dst].append(float(logs[src]))
        if state.global_step % self.k or "train_runtime" in (logs or {}):
            return
        row = self.trainer.step_metrics.pop()
        row.update({d: sum(v) / len(v) for d, v in self.trl.items() if v})
        if "time/step" in row:
            row["time/step"] *= len(self.trl["time/step"])  # TRL's step time is per optimizer step
        self.trl.clear()
        if self.logger is not None:
            row = {"step": state.global_step // self.k, **row}
            self.logger.log(row)
            if self.on_row is not None:
                self.on_row(row)

    def on_save(self, args, state, control, **kw):
        if self.logger is not None:
            self.logger.sync()

    def on_train_end(self, args, state, control, **kw):
        if self.logger is not None:
            self.logger.close()


def record_view(sink: Any, tok: Any, group_size: int, stats: Any, adv: Any, mask: Any, keep: Any, completion_ids: Any,
                prompt_ids: Any) -> None:
    """The token view (``training.token_view``) of one process's rows of a generation batch, written to ``sink``
    (``ErftLog``: ``view_step()``, ``view_groups``, ``write_view(rows)``; None: no view) when its step is due:
    what the plug-in sees at its rollout stage (each token kept or dropped; no reward: TRL's loss inputs hold
    advantages only).
    Rows are grouped by ``group_size`` (TRL's ``num_generations``) only when this process's rows hold whole
    groups."""
    from entropy_rft.training import token_view

    step = None if sink is None else sink.view_step()
    if step is None or mask.shape[0] % group_size:
        return
    prompts = tok.batch_decode(prompt_ids, skip_special_tokens=True)
    per_token = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
    sink.write_view(token_view.group_rows(
        step, "trl", prompts, token_view.token_texts(tok, completion_ids, mask), mask, stats, per_token,
        [None] * mask.shape[0], token_view.token_marks(mask, keep), group_size, sink.view_groups))
