"""What a training request may size, checked before anything is written: the task's splits (a training set, and
a validation set when the run evaluates) and the batches its numeric settings allocate, against the memory of
this machine. Each refusal is one line (:class:`UserError`) naming the field and the fix. Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from entropy_rft.common.errors import UserError

# Bytes each token of a batch holds at the least: its id (int64), log-prob, entropy, mask, advantage and the
# statistics of the step (8 values of 4-8 bytes). The real peak is far higher (logits over the vocabulary, the
# KV cache, activations), so a batch refused here could never run; one let through may still not fit.
MIN_BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class Splits:
    """A built task's split sizes (training and validation examples) and what it says about them (``notes``)."""

    train: int
    val: int
    notes: tuple[str, ...] = ()


def task_splits(task: Any, seed: int = 0) -> Splits:
    """The split sizes of ``task`` (``task.split(seed)``) and its ``notes`` (e.g. a default held-out split)."""
    train, val = task.split(seed)
    return Splits(len(train), len(val), tuple(getattr(task, "notes", ()) or ()))


def check_splits(cfg: Any, splits: Splits) -> None:
    """A run needs a training example, and a validation example when it evaluates (``eval.every`` > 0)."""
    task = f"task '{cfg.task.name}'"
    if splits.train == 0:
        raise UserError(f"{task} has no training examples (all {splits.val} are held out for validation); set "
                        "task.params.val_size to fewer rows (--task-param val_size=N), or train on another task")
    if cfg.eval.every > 0 and splits.val == 0:
        raise UserError(f"{task} has no validation examples for the evaluation at step 0 (eval.every "
                        f"{cfg.eval.every}); hold some rows out (--task-param val_size=N) or pass --set eval.every=0")


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None when the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"


def batch_bytes(cfg: Any, val_examples: int | None = None) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """(what, least bytes, [(field, value), ...]) for each batch a run allocates: the rollout batch (prompts x
    samples x response tokens) and, when it evaluates, the evaluation batch (at most ``eval.batch_size``
    sequences of ``eval.prompts`` x ``eval.samples``, the prompts capped by the ``val_examples`` there are)."""
    r, e = cfg.rollout, cfg.eval
    tokens = r.max_new_tokens + 1
    out = [("the rollout batch", r.prompts_per_step * r.group_size * tokens * MIN_BYTES_PER_TOKEN,
            [("rollout.prompts_per_step", r.prompts_per_step), ("rollout.group_size", r.group_size),
             ("rollout.max_new_tokens", r.max_new_tokens)])]
    if e.every > 0:
        prompts = e.prompts if val_examples is None else min(e.prompts, val_examples)
        seqs = min(e.batch_size, prompts * e.samples)
        out.append(("an evaluation batch", seqs * tokens * MIN_BYTES_PER_TOKEN,
                    [("eval.batch_size", e.batch_size), ("eval.prompts", e.prompts), ("eval.samples", e.samples),
                     ("rollout.max_new_tokens", r.max_new_tokens)]))
    return out


def check_allocations(cfg: Any, val_examples: int | None = None, memory: int | None = None) -> None:
    """Refuse a batch that needs more than this machine's memory (``memory``, default :func:`machine_memory`)
    at the least (:data:`MIN_BYTES_PER_TOKEN` a token), naming the field to lower: the largest of its factors."""
    memory = machine_memory() if memory is None else memory
    if not memory:
        return
    for what, need, fields in batch_bytes(cfg, val_examples):
        if need > memory:
            product = " x ".join(f"{k} {v}" for k, v in fields)
            field, value = max(fields, key=lambda kv: kv[1])
            raise UserError(f"{what} ({product}) needs at least {_size(need)}, more than this machine's "
                            f"{_size(memory)} of memory; lower {field} (now {value})")


def check_request(cfg: Any, splits: Splits) -> None:
    """The task's splits and the batches of ``cfg`` (see :func:`check_splits`, :func:`check_allocations`)."""
    check_splits(cfg, splits)
    check_allocations(cfg, splits.val)
