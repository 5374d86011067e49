"""Paper A's pass-rate filter (``erft filter``): sample n responses per training question, score them with the
task's verifier, keep the questions whose pass rate lies strictly between the two thresholds."""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any


def keep_question(correct: int, n: int, min_pass: float, max_pass: float) -> bool:
    """Kept when min_pass < c/n < max_pass (exact rational comparison)."""
    rate = Fraction(correct, n)
    return Fraction(min_pass).limit_denominator(10**6) < rate < Fraction(max_pass).limit_denominator(10**6)


def count_correct(model, tok, task, examples, *, n: int, temperature: float, max_new_tokens: int,
                  batch_size: int, generator, on_progress: Callable[[int, int], None] | None = None) -> list[int]:
    """Correct samples (reward >= 1) out of ``n`` per example. ``on_progress(done, total)`` is called with the
    examples scored so far, before the first batch and after each (``evaluation.evaluate_policy``'s rule)."""
    from entropy_rft.policy.rollout import sample

    per_chunk = max(1, batch_size // n)
    counts: list[int] = []
    for i in range(0, len(examples), per_chunk):
        if on_progress is not None:
            on_progress(i, len(examples))
        part = examples[i : i + per_chunk]
        group = [ex for ex in part for _ in range(n)]
        rb = sample(model, tok, [ex.prompt for ex in group], max_new_tokens=max_new_tokens,
                    temperature=temperature, generator=generator)
        if hasattr(task, "check_many"):
            scores = [s for s, _ in task.check_many(rb.responses, group)]
        else:
            scores = [task.reward(r, ex) for r, ex in zip(rb.responses, group)]
        for j in range(len(part)):
            counts.append(sum(1 for s in scores[j * n : (j + 1) * n] if s >= 1.0))
    if on_progress is not None:
        on_progress(len(examples), len(examples))
    return counts


def filter_rows(examples: list, counts: list[int], n: int, min_pass: float, max_pass: float
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The kept and the dropped rows of ``filtered.jsonl`` and ``dropped.jsonl``: ``prompt`` (the raw question),
    ``answer``, ``pass_rate``, ``correct``, ``n``, ``row``."""
    kept_rows: list[dict[str, Any]] = []
    dropped_rows: list[dict[str, Any]] = []
    for ex, c in zip(examples, counts):
        meta = ex.meta if isinstance(ex.meta, dict) else {}
        row = {"prompt": meta.get("question", str(ex.prompt)), "answer": ex.answer, "pass_rate": c / n,
               "correct": c, "n": n, "row": meta.get("row")}
        (kept_rows if keep_question(c, n, min_pass, max_pass) else dropped_rows).append(row)
    return kept_rows, dropped_rows
