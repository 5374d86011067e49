"""The report's page for the equal-entropy comparison (``equal_entropy``): the pass@1/pass@K Pareto plot, the
entropy curves per setpoint and, where methods ran under their own control laws, each own law against the
autopilot (each PNG bytes, or None when the runs hold nothing to draw), and the section's HTML, drawn from the
report's record (``analysis.report_data``).

Runs are grouped as their summaries group them (``analysis.summary.run_summary``: ``setpoint`` and
``method_name``), so a method's own law at a setpoint (``entropic:target=0.5x``) sits in that setpoint's panel as
``entropic (own law)``, next to the autopilot's ``entropic``.
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
    controller_markdown,
    dynamics_markdown,
    setpoint_order,
    summaries_k,
)
from entropy_rft.analysis.runs import mean_series, rolling
from entropy_rft.analysis.summary import OWN_LAW as OWN
from entropy_rft.report.html_parts import figure_html, table_html
from entropy_rft.report.plots import figure_png

if TYPE_CHECKING:
    from entropy_rft.analysis.report_data import ReportData
    from entropy_rft.analysis.runs import RunData

MARKERS = "osD^vP*Xh<>p"
SMOOTH = 10  # steps in the rolling mean of the entropy curves (a batch's entropy is noisy)


def series_by_setpoint(runs: Sequence[RunData], summaries: Sequence[dict]
                       ) -> dict[str, dict[str, list[RunData]]]:
    """The runs with training rows by setpoint, then by method name, as their summaries name them (``runs`` and
    ``summaries`` in the same order)."""
    groups: dict[str, dict[str, list[RunData]]] = {}
    for r, s in zip(runs, summaries, strict=True):
        if r.train_rows:
            name = str(s.get("method_name") or r.method)
            groups.setdefault(str(s.get("setpoint") or PRESET), {}).setdefault(name, []).append(r)
    return groups


def _target_series(rs: Sequence[RunData]) -> tuple[list[int], list[float]]:
    """The target the runs' controller steered to, mean over the runs: the autopilot's or a method's own."""
    for key in ("control/entropy_target", "control/own_target"):
        xs, ys = mean_series(rs, key)
        if xs:
            return xs, ys
    return [], []


def _band(ax, xs: Sequence[int], ys: Sequence[float]) -> None:
    ax.plot(xs, ys, color="k", ls=":", lw=1.2)
    ax.fill_between(xs, np.asarray(ys) * 0.85, np.asarray(ys) * 1.15, color="k", alpha=0.06)


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


