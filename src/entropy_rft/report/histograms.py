"""Pass-rate histograms: ``erft eval``'s per dataset and model, ``erft filter``'s with its kept and dropped
questions."""

from __future__ import annotations

from typing import Any

from entropy_rft.analysis.pass_filter import keep_question
from entropy_rft.common.text import mathtext_literal
from entropy_rft.report.plots import figure_png, plt


def eval_histogram_png(results: list[dict[str, Any]]) -> bytes:
    """One panel per dataset: the share of questions with c of n samples right, one bar group per model."""
    import numpy as np

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(datasets), figsize=(max(5.5, 4.5 * len(datasets)), 3.6), squeeze=False)
    width = 0.8 / max(1, len(models))
    for ax, d in zip(axes[0], datasets):
        for j, m in enumerate(models):
            r = next((r for r in results if r["dataset"] == d and r["model"] == m), None)
            if r is None:
                continue
            h = np.asarray(r["pass_rate_hist"], dtype=float)
            x = np.arange(len(h))
            ax.bar(x + (j - (len(models) - 1) / 2) * width, h / max(1.0, h.sum()), width=width,
                   label=mathtext_literal(m))
        ax.set_title(mathtext_literal(d))
        ax.set_xlabel("correct samples per question (c of n)")
        ax.set_ylabel("share of questions")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Pass-rate histograms")
    return figure_png(fig)


def filter_histogram_png(counts: list[int], n: int, min_pass: float, max_pass: float) -> bytes:
    """The number of questions with c of n samples right, kept bars blue and dropped ones grey
    (``analysis.pass_filter.keep_question``)."""
    import numpy as np

    hist = np.bincount(np.asarray(counts, dtype=int), minlength=n + 1)
    kept = [keep_question(c, n, min_pass, max_pass) for c in range(n + 1)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(range(n + 1), hist, color=["tab:blue" if k else "tab:gray" for k in kept])
    ax.set_xlabel(f"correct samples of {n}")
    ax.set_ylabel("questions")
    ax.set_title(f"Pass rates: {sum(h for h, k in zip(hist, kept) if k)} kept (blue), "
                 f"{sum(h for h, k in zip(hist, kept) if not k)} dropped (grey)")
    return figure_png(fig)
