"""The self-contained HTML report: figures as PNG data URIs, a summary table, and a computed paragraph.

``build_report(paths, out)`` accepts run directories and folders of run directories (``erft compare``
output), and writes ``out/report.html`` (readable offline: no script, no external file) and
``out/report.json`` (the numbers behind the paragraph), both atomically.

Runs are grouped into series by a label (``assign_labels``): the method with its variant (``clip_v:mu=3``,
``clip_v@0.8x``), then the engine (native / trl) and the model, each only where the runs given differ in
it. Runs of one label with different ``train.seed`` are seeds and are averaged; runs of one label that
share a seed are not seeds, and their labels get the run directory's name.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from entropy_rft.analysis import plots
from entropy_rft.analysis.equal_entropy_page import equal_entropy_section
from entropy_rft.analysis.html_parts import CSS, figure_html, not_shown_html, table_html
from entropy_rft.analysis.law import MIN_RELIABLE_POINTS, fit_law, forecast_final, law_points, reliability_warning
from entropy_rft.analysis.summary import (
    DEFAULT_COLUMNS,
    aggregate,
    expand_columns,
    markdown_table,
    read_run_config,
    run_summary,
)
from entropy_rft.autopilot import tracking
from entropy_rft.control.lens import QUADRANTS
from entropy_rft.errors import UserError
from entropy_rft.rundir import atomic_write_json, atomic_write_text, read_jsonl, read_status, read_step_log


@dataclass
class RunData:
    path: Path
    name: str
    method: str
    label: str  # the series this run belongs to (assign_labels); the variant until then
    seed: int | None
    cfg: dict
    rows: list[dict]
    records: list[dict]
    train_rows: list[dict] = field(default_factory=list)
    eval_rows: list[dict] = field(default_factory=list)
    k: int | None = None
    base_hist: list[int] | None = None
    final_hist: list[int] | None = None
    variant: str = ""  # the method with its variant: clip_v, clip_v:mu=3, clip_v@target=0.43
    engine: str = "native"
    model: str = "default"


def is_run_dir(p: Path) -> bool:
    """A folder holding a metrics.jsonl (one that is not a file is refused when the run is read)."""
    return p.is_dir() and os.path.lexists(p / "metrics.jsonl")


def expand_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories as given; a folder that is not one contributes its run-directory children (sorted)."""
    if not paths:
        raise UserError("give at least one RUN_DIR (a run directory or an erft compare folder)")
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise UserError(f"{p}: no such directory; give a run directory or an erft compare --out folder")
        if is_run_dir(p):
            out.append(p)
            continue
        kids = sorted(c for c in p.iterdir() if is_run_dir(c)) if p.is_dir() else []
        if not kids:
            raise UserError(f"{p}: not a run directory (no metrics.jsonl) and holds none; give the --out "
                            "folder of erft train or erft compare")
        out.extend(kids)
    seen: set = set()
    return [p for p in out if not (p.resolve() in seen or seen.add(p.resolve()))]


def _label(cfg: dict) -> tuple[str, str]:
    m = cfg.get("method") or {}
    name = str(m.get("name") or "none")
    if m.get("label"):  # erft compare names its variants (clip_v:mu=1.5, clip_v@target=0.43)
        return name, str(m["label"])
    if m.get("entropy_target") is not None:
        return name, f"{name}@target={m['entropy_target']}"
    params = {**((m.get("presets") or {}).get(name) or {}), **(m.get("params") or {})}
    if name == "grad_mask":
        a = ">" if params.get("sample_sign", "positive") == "positive" else "<"
        s = ">" if params.get("s_sign", "positive") == "positive" else "<"
        field_ = "S_c" if params.get("s_field") == "s_centered" else "S"
        return name, f"grad_mask A{a}0 {field_}{s}0"
    return name, name


def _hist(v: Any) -> list[int] | None:
    """A pass-rate histogram (counts of prompts by correct samples), or None when the logged value is not one."""
    if isinstance(v, list) and len(v) >= 2 and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0 and c == int(c)
            for c in v):
        return [int(c) for c in v]
    return None


