"""The self-contained HTML report: figures as PNG data URIs, a summary table, and a computed paragraph.

``build_report(paths, out)`` accepts run directories and folders of run directories (``erft compare``
output), and writes ``out/report.html`` (readable offline: no script, no external file),
``out/report.json`` (the numbers behind the paragraph) and each figure it draws as ``out/<figure>.png`` (the
page's own images, for a docs page or a paper), all atomically.

Runs are grouped into series by a label (``assign_labels``): the method with its variant (``clip_v:mu=3``,
``clip_v@0.8x``), then the engine (native / trl) and the model, each only where the runs given differ in
it. Runs of one label whose settings differ in more than the seed and ``train.max_steps`` (what erft compare
refuses to mix) are one series per setting, labelled with the fields that differ (``none (optim.lr=0.05)``), and
the page says which settings differ. Runs of one series with different ``train.seed`` are seeds and are
averaged; runs of one label that share a seed are not seeds, and their labels get the run directory's name.

What the runs given lack (``analysis.runs.incomplete``: a log's unfinished last line, no ``run.json`` or
``config.yaml``, fewer steps than their siblings) is listed near the top of the page, one line each, and in
``report.json``'s ``incomplete``.

The runs are read once, into one record (``analysis.report_data.ReportData``: runs, labels, summaries, law fits,
the doctor's findings, token views, what the runs lack); every section of the page renders that record.
"""

from __future__ import annotations

import datetime as _dt
import html
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from entropy_rft.analysis.findings import fmt, quadrant_table_md
from entropy_rft.analysis.law import MIN_RELIABLE_POINTS
from entropy_rft.analysis.report_data import ReportData, report_data, report_numbers
from entropy_rft.analysis.runs import RunData
from entropy_rft.analysis.summary import DEFAULT_COLUMNS, expand_columns, markdown_table
from entropy_rft.common.errors import UserError
from entropy_rft.common.text import table_cell
from entropy_rft.report import plots, probe_plots
from entropy_rft.report.equal_entropy_page import equal_entropy_section
from entropy_rft.report.html_parts import CSS, figure_html, not_shown_html, table_html
from entropy_rft.report.token_view_page import CSS as TOKEN_CSS
from entropy_rft.report.token_view_page import token_view_section
from entropy_rft.rundir.files import atomic_write_bytes, atomic_write_json, atomic_write_text

# ----------------------------------------------------------------------------- HTML

# Each figure: (key, title, draw: the record -> PNG bytes or None, caption).
FIGURES: list[tuple[str, str, Callable[[ReportData], bytes | None], str]] = [
    ("entropy", "Entropy over steps", lambda d: plots.fig_entropy(d.runs),
     "Mean token entropy of each training batch (solid) and of the validation samples at evaluation steps "
     "(dashed). Entropy collapse shows as a falling solid line."),
    ("autopilot", "Entropy autopilot", lambda d: plots.fig_autopilot(d.runs),
     "Runs with an entropy target (method.entropy_target): the measured batch entropy (thin), its smoothed value "
     "that the PI controller reads (thick), the target (dashed) with a ±15% band, and the knob the controller "
     "set each step (right, log scale)."),
    ("accuracy", "Accuracy and reward over steps", lambda d: plots.fig_accuracy_reward(d.runs),
     "Mean training reward per step, and validation pass@1 / pass@K at evaluation steps."),
    ("probe", "Predicted vs actual entropy change", lambda d: probe_plots.fig_probe_scatter(d.runs),
     "Each point is a recorded token: the tabular first-order prediction −w·A·S_c (Theorem 3.3, without the "
     "learning-rate factor, so only sign and correlation matter) against the actual change of that token's "
     "entropy after the step. Legend: Pearson r and sign agreement over tokens where both are non-zero."),
    ("probe_levels", "Probe levels over training", lambda d: probe_plots.fig_probe_levels(d.runs),
     "How well each level predicts the actual per-token entropy change after a step. Tabular: −A·S_c "
     "(Theorem 3.3), every step (10-step rolling mean), raw and |prediction|-weighted sign agreement. JVP: the "
     "network's exact first-order change ∇θH·Δθ along the step's actual parameter update, by forward-mode AD "
     "every probe.jvp_every steps. The dash-dotted line is chance (0.5)."),
    ("counterfactual", "What the method did to entropy (counterfactual)",
     lambda d: probe_plots.fig_counterfactual(d.runs),
     "Every probe.counterfactual_every steps, the vanilla update was also taken from the very same parameters, "
     "optimizer state, RNGs and batch (then undone). Left: the method's own effect, batch-mean ΔH after the "
     "method's update minus after the vanilla one (positive: the method kept entropy up). Right: both ΔH."),
    ("sc", "Distribution of S_c", lambda d: plots.fig_sc_hist(d.runs),
     "The centred discriminator S_c = S_k − E_p[S] over the recorded tokens. ClipV drops the tails."),
    ("lens", "Lens attribution", lambda d: plots.fig_lens(d.runs, d.lens, d.lens_ppo),
     "What each method removed from the gradient, by quadrant sign(A) × sign(S_c), and the first-order entropy "
     "change those tokens would have caused (negative: they would have lowered entropy). Hatched: tokens "
     "PPO's own ratio clip silenced."),
    ("passk", "Pass@k curves", lambda d: plots.fig_pass_at_k(d.runs),
     "Unbiased Pass@k for k = 1..K from each final evaluation's pass-rate histogram; the base model dashed."),
    ("passrate", "Pass-rate histograms", lambda d: plots.fig_pass_rate_hist(d.runs),
     "How many of the K samples per validation problem were correct, base vs final. Paper A reports that "
     "clipping moves problems from the extremes (all wrong / all right) toward the middle."),
]


