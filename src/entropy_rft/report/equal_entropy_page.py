"""The report's page for the equal-entropy comparison (``equal_entropy``): the pass@1/pass@K Pareto plot and the
entropy curves per setpoint (each PNG bytes, or None when the runs hold nothing to draw), and the section's HTML.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import numpy as np

from entropy_rft.analysis.equal_entropy import (
    AGREEMENT_COLUMNS,
    LAW_COLUMNS,
    PRESET,
    comparison_markdown,
    comparison_rows,
    dynamics_markdown,
    dynamics_verdict,
    setpoint_order,
    summaries_k,
    verdict,
)
from entropy_rft.analysis.runs import mean_series, rolling
from entropy_rft.report.html_parts import figure_html, table_html
from entropy_rft.report.plots import figure_png

if TYPE_CHECKING:
    from entropy_rft.analysis.runs import RunData

MARKERS = "osD^vP*Xh<>p"
SMOOTH = 10  # steps in the rolling mean of the entropy curves (a batch's entropy is noisy)


def run_setpoint(r: RunData) -> str:
    target = (r.cfg.get("method") or {}).get("entropy_target")
    return PRESET if target is None else str(target)


def _method_styles(methods: Sequence[str]) -> dict[str, tuple[str, str]]:
    cmap = plt.get_cmap("tab20")
    return {m: (cmap(i % 20), MARKERS[i % len(MARKERS)]) for i, m in enumerate(sorted(set(methods)))}


def fig_pareto(rows: Sequence[dict[str, Any]], k: int | None) -> bytes | None:
    """pass@1 (x) against pass@K (y): a marker per method (shape and colour) and setpoint (one panel each),
    error bars one std over seeds each way. The reference ``none`` is in every panel."""
    pts = [r for r in rows if r.get("final/pass@1") and r.get("final/pass@K")]
    if not pts:
        return None
    sps = setpoint_order([r["setpoint"] for r in pts])
    styles = _method_styles([r["method"] for r in pts])
    fig, axes = plt.subplots(1, len(sps), figsize=(3.6 * len(sps) + 2.2, 3.8), sharex=True, sharey=True,
                             squeeze=False)
    seen: dict[str, Any] = {}
    for ax, sp in zip(axes[0], sps):
        for r in (r for r in pts if r["setpoint"] == sp):
            color, marker = styles[r["method"]]
            x, y = r["final/pass@1"], r["final/pass@K"]
            h = ax.errorbar(x["mean"], y["mean"], xerr=x["std"], yerr=y["std"], fmt=marker, color=color,
                            ms=7, capsize=2, mfc="none" if r["status"] not in (PRESET, "held") else color)
            seen.setdefault(r["method"], h)
        ax.set_title("presets" if sp == PRESET else f"setpoint {sp}", fontsize=10)
        ax.set_xlabel("pass@1")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"pass@{k}" if k else "pass@K")
    axes[0][-1].legend([seen[m] for m in sorted(seen)], sorted(seen), fontsize=8, loc="center left",
                       bbox_to_anchor=(1.02, 0.5), frameon=False)
    return figure_png(fig)


def fig_entropy_by_setpoint(runs: Sequence[RunData]) -> bytes | None:
    """Training-batch entropy over steps, one panel per setpoint, one line per method (mean over seeds); the
    setpoint's target (mean over its runs) dashed. The preset panel shows the methods at their own settings."""
    groups: dict[str, dict[str, list[RunData]]] = {}
    for r in runs:
        if r.train_rows:
            groups.setdefault(run_setpoint(r), {}).setdefault(r.method, []).append(r)
    targeted = [sp for sp in groups if sp != PRESET]
    if not targeted:
        return None
    nones = groups.get(PRESET, {}).get("none", [])
    sps = setpoint_order(list(groups))
    styles = _method_styles([m for g in groups.values() for m in g])
    fig, axes = plt.subplots(1, len(sps), figsize=(3.6 * len(sps) + 2.2, 3.6), sharey=True, squeeze=False)
    handles: dict[str, Any] = {}
    for ax, sp in zip(axes[0], sps):
        block = dict(groups[sp])
        if sp != PRESET and nones and "none" not in block:
            block["none"] = nones
        for method, rs in sorted(block.items()):
            xs, ys = mean_series(rs, "entropy/mean")
            ys = rolling(ys, SMOOTH)
            color, _ = styles[method]
            (h,) = ax.plot(xs, ys, color=color, lw=1.6 if method == "none" else 1.1,
                           ls="--" if method == "none" else "-")
            handles.setdefault(method, h)
        tg = [mean_series(rs, "control/entropy_target") for m, rs in block.items() if m != "none"]
        tg = [t for t in tg if t[0]]
        if tg:
            xs, ys = tg[0]
            ax.plot(xs, ys, color="k", ls=":", lw=1.2)
            ax.fill_between(xs, np.asarray(ys) * 0.85, np.asarray(ys) * 1.15, color="k", alpha=0.06)
        ax.set_title("presets" if sp == PRESET else f"setpoint {sp} (±15% shaded)", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("entropy (nats)")
    axes[0][-1].legend([handles[m] for m in sorted(handles)], sorted(handles), fontsize=8, loc="center left",
                       bbox_to_anchor=(1.02, 0.5), frameon=False)
    return figure_png(fig)


PARETO_CAPTION = (
    "Final pass@1 (x) against pass@K (y), mean over seeds with one standard deviation each way; one panel per "
    "setpoint (and the presets), one marker per method. The reference GRPO (none) is in every panel. An open marker: "
    "the autopilot did not hold that setpoint on every seed. Up and to the right is better; a method below and "
    "left of another at the same setpoint is dominated.")
ENTROPY_CAPTION = (
    f"Training-batch entropy per step, mean over seeds and a {SMOOTH}-step rolling mean: one panel per setpoint, "
    "one line per method, GRPO (none) "
    "dashed; the setpoint (dotted, a fraction of each run's first-batch entropy) with its ±15% band shaded.")
DYNAMICS_CAPTION = (
    "Per run, then mean ± std over seeds. The law R = −a·exp(H) + b fitted on all evaluations (R², ceiling b − a) "
    "and fitted on the evaluations of the first 10/20/40% of steps only, then asked for the final pass@1 from the "
    "final entropy: forecast err = predicted − actual. Then each batch prediction of the entropy change against "
    "the measured change of the same tokens after the step (probe/dH_actual), over steps: Pearson r, the share of "
    "steps with the right sign, and the share of steps on which it predicts a fall (Cov > 0).")


def equal_entropy_section(runs: Sequence[RunData], summaries: Sequence[dict]) -> tuple[str, dict[str, Any]]:
    """The report's comparison page: with setpoints, the verdict, Pareto plot, entropy per setpoint and table;
    for any runs, the law's forecasts and the batch predictions against the measured entropy change."""
    k = summaries_k(summaries)
    rows = comparison_rows(summaries)
    numbers: dict[str, Any] = {"rows": rows, "verdict": None, "dynamics": dynamics_verdict(summaries)}
    out = ""
    if any(run_setpoint(r) != PRESET for r in runs):
        numbers["verdict"] = verdict(rows, k)
        out += ("<h2>Methods at equal entropy</h2>"
                f'<p class="summary" id="equal-entropy">{html.escape(numbers["verdict"])}</p>')
        for png, title, caption in ((fig_pareto(rows, k), "pass@1 against pass@K", PARETO_CAPTION),
                                    (fig_entropy_by_setpoint(runs), "Entropy per setpoint", ENTROPY_CAPTION)):
            if png is not None:
                out += figure_html(png, title, html.escape(caption))
        out += table_html(comparison_markdown(rows, k))
    if any(s.get("dH_agree/steps") for s in summaries):
        out += ("<h2>The law's forecast and the batch predictions of the entropy change</h2>"
                f'<p class="summary" id="dynamics">{html.escape(numbers["dynamics"])}</p>'
                f"<p>{html.escape(DYNAMICS_CAPTION)}</p>" + table_html(dynamics_markdown(rows, LAW_COLUMNS))
                + table_html(dynamics_markdown(rows, AGREEMENT_COLUMNS)))
    return out, numbers