def load_run(path: Path) -> RunData:
    cfg = read_run_config(path)
    rows = read_step_log(path / "metrics.jsonl")
    if not rows:
        raise UserError(f"{path / 'metrics.jsonl'}: empty; the run has not logged a step yet")
    method, label = _label(cfg)
    status = read_status(path)  # run.json: the TRL engine records engine="trl" there too
    engine = str(cfg.get("engine") or status.get("engine") or "native")
    model = str((cfg.get("model") or {}).get("name") or "default")
    seed = (cfg.get("train") or {}).get("seed")
    if seed is not None and not isinstance(seed, (int, str)):
        seed = str(seed)  # only compared: a damaged value must not stop the report
    r = RunData(path=path, name=path.name, method=method, label=label, seed=seed, cfg=cfg, rows=rows,
                records=read_jsonl(path / "token_records.jsonl"), variant=label, engine=engine, model=model)
    r.train_rows = [x for x in rows if x["step"] >= 1]  # read_step_log: every step is an integer >= 0
    r.eval_rows = [x for x in rows if isinstance(x.get("eval/pass@1"), (int, float))]
    for x in r.eval_rows:
        ks = [int(k[9:]) for k in x if k.startswith("eval/avg@") and k[9:].isdigit()]
        if ks:
            r.k = ks[0]
            break
    hists = [(x["step"], h) for x in r.eval_rows if (h := _hist(x.get("eval/pass_rate_hist"))) is not None]
    if hists:
        if hists[0][0] == 0:
            r.base_hist = hists[0][1]
        r.final_hist = hists[-1][1]
    return r


def _model_short(name: str) -> str:
    """A local model folder by its last component (a hub id such as Qwen/Qwen2.5-7B as it is)."""
    if name.startswith(("/", "./", "../", "~")) or (os.sep in name and Path(name).exists()):
        return Path(name).name or name
    return name


def assign_labels(runs: Sequence[RunData]) -> None:
    """Set each run's series label: its variant, then its engine and model where the runs differ in them.

    Runs of one label are seeds only when their ``train.seed`` values are distinct; otherwise (the same seed
    twice, or a seed missing) each of them is its own series, labelled with its run directory's name.
    """
    parts = [lambda r: r.variant]
    if len({r.engine for r in runs}) > 1:
        parts.append(lambda r: r.engine)
    models = {r.model for r in runs}
    if len(models) > 1:
        short = {m: _model_short(m) for m in models}
        if len(set(short.values())) < len(short):  # two folders of one name: keep the full names
            short = {m: m for m in models}
        parts.append(lambda r: short[r.model])
    for r in runs:
        r.label = " · ".join(f(r) for f in parts)
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.label, []).append(r)
    for label, rs in groups.items():
        seeds = [r.seed for r in rs]
        if len(rs) > 1 and (None in seeds or len(set(seeds)) < len(seeds)):
            names = [r.name for r in rs]
            if len(set(names)) < len(names):
                names = [str(r.path) for r in rs]
            for r, n in zip(rs, names):
                r.label = f"{label} [{n}]"