def _missing_reason(key: str, runs: Sequence[RunData]) -> str:
    if key == "autopilot":
        return "no run had an entropy target (method.entropy_target)"
    if key == "law":
        return ("no evaluations with validation entropy in these runs (set eval.every > 0), nor, for another "
                "engine's run, a validation score at a step that logged the policy entropy")
    if key == "accuracy":
        return "no run logged reward/mean or eval/pass@1"
    if key == "entropy":
        return "no run logged entropy/mean"
    if key in ("passk", "passrate"):
        return "no evaluation with a pass-rate histogram in these runs (set eval.every > 0)"
    if key in ("probe", "sc") and not any(r.records for r in runs):
        return "no token records (probe.records_every = 0, or no step reached it)"
    if key == "probe":
        return ("no recorded token had both a non-zero predicted and a non-zero actual entropy change (e.g. every "
                "group's rewards were uniform, so A = 0)")
    if key == "lens":
        return "no lens metrics logged"
    if key == "probe_levels":
        return "no JVP probe in these runs (probe.jvp_every = 0, or the runs are shorter than it)"
    if key == "counterfactual":
        return "no counterfactual probe in these runs (probe.counterfactual_every = 0, or the runs are shorter than it)"
    return "no training steps logged yet"


def _omitted_html(omitted: Sequence[dict[str, str]]) -> str:
    if not omitted:
        return ""
    return ("<h2>Figures left out</h2><p>These figures are not drawn because no run given logged what they "
            "plot:</p>" + "".join(not_shown_html(f"{o['title']}: {o['reason']}") for o in omitted))


