"""Figures of the report, each rendered to PNG bytes with matplotlib's Agg backend (no display needed).

Every ``fig_*`` function takes the loaded runs (``analysis.runs.RunData``) and returns PNG bytes, or ``None`` when
the runs hold no data for that figure (the report then leaves it out and says why). A series is the runs of
one label (``RunData.label``: method and variant, plus engine, model and settings where they differ); its seeds
share a colour, the curves of a series with several seeds are their mean (seeds drawn thin behind it), and no panel
is drawn empty. Legends sit outside the plotting area: right of a single panel, below a pair of panels.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from entropy_rft.analysis.runs import (  # noqa: E402
    QUADRANT_LABELS,
    by_label,
    logged,
    mean_series,
    methods_in_order,
    pass_curve,
    series,
)
from entropy_rft.common.text import mathtext_literal  # noqa: E402
from entropy_rft.control.lens import QUADRANTS  # noqa: E402

if TYPE_CHECKING:
    from entropy_rft.analysis.runs import RunData

DPI = 90


def figure_png(fig) -> bytes:
    """The figure as PNG bytes (integer ticks on 'step' and 'k' axes); closes the figure."""
    for ax in fig.axes:  # steps and k are integers
        if ax.get_xlabel() in ("step", "k"):
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def method_colors(runs: Sequence[RunData]) -> dict[str, str]:
    cmap = plt.get_cmap("tab10")
    return {lab: matplotlib.colors.to_hex(cmap(i % 10)) for i, lab in enumerate(methods_in_order(runs))}


def _series_label(label: str, n: int) -> str:
    return label if n <= 1 else f"{label} (mean of {n} seeds)"


def _plot_series(ax, runs: Sequence[RunData], key: str, color: str, label: str | None, *, rows: str = "train_rows",
                 **kw) -> bool:
    """One series: its mean over seeds (labelled), the seeds thin behind it when there are several.
    False (and nothing drawn) when no run of the series logged ``key``."""
    seeds = [r for r in runs if series(getattr(r, rows), key)[0]]
    if not seeds:
        return False
    if len(seeds) > 1:
        for r in seeds:
            xs, ys = series(getattr(r, rows), key)
            ax.plot(xs, ys, color=color, lw=0.6, alpha=0.3, ls=kw.get("ls", "-"))
    xs, ys = mean_series(seeds, key, rows)
    if "marker" not in kw:
        kw["marker"] = "." if len(xs) < 30 else None
    ax.plot(xs, ys, color=color, label=None if label is None else _series_label(label, len(seeds)), **kw)
    return True


LEGEND_WRAP = 44  # characters per legend line: a long label wraps instead of widening the figure


def wrapped(labels: Sequence[str]) -> list[str]:
    """Legend labels wrapped at ``LEGEND_WRAP`` characters and drawn literally (a run's ``$`` is no formula)."""
    return [mathtext_literal(textwrap.fill(str(lab), LEGEND_WRAP, break_on_hyphens=False)) for lab in labels]


def legend_right(ax, handles: Sequence | None = None, fontsize: float = 8) -> None:
    """The axes' legend to the right of its plotting area (outside the curves); nothing when it has no entry."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    else:
        labels = [h.get_label() for h in handles]
    if handles:
        ax.legend(handles, wrapped(labels), loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                  fontsize=fontsize, frameon=False)


def legend_below(fig, axes: Sequence, fontsize: float = 8) -> None:
    """One legend for a row of panels, below the figure (outside every panel); entries deduplicated."""
    entries: dict[str, object] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(lab, h)
    if entries:
        fig.legend(list(entries.values()), wrapped(list(entries)), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=min(3, len(entries)), fontsize=fontsize, frameon=False)


def two_panels(runs: Sequence[RunData], figsize: tuple[float, float] = (12, 4.2)):
    """The method colours, and a figure of two panels side by side: (colors, fig, ax1, ax2)."""
    colors = method_colors(runs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=figsize)
    return colors, fig, ax1, ax2


def _bar_x(x: np.ndarray, i: int, n: int, width: float) -> np.ndarray:
    """Positions of the ``i``-th of ``n`` bars of ``width`` grouped around each of ``x``."""
    return x + (i - (n - 1) / 2) * width


def legend_once(ax, handles_seen: set, label: str) -> str | None:
    if label in handles_seen:
        return None
    handles_seen.add(label)
    return label


# ----------------------------------------------------------------------------- training curves


def fig_entropy(runs: Sequence[RunData]) -> bytes | None:
    """Training-batch entropy per step (solid), validation entropy at evaluation steps (dashed markers)."""
    if not logged(runs, "entropy/mean"):
        return None
    colors = method_colors(runs)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for label, rs in by_label(runs):
        _plot_series(ax, rs, "entropy/mean", colors[label], label, lw=1.4)
        _plot_series(ax, rs, "eval/entropy", colors[label], None, rows="eval_rows", ls="--", marker="o", ms=4,
                     lw=0.8, alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("entropy (nats / token)")
    ax.set_title("Policy entropy: training batch (solid), validation (dashed, o)")
    ax.grid(alpha=0.3)
    legend_right(ax)
    return figure_png(fig)


def fig_accuracy_reward(runs: Sequence[RunData]) -> bytes | None:
    """Left: mean training reward per step. Right: validation pass@1 (solid) and pass@K (dashed)."""
    has_train = logged(runs, "reward/mean")
    has_eval = any(series(r.eval_rows, "eval/pass@1")[0] for r in runs)
    if not (has_train or has_eval):
        return None
    colors = method_colors(runs)
    if has_train and has_eval:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    else:  # one panel: an empty one is not drawn
        fig, ax = plt.subplots(figsize=(7.5, 4))
        ax1, ax2 = (ax, None) if has_train else (None, ax)
    if ax1 is not None:
        for label, rs in by_label(runs):
            _plot_series(ax1, rs, "reward/mean", colors[label], label, lw=1.2)
        ax1.set_title("Training reward (mean over the rollout batch)")
        ax1.set_xlabel("step")
        ax1.set_ylabel("reward")
        ax1.grid(alpha=0.3)
    if ax2 is not None:
        for label, rs in by_label(runs):
            _plot_series(ax2, rs, "eval/pass@1", colors[label], label, rows="eval_rows", marker="o", ms=4)
            k = next((r.k for r in rs if r.k), None)
            if k and k > 1:
                _plot_series(ax2, rs, f"eval/pass@{k}", colors[label], None, rows="eval_rows", ls="--",
                             marker="^", ms=4, alpha=0.8)
        k = next((r.k for r in runs if r.k), None)
        ax2.set_title(f"Validation accuracy: pass@1 (solid), pass@{k} (dashed)")
        ax2.set_xlabel("step")
        ax2.set_ylabel("accuracy")
        ax2.grid(alpha=0.3)
    if ax1 is not None and ax2 is not None:
        legend_below(fig, (ax1, ax2))
    else:
        legend_right(ax1 if ax1 is not None else ax2)
    return figure_png(fig)


# ----------------------------------------------------------------------------- S_c


def record_arrays(r: RunData, *keys: str) -> list[np.ndarray]:
    rows = [t for t in r.records if all(isinstance(t.get(k), (int, float)) for k in keys)]
    return [np.array([t[k] for t in rows], dtype=np.float64) for k in keys]


def fig_sc_hist(runs: Sequence[RunData]) -> bytes | None:
    """Distribution of the centred discriminator S_c over recorded tokens, per method."""
    colors = method_colors(runs)
    vals: dict[str, list[float]] = {}
    for r in runs:
        (s,) = record_arrays(r, "s_centered")
        vals.setdefault(r.label, []).extend(s.tolist())
    allv = [v for vs in vals.values() for v in vs]
    if not allv:
        return None
    lo, hi = float(np.min(allv)), float(np.max(allv))
    if hi <= lo:
        hi = lo + 1e-6
    bins = np.linspace(lo, hi, 41)
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for label in methods_in_order(runs):
        vs = vals.get(label, [])
        if vs:
            ax.hist(vs, bins=bins, histtype="step", lw=1.6, color=colors[label],
                    label=f"{label} (n={len(vs)}, mean={np.mean(vs):.3g}, sd={np.std(vs):.3g})")
    ax.axvline(0, color="k", lw=0.6)
    log = len(allv) > 200  # the tails matter; a log axis shows them once there are enough tokens
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("S_c = S_k − E_p[S]")
    ax.set_ylabel("tokens (log scale)" if log else "tokens")
    ax.set_title("Distribution of the centred entropy discriminator S_c (recorded tokens)")
    legend_right(ax)
    return figure_png(fig)


# ----------------------------------------------------------------------------- lens


def fig_lens(runs: Sequence[RunData], groups: dict[str, dict[str, float | None]],
             ppo: dict[str, dict[str, float | None]]) -> bytes | None:
    """What each method dropped per quadrant sign(A)×sign(S_c), and the first-order ΔH those tokens carried:
    ``groups`` and ``ppo`` are the runs' lens means per series (``analysis.runs.lens_means`` of ``lens`` and
    ``lens_ppo``, as the report's record holds them).

    A last group, 'PPO ratio clip', shows the tokens PPO's own clipping silenced (lens_ppo), pooled over runs.
    """
    if not any(v["drop_frac"] is not None for v in groups.values()):
        return None
    pooled_rows = [row for r in runs for row in r.train_rows]
    _, ppo_any = series(pooled_rows, "lens_ppo/drop_frac")
    if ppo_any:
        ppo_pool = {}
        for key in next(iter(ppo.values())):
            vals = [val for val in (v[key] for v in ppo.values()) if val is not None]
            ppo_pool[key] = float(np.mean(vals)) if vals else None
        groups = {**groups, "PPO ratio clip": ppo_pool}
    colors, fig, ax1, ax2 = two_panels(runs)
    colors["PPO ratio clip"] = "#555555"
    names = list(groups)
    x = np.arange(len(QUADRANTS))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        g = groups[name]
        frac = [g.get(f"drop_frac/{q}") or 0.0 for q in QUADRANTS]
        dh = [g.get(f"dH_dropped/{q}") or 0.0 for q in QUADRANTS]
        hatch = "//" if name == "PPO ratio clip" else None
        total = g.get("drop_frac") or 0.0
        ax1.bar(_bar_x(x, i, len(names), width), [100 * f for f in frac], width, color=colors[name],
                hatch=hatch, label=f"{name} (dropped {100 * total:.2f}%)")
        ax2.bar(_bar_x(x, i, len(names), width), dh, width, color=colors[name], hatch=hatch,
                label=f"{name} (Σ {g.get('dH_dropped') or 0.0:+.2e})")
    for ax in (ax1, ax2):
        ax.set_xticks(x, [QUADRANT_LABELS[q] for q in QUADRANTS], fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        handles, labels = ax.get_legend_handles_labels()  # each panel's own numbers, below that panel
        ax.legend(handles, wrapped(labels), loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=7,
                  frameon=False)
    ax2.axhline(0, color="k", lw=0.6)
    ax1.set_ylabel("% of valid tokens dropped (mean per step)")
    ax1.set_title("Tokens removed, by quadrant")
    ax2.set_ylabel("Σ −w·A·r·S_c of removed tokens (per step)")
    ax2.set_title("First-order entropy change the removed tokens carried")
    ax2.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    return figure_png(fig)


# ----------------------------------------------------------------------------- evaluation figures


def _final_hists(runs: Sequence[RunData]) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for r in runs:
        h = r.final_hist
        if h:
            out.setdefault(r.label, []).append(h)
    return out


def _final_groups(runs: Sequence[RunData], finals: dict[str, list[list[int]]]) -> list[tuple[str, list[list[int]]]]:
    """Per method with a final evaluation (in order): its final histograms of the first one's length."""
    return [(lab, [h for h in finals[lab] if len(h) == len(finals[lab][0])])
            for lab in methods_in_order(runs) if lab in finals]


def _base_hist(runs: Sequence[RunData]) -> list[int] | None:
    return next((r.base_hist for r in runs if r.base_hist), None)


def fig_pass_at_k(runs: Sequence[RunData]) -> bytes | None:
    """Pass@k against k at the final evaluation (mean over seeds), with the base model (step 0) dashed."""
    finals = _final_hists(runs)
    if not finals:
        return None
    colors = method_colors(runs)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    base = _base_hist(runs)
    if base:
        c = pass_curve(base)
        ax.plot(range(1, len(c) + 1), c, color="k", ls="--", marker="s", ms=4, label="base (step 0)")
    for label, hists in _final_groups(runs, finals):
        curves = [pass_curve(h) for h in hists]
        c = np.mean(curves, axis=0)
        ax.plot(range(1, len(c) + 1), c, color=colors[label], marker="o", ms=4,
                label=f"{label} (final, {len(curves)} seed{'s' if len(curves) > 1 else ''})")
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k (unbiased)")
    ax.set_title("Pass@k curves at the final evaluation")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    legend_right(ax)
    return figure_png(fig)


def fig_pass_rate_hist(runs: Sequence[RunData]) -> bytes | None:
    """Fraction of problems solved c/K times: base vs each method's final evaluation (as in Paper A)."""
    finals = _final_hists(runs)
    if not finals:
        return None
    colors = method_colors(runs)
    base = _base_hist(runs)
    groups: dict[str, np.ndarray] = {}
    if base:
        groups["base (step 0)"] = np.asarray(base, dtype=float) / max(1, sum(base))
    for label, hists in _final_groups(runs, finals):
        hs = [np.asarray(h, dtype=float) / max(1, sum(h)) for h in hists]
        groups[label] = np.mean(hs, axis=0)
    k = len(next(iter(groups.values()))) - 1
    groups = {n: g for n, g in groups.items() if len(g) == k + 1}
    x = np.arange(k + 1)
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for i, (name, g) in enumerate(groups.items()):
        ax.bar(_bar_x(x, i, len(groups), width), g, width, color=colors.get(name, "#999999"),
               label=name, edgecolor="k" if name.startswith("base") else None, lw=0.5)
    ax.set_xticks(x, [f"{c}/{k}" for c in range(k + 1)])
    ax.set_xlabel("samples correct per problem")
    ax.set_ylabel("fraction of problems")
    ax.set_title("Pass-rate histogram: GRPO vs entropy-control methods (final evaluation)")
    ax.grid(alpha=0.3, axis="y")
    legend_right(ax)
    return figure_png(fig)


def fig_law(fits: Sequence[dict], runs: Sequence[RunData]) -> bytes | None:
    """(entropy, accuracy) per evaluation and the fitted R = −a·exp(H) + b curve of each run."""
    if not fits:
        return None
    colors = method_colors(runs)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    warnings = []
    for f in fits:
        pts = f["points"]
        col = colors.get(f["label"], "#333333")
        ax.scatter(pts["entropy"], pts["accuracy"], color=col, s=18)
        if f.get("fit"):
            fit = f["fit"]
            hs = np.linspace(min(pts["entropy"]), max(pts["entropy"]), 100)
            r2 = "–" if fit["r2"] is None else f"{fit['r2']:.2f}"
            note = f" [{fit['n']} points: not reliable]" if f.get("warning") else ""
            ax.plot(hs, -fit["a"] * np.exp(hs) + fit["b"], color=col, lw=1.2, ls="--" if note else "-",
                    label=f"{f['run']} ({f['label']}): a={fit['a']:.3f}, b={fit['b']:.3f}, "
                          f"ceiling={fit['ceiling']:.3f}, R²={r2}{note}")
            if f.get("warning"):
                warnings.append(f"{f['run']}: {f['warning'].split(' (')[0]}")
    ax.set_xlabel("validation entropy H")
    ax.set_ylabel("validation pass@1 R")
    ax.set_title("Entropy-performance law R = −a·exp(H) + b (Cui et al. 2025)")
    ax.grid(alpha=0.3)
    if warnings:  # in the panel itself, so the figure cannot be read without it
        ax.set_title("Entropy-performance law R = −a·exp(H) + b (Cui et al. 2025)\n"
                     + "; ".join(warnings[:3]) + ("; …" if len(warnings) > 3 else ""),
                     color="#a33", fontsize=10)
    legend_right(ax)
    return figure_png(fig)


# ----------------------------------------------------------------------------- the autopilot


def fig_autopilot(runs: Sequence[RunData], band: float = 0.15) -> bytes | None:
    """Runs with an entropy target: measured and smoothed batch entropy against the target (±band shaded),
    and the knob the controller set."""
    steered = [r for r in runs if series(r.train_rows, "control/entropy_target")[0]]
    if not steered:
        return None
    colors, fig, ax1, ax2 = two_panels(runs)
    seen: set = set()
    for r in steered:
        col = colors[r.label]
        tx, ty = series(r.train_rows, "control/entropy_target")
        ax1.plot(tx, ty, color="k", ls="--", lw=1.0)
        ax1.fill_between(tx, [(1 - band) * y for y in ty], [(1 + band) * y for y in ty], color=col, alpha=0.08)
        ex, ey = series(r.train_rows, "entropy/mean")
        ax1.plot(ex, ey, color=col, lw=0.7, alpha=0.45)
        sx, sy = series(r.train_rows, "control/entropy_smoothed")
        ax1.plot(sx, sy, color=col, lw=1.6, label=legend_once(ax1, seen, r.label))
        kx, ky = series(r.train_rows, "control/knob")
        ax2.plot(kx, ky, color=col, lw=1.4)
    ax1.set_title(f"Entropy (thin: batch, thick: smoothed) vs target ±{100 * band:.0f}%")
    ax1.set_ylabel("entropy (nats / token)")
    ax2.set_yscale("log")
    ax2.set_title("The knob the autopilot set")
    ax2.set_ylabel("knob (log scale)")
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    legend_below(fig, (ax1,))
    return figure_png(fig)