def series_info(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """Per series (in report order): label, method, variant, engine, model, and its runs and seeds."""
    out = []
    for label, rs in plots.by_label(runs):
        out.append({"label": label, "method": rs[0].method, "variant": rs[0].variant, "engine": rs[0].engine,
                    "model": rs[0].model, "n": len(rs), "runs": [str(r.path) for r in rs],
                    "seeds": [r.seed for r in rs]})
    return out


# ----------------------------------------------------------------------------- numbers


def law_fits(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """Per run with evaluations: its (H, R) points and the fit, or the reason it could not be fitted."""
    out = []
    for r in runs:
        try:
            steps, hs, rs = law_points(r.rows, what=r.name)
        except UserError:
            continue
        if not steps:
            continue
        entry: dict[str, Any] = {"run": r.name, "label": r.label,
                                 "points": {"step": steps, "entropy": hs, "accuracy": rs}, "fit": None,
                                 "warning": None}
        entry["forecast"] = forecast_final(steps, hs, rs)  # Paper B's test: the final pass@1 from early points
        try:
            entry["fit"] = fit_law(hs, rs, what=r.name).to_dict()
            entry["warning"] = reliability_warning(entry["fit"]["n"])
        except UserError as e:
            entry["error"] = str(e)
        out.append(entry)
    return out


def _mean(vals: Sequence[float | None]) -> float | None:
    v = [x for x in vals if isinstance(x, (int, float)) and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def _fmt(v: float | None, nd: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{nd}f}"


def _join(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _best_sentence(vals: dict[str, float], metric: str, kind: str = "method") -> str:
    if not vals:
        return ""
    top = max(vals.values())
    best = [lab for lab, v in vals.items() if abs(v - top) <= 1e-9]
    if len(best) == len(vals):
        return f"All {kind}{'' if kind == 'series' else 's'} tied on {metric} ({top:.3f})."
    return f"Best {metric}: {_join(best)} ({top:.3f})."


def summary_paragraph(runs: Sequence[RunData], summaries: Sequence[dict], lens: dict, fits: Sequence[dict]) -> str:
    """One paragraph computed from the numbers: entropy path, accuracy, probe agreement, lens, law."""
    labels = plots.methods_in_order(runs)
    by = {lab: [s for r, s in zip(runs, summaries) if r.label == lab] for lab in labels}
    steps = sorted({s["steps"] for s in summaries})
    step_txt = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
    kind = "method" if all(r.label == r.variant for r in runs) else "series"
    kinds = "methods" if kind == "method" else "series"
    parts = [f"This report covers {len(runs)} run{'s' if len(runs) != 1 else ''} of "
             f"{len(labels)} {kind if len(labels) == 1 else kinds} "
             f"({_join([f'{lab} ×{len(by[lab])}' for lab in labels])}), {step_txt} training "
             f"step{'' if steps == [1] else 's'} each."]
    # Entropy path.
    ent = {}
    for lab in labels:
        first = _mean([s.get("train/entropy_first") for s in by[lab]])
        last = _mean([s.get("train/entropy_last") for s in by[lab]])
        if first is not None and last is not None:
            ent[lab] = (first, last)
    if ent:
        bits = []
        for lab, (first, last) in ent.items():
            rel = (last - first) / first if first else 0.0
            if abs(rel) < 0.02:
                bits.append(f"stayed near {first:.3f} under {lab}")
            else:
                verb = "fell" if last < first else "rose"
                bits.append(f"{verb} from {first:.3f} to {last:.3f} nats ({100 * rel:+.0f}%) under {lab}")
        parts.append("Training-batch entropy " + _join(bits) + ".")
        if len(ent) >= 2:
            hi = max(ent, key=lambda k: ent[k][1])
            lo = min(ent, key=lambda k: ent[k][1])
            if ent[hi][1] - ent[lo][1] > 0.01 * max(1e-9, abs(ent[hi][1])):
                parts.append(f"{hi} kept the most entropy ({ent[hi][1]:.3f} at the last step against "
                             f"{ent[lo][1]:.3f} for {lo}).")
            else:
                parts.append(f"All {kinds} ended at about the same entropy ({ent[lo][1]:.3f}–{ent[hi][1]:.3f}).")
    # Accuracy.
    k = next((r.k for r in runs if r.k), None)
    acc = {lab: (_mean([s.get("final/pass@1") for s in by[lab]]),
                 _mean([s.get(f"final/pass@{k}") for s in by[lab]]) if k else None) for lab in labels}
    acc = {lab: v for lab, v in acc.items() if v[0] is not None}
    if acc:
        base1 = _mean([s.get("base/pass@1") for s in summaries])
        basek = _mean([s.get(f"base/pass@{k}") for s in summaries]) if k else None
        bits = [f"{lab} {_fmt(p1)}/{_fmt(pk)}" for lab, (p1, pk) in acc.items()]
        txt = f"At the final evaluation pass@1/pass@{k} was " + _join(bits)
        if base1 is not None:
            txt += f" (base model: {_fmt(base1)}/{_fmt(basek)})"
        parts.append(txt + ".")
        if len(acc) >= 2:
            parts.append(_best_sentence({x: v[0] for x, v in acc.items()}, "pass@1", kind) + " "
                         + _best_sentence({x: v[1] for x, v in acc.items() if v[1] is not None}, f"pass@{k}", kind))
        if basek is not None:
            below = [lab for lab, (_, pk) in acc.items() if pk is not None and pk < basek]
            if below:
                parts.append(f"Pass@{k} fell below the base model's under {_join(below)}, the diversity loss "
                             "that entropy collapse predicts.")
    else:
        parts.append("No evaluation was logged, so accuracy is not compared.")
    # Probe.
    sa = _mean([s.get("probe/sign_agreement") for s in summaries])
    sw = _mean([s.get("probe/sign_agreement_weighted") for s in summaries])
    sb = _mean([s.get("probe/batch_sign_agree") for s in summaries])
    if sa is not None:
        txt = (f"Per token, the sign of the tabular prediction −A·S_c matched the actual entropy change for "
               f"{100 * sa:.0f}% of tokens ({_fmt(None if sw is None else 100 * sw, 0)}% weighted by |prediction|")
        if sb is not None:
            txt += f"; the batch-mean sign was right in {100 * sb:.0f}% of steps"
        txt += ")"
        if sa < 0.6:
            txt += ", a weak per-token signal, as expected when logits share parameters."
        elif sa < 0.8:
            txt += ", a moderate per-token signal (logits share parameters, so other tokens' updates interfere)."
        else:
            txt += ", a strong per-token signal."
        parts.append(txt)
    parts += deeper_probe_sentences(runs)
    # Lens.
    bits = []
    for lab, d in lens.items():
        if d.get("drop_frac") and d["drop_frac"] > 0:
            q = max(QUADRANTS, key=lambda q: d.get(f"drop_frac/{q}") or 0.0)
            dh = d.get("dH_dropped") or 0.0
            effect = "lowered" if dh < 0 else "raised"
            bits.append(f"{lab} removed {100 * d['drop_frac']:.2f}% of tokens per step, most in "
                        f"{plots.QUADRANT_LABELS[q]} ({100 * (d.get(f'drop_frac/{q}') or 0):.2f}%), and those tokens "
                        f"would have {effect} entropy (first-order Σ {dh:+.2e} per step)")
    if bits:
        parts.append("Through the lens: " + "; ".join(bits) + ".")
    elif lens:
        parts.append("No method removed any token in these runs.")
    # Law.
    ok = [f for f in fits if f.get("fit")]
    if ok:
        bits = [f"{f['run']} (a={f['fit']['a']:.3f}, b={f['fit']['b']:.3f}, ceiling {f['fit']['ceiling']:.3f}, "
                f"R²={_fmt(f['fit']['r2'], 2)}{'; ' + f['warning'] if f.get('warning') else ''})" for f in ok]
        parts.append("The entropy-performance law R = −a·exp(H) + b was fitted to " + _join(bits) + ".")
        inverted = [f["run"] for f in ok if f["fit"]["a"] <= 0]
        if inverted:
            parts.append(f"In {_join(inverted)} the fitted a ≤ 0: accuracy did not fall as entropy rose, so the "
                         "law's premise does not hold there and its ceiling means nothing.")
    elif fits:
        parts.append(f"Too few evaluations per run ({max(len(f['points']['step']) for f in fits)}) to fit the "
                     "entropy-performance law (it needs 3 or more at different entropies).")
    return " ".join(parts)


def quadrant_rows(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """Per method label: what the method does to each lens quadrant (its registry entry, ``Method.quadrants``)
    and the measured mean per step of the first-order ΔH of its change in token weights there
    (``lensw/dH_change/<q>``; None when not logged)."""
    from entropy_rft.control import get_method_class, quadrant_effects

    out = []
    for label in plots.methods_in_order(runs):
        run = next(r for r in runs if r.label == label)
        name = str((run.cfg.get("method") or {}).get("name", "none"))
        try:
            effects = quadrant_effects(get_method_class(name).quadrants)
        except ValueError:  # a method this version does not know: its runs still report
            effects = {q: "?" for q in QUADRANTS}
        rows = [row for r in runs if r.label == label for row in r.train_rows]
        dh = {}
        for q in QUADRANTS:
            _, ys = plots.series(rows, f"lensw/dH_change/{q}")
            dh[q] = float(np.mean(ys)) if ys else None
        out.append({"label": label, "method": name, "effects": effects, "dH_change": dh})
    return out


def quadrant_table_md(rows: Sequence[dict[str, Any]]) -> str:
    """The methods × quadrants table: the declared effect, and the measured Σ −Δg·S_c per step."""
    head = "| method | " + " | ".join(plots.QUADRANT_LABELS[q] for q in QUADRANTS) + " |"
    lines = [head, "|" + "---|" * (len(QUADRANTS) + 1)]
    for r in rows:
        cells = []
        for q in QUADRANTS:
            v = r["dH_change"][q]
            cells.append(r["effects"][q] + ("" if v is None else f"; ΔH {v:+.2e}"))
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def deeper_probe_sentences(runs: Sequence[RunData]) -> list[str]:
    """Sentences on the JVP level, the counterfactual effect and the autopilot's tracking, from the rows."""
    out = []
    rows = [row for r in runs for row in r.train_rows]
    jc = _mean([row.get("probe/jvp_corr") for row in rows])
    js = _mean([row.get("probe/jvp_sign_agreement") for row in rows])
    if jc is not None and js is not None:
        probed = [row for row in rows if row.get("probe/jvp_corr") is not None]
        tc = _mean([row.get("probe/corr") for row in probed])
        ts = _mean([row.get("probe/sign_agreement") for row in probed])
        txt = (f"The network's exact first-order prediction (the JVP of each token's entropy along the actual "
               f"update, {len(probed)} probed steps) matched the actual change with Pearson r = {jc:.3f} and sign "
               f"agreement {100 * js:.0f}%")
        if tc is not None and ts is not None:
            txt += f", against r = {tc:.3f} and {100 * ts:.0f}% for the tabular −A·S_c on the same steps"
        out.append(txt + ".")
    bits = []
    for lab in plots.methods_in_order(runs):
        eff = [row.get("probe/dH_method_effect") for r in runs if r.label == lab for row in r.train_rows]
        eff = [v for v in eff if isinstance(v, (int, float)) and math.isfinite(v)]
        if eff and any(v != 0 for v in eff):
            pos, neg = sum(v > 0 for v in eff), sum(v < 0 for v in eff)
            bits.append(f"{lab} {np.mean(eff):+.2e} nats per step (above vanilla in {pos}, below in {neg} of "
                        f"{len(eff)} probed steps)")
    if bits:
        out.append("Counterfactual (the same step taken with vanilla GRPO from the same state): the method's own "
                   "effect on batch entropy was " + _join(bits) + ".")
    for r in runs:
        xs, tg = plots.series(r.train_rows, "control/entropy_target")
        if not xs:
            continue
        ent = dict(zip(*plots.series(r.train_rows, "entropy/mean")))
        steps = [s for s in xs if s in ent]
        tmap = dict(zip(xs, tg))
        tr = tracking(steps, [ent[s] for s in steps], [tmap[s] for s in steps])
        _, knobs = plots.series(r.train_rows, "control/knob")
        if tr["reach_step"] is None:
            out.append(f"Autopilot {r.name}: entropy never reached its target ({tg[-1]:.3f}); last knob "
                       f"{knobs[-1]:.3g}.")
        else:
            out.append(f"Autopilot {r.name}: entropy reached its target at step {tr['reach_step']}, then stayed "
                       f"within ±15% on {100 * tr['in_band_frac_after']:.0f}% of the remaining steps (largest "
                       f"deviation {100 * tr['max_rel_dev_after']:.0f}%, run {tr['length_ratio']:.1f}× the time to "
                       f"reach); last knob {knobs[-1]:.3g}.")
    return out


# ----------------------------------------------------------------------------- HTML

FIGURES = [
    ("entropy", "Entropy over steps", plots.fig_entropy,
     "Mean token entropy of each training batch (solid) and of the validation samples at evaluation steps "
     "(dashed). Entropy collapse shows as a falling solid line."),
    ("autopilot", "Entropy autopilot", plots.fig_autopilot,
     "Runs with an entropy target (method.entropy_target): the measured batch entropy (thin), its smoothed value "
     "that the PI controller reads (thick), the target (dashed) with a ±15% band, and the knob the controller "
     "set each step (right, log scale)."),
    ("accuracy", "Accuracy and reward over steps", plots.fig_accuracy_reward,
     "Mean training reward per step, and validation pass@1 / pass@K at evaluation steps."),
    ("probe", "Predicted vs actual entropy change", plots.fig_probe_scatter,
     "Each point is a recorded token: the tabular first-order prediction −w·A·S_c (Theorem 3.3, without the "
     "learning-rate factor, so only sign and correlation matter) against the actual change of that token's "
     "entropy after the step. Legend: Pearson r and sign agreement over tokens where both are non-zero."),
    ("probe_levels", "Probe levels over training", plots.fig_probe_levels,
     "How well each level predicts the actual per-token entropy change after a step. Tabular: −A·S_c "
     "(Theorem 3.3), every step (10-step rolling mean), raw and |prediction|-weighted sign agreement. JVP: the "
     "network's exact first-order change ∇θH·Δθ along the step's actual parameter update, by forward-mode AD "
     "every probe.jvp_every steps. The dash-dotted line is chance (0.5)."),
    ("counterfactual", "What the method did to entropy (counterfactual)", plots.fig_counterfactual,
     "Every probe.counterfactual_every steps, the vanilla update was also taken from the very same parameters, "
     "optimizer state, RNGs and batch (then undone). Left: the method's own effect, batch-mean ΔH after the "
     "method's update minus after the vanilla one (positive: the method kept entropy up). Right: both ΔH."),
    ("sc", "Distribution of S_c", plots.fig_sc_hist,
     "The centred discriminator S_c = S_k − E_p[S] over the recorded tokens. ClipV drops the tails."),
    ("lens", "Lens attribution", plots.fig_lens,
     "What each method removed from the gradient, by quadrant sign(A) × sign(S_c), and the first-order entropy "
     "change those tokens would have caused (negative: they would have lowered entropy). Hatched: tokens "
     "PPO's own ratio clip silenced."),
    ("passk", "Pass@k curves", plots.fig_pass_at_k,
     "Unbiased Pass@k for k = 1..K from each final evaluation's pass-rate histogram; the base model dashed."),
    ("passrate", "Pass-rate histograms", plots.fig_pass_rate_hist,
     "How many of the K samples per validation problem were correct, base vs final. Paper A reports that "
     "clipping moves problems from the extremes (all wrong / all right) toward the middle."),
]


def _missing_reason(key: str, runs: Sequence[RunData]) -> str:
    if key == "autopilot":
        return "no run had an entropy target (method.entropy_target)"
    if key == "law":
        return "no evaluations with validation entropy in these runs (set eval.every > 0)"
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


def _law_html(fits: Sequence[dict], runs: Sequence[RunData]) -> tuple[str, bytes | None]:
    law_png = plots.fig_law(fits, runs)
    if law_png is None:
        return "", None
    law_rows, fc_rows = [], []
    for f in fits:
        note = f.get("warning") or f.get("error") or ""
        fc_rows.append(f"| {f['run']} | {f['label']} | " + " | ".join(
            _fmt(f["forecast"][f"law/forecast_err@{p}"]).replace("n/a", "–") for p in ("10%", "20%", "40%")) + " |")
        if f.get("fit"):
            ft = f["fit"]
            law_rows.append(f"| {f['run']} | {f['label']} | {ft['n']} | {ft['a']:.4f} | {ft['b']:.4f} | "
                            f"{ft['ceiling']:.4f} | {_fmt(ft['r2'], 3)} | {note} |")
        else:
            law_rows.append(f"| {f['run']} | {f['label']} | {len(f['points']['step'])} | – | – | – | – | {note} |")
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


ENTROPY_COLUMNS = ("entropy@*",)
MAIN_COLUMNS = tuple(c for c in DEFAULT_COLUMNS if c not in ENTROPY_COLUMNS)


def build_report(paths: Sequence[str | Path], out: str | Path) -> dict[str, Any]:
    """Write ``out/report.html`` and ``out/report.json``; return the numbers (paragraph, fits, lens)."""
    run_dirs = expand_run_dirs(paths)
    runs = [load_run(p) for p in run_dirs]
    assign_labels(runs)
    summaries = [run_summary(r.path, rows=r.rows, cfg=r.cfg) for r in runs]
    for r, s in zip(runs, summaries):
        s["method"] = r.label
    agg = aggregate(summaries)
    agg = {lab: agg[lab] for lab in plots.methods_in_order(runs)}
    lens = plots.lens_means(runs, "lens")
    fits = law_fits(runs)
    paragraph = summary_paragraph(runs, summaries, lens, fits)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder; choose a folder for report.html")

    sections = []
    figures_present: list[str] = []
    omitted: list[dict[str, str]] = []
    for key, title, fn, caption in FIGURES:
        png = fn(runs)
        if png is None:  # nothing to plot: no empty panel, a line in "Figures left out"
            omitted.append({"figure": key, "title": title, "reason": _missing_reason(key, runs)})
        else:
            figures_present.append(key)
            sections.append(f"<h2>{html.escape(title)}</h2>{figure_html(png, title, html.escape(caption))}")
    law_html, law_png = _law_html(fits, runs)
    if law_png is None:
        omitted.append({"figure": "law", "title": "Entropy-performance law", "reason": _missing_reason("law", runs)})
    else:
        figures_present.append("law")
        sections.append(law_html)

    title = "entropy-rft report"
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    run_list = ", ".join(html.escape(str(p)) for p in run_dirs)
    first = "method" if all(r.label == r.variant for r in runs) else "series"
    tables = table_html(markdown_table(agg, MAIN_COLUMNS, first=first))
    comparison_html, comparison = equal_entropy_section(runs, summaries)
    if expand_columns(agg, ENTROPY_COLUMNS):  # a second table, so that neither is too wide for the page
        tables += ("<p>Training-batch entropy at fixed steps:</p>"
                   + table_html(markdown_table(agg, ENTROPY_COLUMNS, first=first)))
    quadrants = quadrant_rows(runs)
    quadrant_html = ("<h2>Methods through the lens</h2><p>What each method does to each quadrant sign(A) × "
                     "sign(S_c) (drops, zeroes, reweights, adds gradient, changes the clip), and the measured "
                     "first-order entropy change of its change in token weights there, mean per step "
                     "(lensw/dH_change: Theorem 3.3 per token, −Δg·S_c, against the vanilla loss on the same "
                     "batch).</p>" + table_html(quadrant_table_md(quadrants)))
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{title}</title><style>{CSS}</style></head><body>"
        f"<h1>{title}</h1><p class=\"meta\">Generated {now} from {len(runs)} run(s): {run_list}</p>"
        f"<h2>Summary</h2><p class=\"summary\" id=\"summary\">{html.escape(paragraph)}</p>"
        f"<h2>Table (mean ± std over seeds)</h2>{tables}" + comparison_html + quadrant_html
        + _omitted_html(omitted) + "".join(sections) + "</body></html>\n"
    )
    atomic_write_text(out / "report.html", page)
    numbers = {"runs": [str(p) for p in run_dirs], "summary": paragraph, "series": series_info(runs),
               "figures": figures_present, "omitted": omitted, "methods": agg, "lens": lens, "law": fits,
               "comparison": comparison, "quadrants": quadrants}
    atomic_write_json(out / "report.json", numbers)
    for name in ("report.html", "report.json"):
        os.chmod(out / name, 0o644)  # the atomic temp file is private; a report is for sharing
    return numbers