def fig_entropy_by_setpoint(runs: Sequence[RunData], summaries: Sequence[dict]) -> bytes | None:
    """Training-batch entropy over steps, one panel per setpoint, one line per method (mean over seeds); the
    setpoint's target (mean over its runs) dashed. The preset panel shows the methods at their own settings."""
    groups = series_by_setpoint(runs, summaries)
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
                           ls="--" if method == "none" else ("-." if method.endswith(OWN) else "-"))
            handles.setdefault(method, h)
        tg = [_target_series(rs) for m, rs in sorted(block.items()) if m != "none"]
        tg = [t for t in tg if t[0]]
        if tg and sp != PRESET:
            _band(ax, *tg[0])
        ax.set_title("presets" if sp == PRESET else f"setpoint {sp} (±15% shaded)", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("entropy (nats)")
    axes[0][-1].legend([handles[m] for m in sorted(handles)], sorted(handles), fontsize=8, loc="center left",
                       bbox_to_anchor=(1.02, 0.5), frameon=False)
    return figure_png(fig)


def controller_lines(block: dict[str, list], method: str) -> list[tuple[str, str]]:
    """What a controller panel draws for ``method`` at one setpoint (``block``: method name -> runs): its own law
    (red), then the autopilot on its knob (blue); a method without a knob for the autopilot (Entrocraft, AEPO,
    Flexible Entropy Control) is drawn next to the autopilot on every other method of the block instead (blues;
    not the own laws, not GRPO). Returns (series name, legend) pairs, only those with runs."""
    out = [(method + OWN, "own law")] if block.get(method + OWN) else []
    if block.get(method):
        return out + [(method, "autopilot")]
    others = sorted(n for n in block if not n.endswith(OWN) and n != "none")
    return out + [(n, f"autopilot on {n}") for n in others]


def fig_controllers(runs: Sequence[RunData], summaries: Sequence[dict]) -> bytes | None:
    """A method's own control law against the autopilot driving its knob: one row per method that ran under
    its own law at a setpoint, one panel per setpoint, the training-batch entropy of each (mean over seeds,
    rolling mean) with the target dotted and its ±15% band shaded; each legend gives the mean share of steps in
    the band after the target was first reached (``controller/in_band``, as the controller table)."""
    groups = series_by_setpoint(runs, summaries)
    band: dict[tuple[str, str], list[Any]] = {}
    for s in summaries:
        band.setdefault((str(s.get("setpoint") or PRESET), str(s.get("method_name"))), []).append(
            s.get("controller/in_band"))
    owned = sorted({m[:-len(OWN)] for sp, g in groups.items() if sp != PRESET for m in g if m.endswith(OWN)})
    if not owned:
        return None
    sps = setpoint_order([sp for sp in groups if sp != PRESET])
    fig, axes = plt.subplots(len(owned), len(sps), figsize=(3.6 * len(sps) + 0.6, 3.0 * len(owned) + 0.4),
                             sharey=True, squeeze=False)
    for row, method in zip(axes, owned):
        for ax, sp in zip(row, sps):
            block = groups.get(sp, {})
            targets = []
            lines = controller_lines(block, method)
            blues = plt.cm.Blues(np.linspace(0.9, 0.5, max(len(lines) - 1, 1)))
            for i, (name, who) in enumerate(lines):
                rs = block[name]
                color = "tab:red" if who == "own law" else ("tab:blue" if who == "autopilot" else blues[i - 1])
                xs, ys = mean_series(rs, "entropy/mean")
                vals = [v for v in band.get((sp, name), []) if isinstance(v, (int, float))]
                share = f", in ±15%: {100 * float(np.mean(vals)):.0f}%" if vals else ""
                ax.plot(xs, rolling(ys, SMOOTH), color=color, lw=1.3, label=f"{who} ({len(rs)} seeds{share})")
                targets.append(_target_series(rs))
            targets = [t for t in targets if t[0]]
            if targets:
                _band(ax, *targets[0])
            ax.set_title(f"{method} at {sp}", fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper right", frameon=False)
        row[0].set_ylabel("entropy (nats)")
    for ax in axes[-1]:
        ax.set_xlabel("step")
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
CONTROLLER_CAPTION = (
    "A method that is itself a controller (the TRL/Skywork-OR1 adaptive entropy coefficient, EntroPIC, Entrocraft, "
    "AEPO, Flexible Entropy Control) under its own published law (red) and under the autopilot driving the same "
    "knob (blue; a method without a knob: the autopilot on the other methods of the setpoint, in blues), at the "
    "same setpoints: the "
    f"training-batch entropy, mean over seeds and a {SMOOTH}-step rolling mean, the target dotted and ±15% "
    "shaded. The table: after each run first reached the target, the share of steps with the batch entropy "
    "within ±15% and the worst relative excursion, mean ± std over seeds.")
DYNAMICS_CAPTION = (
    "Per run, then mean ± std over seeds. The law R = −a·exp(H) + b fitted on all evaluations (R², ceiling b − a) "
    "and fitted on the evaluations of the first 10/20/40% of steps only, then asked for the final pass@1 from the "
    "final entropy: forecast err = predicted − actual. Then each batch prediction of the entropy change against "
    "the measured change of the same tokens after the step (probe/dH_actual), over steps: Pearson r, the share of "
    "steps with the right sign, and the share of steps on which it predicts a fall (Cov > 0).")


def equal_entropy_section(data: ReportData) -> str:
    """The report's comparison page, from the record's ``comparison`` (``equal_entropy.comparison_numbers``): with
    setpoints, the verdict, Pareto plot, entropy per setpoint and table; for any runs, the law's forecasts and the
    batch predictions against the measured entropy change."""
    runs, summaries, numbers = data.runs, data.summaries, data.comparison
    k = summaries_k(summaries)
    rows = numbers["rows"]
    out = ""
    if numbers["verdict"] is not None:  # some run held a setpoint
        out += ("<h2>Methods at equal entropy</h2>"
                f'<p class="summary" id="equal-entropy">{html.escape(numbers["verdict"])}</p>')
        for png, title, caption in ((fig_pareto(rows, k), "pass@1 against pass@K", PARETO_CAPTION),
                                    (fig_entropy_by_setpoint(runs, summaries), "Entropy per setpoint",
                                     ENTROPY_CAPTION)):
            if png is not None:
                out += figure_html(png, title, html.escape(caption))
        out += table_html(comparison_markdown(rows, k))
        ctrl = fig_controllers(runs, summaries)
        if ctrl is not None:
            out += "<h2>Which controller holds entropy: own law against the autopilot</h2>"
            out += figure_html(ctrl, "Own law against the autopilot", html.escape(CONTROLLER_CAPTION))
            out += table_html(controller_markdown(summaries))
    if any(s.get("dH_agree/steps") for s in summaries):
        out += ("<h2>The law's forecast and the batch predictions of the entropy change</h2>"
                f'<p class="summary" id="dynamics">{html.escape(numbers["dynamics"])}</p>'
                f"<p>{html.escape(DYNAMICS_CAPTION)}</p>" + table_html(dynamics_markdown(rows, LAW_COLUMNS))
                + table_html(dynamics_markdown(rows, AGREEMENT_COLUMNS)))
    return out