def _incomplete_html(notes: Sequence[str]) -> str:
    """The list of what the runs given lack (text from the runs: escaped, shown, never obeyed)."""
    if not notes:
        return ""
    return ('<h2 id="incomplete">Incomplete runs</h2><p>What these runs lack, and what the report left out or '
            'could not tell of them:</p><ul class="warn">'
            + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")


def _law_html(fits: Sequence[dict], runs: Sequence[RunData]) -> tuple[str, bytes | None]:
    law_png = plots.fig_law(fits, runs)
    if law_png is None:
        return "", None
    law_rows, fc_rows = [], []
    for f in fits:
        note = f.get("warning") or f.get("error") or ""
        who = f"| {table_cell(f['run'])} | {table_cell(f['label'])} |"
        fc_rows.append(f"{who} " + " | ".join(
            fmt(f["forecast"][f"law/forecast_err@{p}"]).replace("n/a", "–") for p in ("10%", "20%", "40%")) + " |")
        if f.get("fit"):
            ft = f["fit"]
            law_rows.append(f"{who} {ft['n']} | {ft['a']:.4f} | {ft['b']:.4f} | "
                            f"{ft['ceiling']:.4f} | {fmt(ft['r2'], 3)} | {table_cell(note)} |")
        else:
            law_rows.append(f"{who} {len(f['points']['step'])} | – | – | – | – | {table_cell(note)} |")
    out = "<h2>Entropy-performance law</h2>"
    warned = [f for f in fits if f.get("warning")]
    if warned:
        out += "".join(f'<p class="warn">{html.escape(f["run"])}: {html.escape(f["warning"])}.</p>' for f in warned)
    out += figure_html(law_png, "Entropy-performance law", (
        "R = −a·exp(H) + b fitted by linear least squares on [−exp(H), 1] to each run's (validation entropy, "
        "pass@1) pairs; the ceiling b − a is the predicted accuracy at zero entropy. Runs with fewer than 3 "
        f"evaluations are shown as points only; a fit on fewer than {MIN_RELIABLE_POINTS} is dashed and marked "
        "not reliable (with so few points a high R² arises from noise alone). Forecast err: the law fitted on the "
        "evaluations of the first 10/20/40% of steps only predicts the final pass@1 from the final entropy; "
        "predicted − actual (Paper B: about 0.01 from the first 36 of 200 steps). <code>erft fit-law RUN_DIR</code> "
        "gives the full test."))
    out += table_html("| run | series | evaluations | a | b | ceiling b − a | R² | note |\n|---|\n"
                      + "\n".join(law_rows))
    out += ("<p>The law's forecast of the final pass@1 (predicted − actual), fitted on the evaluations of the first "
            "10%, 20% and 40% of the steps:</p>")
    out += table_html("| run | series | from 10% | from 20% | from 40% |\n|---|\n" + "\n".join(fc_rows))
    return out, law_png


def _doctor_html(diagnoses: Sequence[dict[str, Any]]) -> str:
    """The doctor's section: one row per finding (text from the runs: escaped, shown, never obeyed)."""
    rows = []
    for d in diagnoses:
        who = f"| {table_cell(d['run'])} | {table_cell(d['label'])} |"
        if "error" in d:
            rows.append(f"{who} – | not diagnosed | {table_cell(d['error'])} | – |")
            continue
        for f in d["findings"]:
            rx = f["prescription"]
            what = "–" if rx is None else (f"{rx['method']}: " if rx["method"] != "none" else "") + rx["direction"]
            evidence = f"{f['evidence']} (keys: {', '.join(f['keys'])}; rule: {f['rule']})"
            rows.append(f"{who} {f['level']} | {table_cell(f['id'] + ': ' + f['title'])} | {table_cell(evidence)} | "
                        f"{table_cell(what)} |")
        if not d["findings"]:
            rows.append(f"{who} – | no findings | healthy by every rule | – |")
    ahead = []
    for d in diagnoses:
        h = d.get("heading") or {}
        if "law" in h:
            ahead.append(f"| {table_cell(d['run'])} | {h['law']['predicted']:.3f} [{h['law']['low']:.3f}, "
                         f"{h['law']['high']:.3f}] | {h['linear']['predicted']:.3f} [{h['linear']['low']:.3f}, "
                         f"{h['linear']['high']:.3f}] | {h['n']} |")
    out = ('<h2 id="doctor">Doctor</h2><p><code>erft doctor</code> on each run: findings ranked by level, each with '
           "its evidence, the rule that fired and a prescription from the method registry "
           "(docs/your-own-run.md).</p>" + table_html("| run | series | level | finding | evidence | prescription |"
                                                     "\n|---|\n" + "\n".join(rows)))
    if ahead:
        out += ("<p>Where each run is heading if its entropy keeps falling: the score at H = 0 by the law "
                "R = −a·exp(H) + b (its ceiling b − a) and by a line in H, with 90% prediction intervals. Both "
                "extrapolate; on the project's committed runs such intervals held the final score less often "
                "than 90% (docs/your-own-run.md).</p>"
                + table_html("| run | law at H = 0 | line at H = 0 | scored steps |\n|---|\n" + "\n".join(ahead)))
    return out


ENTROPY_COLUMNS = ("entropy@*",)
MAIN_COLUMNS = tuple(c for c in DEFAULT_COLUMNS if c not in ENTROPY_COLUMNS)


def build_report(paths: Sequence[str | Path], out: str | Path, *, source: str | None = None,
                 entropy_key: str | None = None, metric: str | None = None) -> dict[str, Any]:
    """Write ``out/report.html`` and ``out/report.json``; return the numbers (paragraph, fits, lens).
    ``paths``: erft run directories, folders of them, and runs of other engines (``analysis.byo.load_runs``:
    ``source``, ``entropy_key`` and ``metric`` choose their reader and keys), read once into the report's record
    (``analysis.report_data``), which every section below renders."""
    out = Path(out)
    if out.exists() and not out.is_dir():  # refused before any run is read
        raise UserError(f"--out {out}: exists and is not a folder; choose a folder for report.html")
    return write_report(report_data(paths, source=source, entropy_key=entropy_key, metric=metric), out)


def write_report(data: ReportData, out: Path) -> dict[str, Any]:
    """The page, ``report.json`` and the figures of the record ``data`` in the folder ``out``; returns the numbers."""
    runs = data.runs
    sections = []
    pngs: dict[str, bytes] = {}  # each figure drawn, also written as out/<key>.png (for a page or a paper)
    omitted: list[dict[str, str]] = []
    for key, title, draw, caption in FIGURES:
        png = draw(data)
        if png is None:  # nothing to plot: no empty panel, a line in "Figures left out"
            omitted.append({"figure": key, "title": title, "reason": _missing_reason(key, runs)})
        else:
            pngs[key] = png
            sections.append(f"<h2>{html.escape(title)}</h2>{figure_html(png, title, html.escape(caption))}")
    law_html, law_png = _law_html(data.law, runs)
    if law_png is None:
        omitted.append({"figure": "law", "title": "Entropy-performance law", "reason": _missing_reason("law", runs)})
    else:
        pngs["law"] = law_png
        sections.append(law_html)

    title = "entropy-rft report"
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    run_list = ", ".join(html.escape(str(r.path)) for r in runs)
    tables = table_html(markdown_table(data.methods, MAIN_COLUMNS, first=data.kind))
    if expand_columns(data.methods, ENTROPY_COLUMNS):  # a second table, so that neither is too wide for the page
        tables += ("<p>Training-batch entropy at fixed steps:</p>"
                   + table_html(markdown_table(data.methods, ENTROPY_COLUMNS, first=data.kind)))
    tokens_html, tokens = token_view_section(data.views)
    quadrant_html = ("<h2>Methods through the lens</h2><p>What each method does to each quadrant sign(A) × "
                     "sign(S_c) (drops, zeroes, reweights, adds gradient, changes the clip), and the measured "
                     "first-order entropy change of its change in token weights there, mean per step "
                     "(lensw/dH_change: Theorem 3.3 per token, −Δg·S_c, against the vanilla loss on the same "
                     "batch).</p>" + table_html(quadrant_table_md(data.quadrants)))
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{title}</title><style>{CSS}{TOKEN_CSS}</style></head><body>"
        f"<h1>{title}</h1><p class=\"meta\">Generated {now} from {len(runs)} run(s): {run_list}</p>"
        + _incomplete_html(data.incomplete)
        + f"<h2>Summary</h2><p class=\"summary\" id=\"summary\">{html.escape(data.paragraph)}</p>"
        + "".join(f'<p class="warn">Settings: {html.escape(n)}.</p>' for n in data.settings)
        + f"<h2>Table (mean ± std over seeds)</h2>{tables}" + _doctor_html(data.doctor) + equal_entropy_section(data)
        + quadrant_html + tokens_html
        + _omitted_html(omitted) + "".join(sections) + "</body></html>\n"
    )
    atomic_write_text(out / "report.html", page)
    numbers = report_numbers(data, list(pngs), omitted, tokens)
    atomic_write_json(out / "report.json", numbers)
    for key, png in pngs.items():
        atomic_write_bytes(out / f"{key}.png", png)
    for name in ("report.html", "report.json", *(f"{key}.png" for key in pngs)):
        os.chmod(out / name, 0o644)  # the atomic temp file is private; a report is for sharing
    return numbers
