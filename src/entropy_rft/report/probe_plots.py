"""The report's figures of the probes: the tabular prediction −w·A·S_c against the actual ΔH per token
(scatter of the token records), the probe levels over training (tabular and JVP), and the counterfactual (the
method's own effect on entropy). PNG bytes or None, as every ``fig_*`` of ``report.plots``, whose helpers they use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from entropy_rft.analysis.runs import logged, methods_in_order, rolling, series
from entropy_rft.core.correlation import agreement, paired
from entropy_rft.report import plots
from entropy_rft.report.plots import plt

if TYPE_CHECKING:
    from entropy_rft.analysis.runs import RunData


def fig_probe_scatter(runs: Sequence[RunData]) -> bytes | None:
    """Per-token predicted ΔH (−w·A·S_c, no lr factor) against the actual ΔH after the step's updates."""
    colors = plots.method_colors(runs)
    data: dict[str, tuple[list, list]] = {}
    for r in runs:
        p, a = paired(*plots.record_arrays(r, "pred_dH", "actual_dH"))  # the pairs Pearson r and the signs count
        d = data.setdefault(r.label, ([], []))
        d[0].extend(p.tolist())
        d[1].extend(a.tolist())
    if not any(len(v[0]) for v in data.values()):
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for label, (p, a) in data.items():
        if not p:
            continue
        ag = agreement(p, a)
        r_txt = "–" if ag.corr is None else f"{ag.corr:.2f}"
        ax.scatter(p, a, s=9, alpha=0.5, color=colors[label],
                   label=f"{label}: r={r_txt}, sign agree={ag.sign:.2f} (n={ag.n})")
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(0, color="k", lw=0.6)
    ax.set_xlabel("predicted ΔH per token: −w·A·S_c (Theorem 3.3, up to lr)")
    ax.set_ylabel("actual ΔH per token (after the step)")
    ax.set_title("Tabular first-order prediction vs actual entropy change (token records)")
    ax.ticklabel_format(style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    plots.legend_right(ax)
    return plots.figure_png(fig)


def fig_probe_levels(runs: Sequence[RunData]) -> bytes | None:
    """Probe levels over training: per-token sign agreement and Pearson r of the tabular prediction −A·S_c
    (rolling mean of 10 steps) and of the network's JVP ∇θH·Δθ (every probe.jvp_every steps)."""
    if not logged(runs, "probe/jvp_sign_agreement"):
        return None
    colors, fig, ax1, ax2 = plots.two_panels(runs)
    seen: set = set()
    for r in runs:
        col = colors[r.label]
        for ax, key, jkey in ((ax1, "probe/sign_agreement", "probe/jvp_sign_agreement"),
                              (ax2, "probe/corr", "probe/jvp_corr")):
            xs, ys = series(r.train_rows, key)
            if xs:
                ax.plot(xs, rolling(ys, 10), color=col, lw=1.0, alpha=0.7)
            if ax is ax1:
                wx, wy = series(r.train_rows, "probe/sign_agreement_weighted")
                if wx:
                    ax.plot(wx, rolling(wy, 10), color=col, lw=1.0, ls=":", alpha=0.8)
            jx, jy = series(r.train_rows, jkey)
            if jx:
                ax.plot(jx, jy, color=col, ls="--", marker="o", ms=4, lw=0.9,
                        label=plots.legend_once(ax, seen, r.label) if ax is ax1 else None)
    ax1.axhline(0.5, color="k", lw=0.6, ls="-.")
    ax1.set_title("Per-token sign agreement with the actual ΔH")
    ax1.set_ylabel("fraction of tokens")
    ax2.axhline(0.0, color="k", lw=0.6)
    ax2.set_title("Per-token Pearson r with the actual ΔH")
    ax2.set_ylabel("r")
    style = [plt.Line2D([], [], color="k", lw=1.0, label="tabular −A·S_c (10-step mean)"),
             plt.Line2D([], [], color="k", lw=1.0, ls=":", label="tabular, |pred|-weighted"),
             plt.Line2D([], [], color="k", ls="--", marker="o", ms=4, label="JVP ∇θH·Δθ")]
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in (ax1, ax2):
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    fig.legend(style + [plt.Line2D([], [], color=colors[lab], lw=2, label=lab) for lab in methods_in_order(runs)],
               plots.wrapped([h.get_label() for h in style] + methods_in_order(runs)), loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7.5, frameon=False)
    return plots.figure_png(fig)


def fig_counterfactual(runs: Sequence[RunData]) -> bytes | None:
    """Left: the method's own effect on batch entropy per probed step, ΔH(method update) − ΔH(vanilla update)
    from the same state and batch. Right: the two batch-mean ΔH themselves (method solid, vanilla dashed)."""
    if not logged(runs, "probe/dH_method_effect"):
        return None
    colors, fig, ax1, ax2 = plots.two_panels(runs)
    seen: set = set()
    for r in runs:
        col = colors[r.label]
        xs, ys = series(r.train_rows, "probe/dH_method_effect")
        ax1.plot(xs, ys, color=col, marker="o", ms=3, lw=1.0, label=plots.legend_once(ax1, seen, r.label))
        mx, my = series(r.train_rows, "probe/dH_method")
        vx, vy = series(r.train_rows, "probe/dH_vanilla")
        ax2.plot(mx, my, color=col, marker="o", ms=3, lw=1.0)
        ax2.plot(vx, vy, color=col, marker="x", ms=3, lw=0.8, ls="--", alpha=0.8)
    for ax in (ax1, ax2):
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax1.set_title("The method's own effect: ΔH(method) − ΔH(vanilla)")
    ax1.set_ylabel("batch-mean ΔH difference (nats)")
    plots.legend_below(fig, (ax1,))
    ax2.set_title("Batch-mean ΔH: method (o), vanilla (x, dashed)")
    ax2.set_ylabel("batch-mean ΔH (nats)")
    return plots.figure_png(fig)
