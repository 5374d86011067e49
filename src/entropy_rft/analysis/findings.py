"""The report's numbers in words: the entropy-performance law fitted per run, the computed summary paragraph,
the methods through the lens quadrants, and the sentences of the deeper probes and the autopilot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from entropy_rft.analysis.law import fit_law, forecast_final, law_points, reliability_warning
from entropy_rft.analysis.runs import QUADRANT_LABELS, UNKNOWN, RunData, methods_in_order, series
from entropy_rft.common.errors import UserError
from entropy_rft.common.text import table_cell
from entropy_rft.control.autopilot import tracking
from entropy_rft.control.lens import QUADRANTS


def law_fits(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """Per run with evaluations: its (H, R) points and the fit, or the reason it could not be fitted."""
    out = []
    for r in runs:
        try:
            steps, hs, rs = law_points(r.rows, entropy=r.law_entropy, what=r.name)
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


def fmt(v: float | None, nd: int = 3) -> str:
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
    labels = methods_in_order(runs)
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
        # the pass@K the runs logged, or pass@1 alone (another engine's runs: one validation score)
        pair = (lambda one, kk: f"{fmt(one)}/{fmt(kk)}") if k else (lambda one, kk: fmt(one))
        bits = [f"{lab} {pair(p1, pk)}" for lab, (p1, pk) in acc.items()]
        txt = f"At the final evaluation pass@1{f'/pass@{k}' if k else ''} was " + _join(bits)
        if base1 is not None:
            txt += f" (base model: {pair(base1, basek)})"
        parts.append(txt + ".")
        if len(acc) >= 2:
            best_k = _best_sentence({x: v[1] for x, v in acc.items() if v[1] is not None}, f"pass@{k}", kind) \
                if k else ""
            best_1 = _best_sentence({x: p1 for x, (p1, _) in acc.items() if p1 is not None}, "pass@1", kind)
            parts.append((best_1 + " " + best_k).strip())
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
               f"{100 * sa:.0f}% of tokens ({fmt(None if sw is None else 100 * sw, 0)}% weighted by |prediction|")
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
    parts += deeper_probe_sentences(runs, summaries)
    # Lens.
    bits = []
    for lab, d in lens.items():
        if d.get("drop_frac") and d["drop_frac"] > 0:
            q = max(QUADRANTS, key=lambda q: d.get(f"drop_frac/{q}") or 0.0)
            dh = d.get("dH_dropped") or 0.0
            effect = "lowered" if dh < 0 else "raised"
            bits.append(f"{lab} removed {100 * d['drop_frac']:.2f}% of tokens per step, most in "
                        f"{QUADRANT_LABELS[q]} ({100 * (d.get(f'drop_frac/{q}') or 0):.2f}%), and those tokens "
                        f"would have {effect} entropy (first-order Σ {dh:+.2e} per step)")
    if bits:
        parts.append("Through the lens: " + "; ".join(bits) + ".")
    elif lens:
        parts.append("No method removed any token in these runs.")
    # Law.
    ok = [f for f in fits if f.get("fit")]
    if ok:
        bits = [f"{f['run']} (a={f['fit']['a']:.3f}, b={f['fit']['b']:.3f}, ceiling {f['fit']['ceiling']:.3f}, "
                f"R²={fmt(f['fit']['r2'], 2)}{'; ' + f['warning'] if f.get('warning') else ''})" for f in ok]
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
    from entropy_rft.control.lens import quadrant_effects
    from entropy_rft.control.registry import get_method_class

    out = []
    for label in methods_in_order(runs):
        run = next(r for r in runs if r.label == label)
        name = UNKNOWN if run.method == UNKNOWN else str((run.cfg.get("method") or {}).get("name", "none"))
        try:
            effects = quadrant_effects(get_method_class(name).quadrants)
        except ValueError:  # a method this version does not know: its runs still report
            effects = {q: "?" for q in QUADRANTS}
        rows = [row for r in runs if r.label == label for row in r.train_rows]
        dh = {}
        for q in QUADRANTS:
            _, ys = series(rows, f"lensw/dH_change/{q}")
            dh[q] = float(np.mean(ys)) if ys else None
        out.append({"label": label, "method": name, "effects": effects, "dH_change": dh})
    return out


def quadrant_table_md(rows: Sequence[dict[str, Any]]) -> str:
    """The methods × quadrants table: the declared effect, and the measured Σ −Δg·S_c per step."""
    head = "| method | " + " | ".join(QUADRANT_LABELS[q] for q in QUADRANTS) + " |"
    lines = [head, "|" + "---|" * (len(QUADRANTS) + 1)]
    for r in rows:
        cells = []
        for q in QUADRANTS:
            v = r["dH_change"][q]
            cells.append(r["effects"][q] + ("" if v is None else f"; ΔH {v:+.2e}"))
        lines.append(f"| {table_cell(r['label'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def deeper_probe_sentences(runs: Sequence[RunData], summaries: Sequence[dict]) -> list[str]:
    """Sentences on the JVP level, the counterfactual effect and the autopilot's tracking, from the rows and the
    runs' summaries (``summaries``, as ``runs``: ``summary.run_summary``'s ``autopilot/...``)."""
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
    for lab in methods_in_order(runs):
        logged = [row.get("probe/dH_method_effect") for r in runs if r.label == lab for row in r.train_rows]
        eff = [v for v in logged if isinstance(v, (int, float)) and math.isfinite(v)]
        if eff and any(v != 0 for v in eff):
            pos, neg = sum(v > 0 for v in eff), sum(v < 0 for v in eff)
            bits.append(f"{lab} {np.mean(eff):+.2e} nats per step (above vanilla in {pos}, below in {neg} of "
                        f"{len(eff)} probed steps)")
    if bits:
        out.append("Counterfactual (the same step taken with vanilla GRPO from the same state): the method's own "
                   "effect on batch entropy was " + _join(bits) + ".")
    for r, summ in zip(runs, summaries, strict=True):
        xs, tg = series(r.train_rows, "control/entropy_target")
        if not xs:
            continue
        ent = dict(zip(*series(r.train_rows, "entropy/mean")))
        steps = [s for s in xs if s in ent]
        tmap = dict(zip(xs, tg))
        tr = tracking(steps, [ent[s] for s in steps], [tmap[s] for s in steps])
        _, knobs = series(r.train_rows, "control/knob")
        if tr["reach_step"] is None:
            out.append(f"Autopilot {r.name}: entropy never reached its target ({tg[-1]:.3f}); last knob "
                       f"{knobs[-1]:.3g}.")
        else:
            out.append(f"Autopilot {r.name}: entropy reached its target at step {tr['reach_step']}, then stayed "
                       f"within ±15% on {100 * tr['in_band_frac_after']:.0f}% of the remaining steps (largest "
                       f"deviation {100 * tr['max_rel_dev_after']:.0f}%, run {tr['length_ratio']:.1f}× the time to "
                       f"reach); last knob {knobs[-1]:.3g}." + _held_with_room(summ))
    return out


def _held_with_room(summ: dict) -> str:
    """The controller's own reading (its smoothed entropy, ``summary.setpoint_tracking`` in the run's summary
    ``summ``): steps outside ±15% after the reach, and how many of them found the knob with room left toward the
    correction (``autopilot/out_with_room``)."""
    if summ.get("autopilot/out_of_band") is None:
        return ""
    text = f" Its smoothed entropy was outside ±15% on {summ['autopilot/out_of_band']} step(s)"
    if summ.get("autopilot/out_with_room") is None:
        return text + "."
    return text + (f", {summ['autopilot/out_with_room']} of them with the knob not yet pushing as hard as it can "
                   "toward the target (the rest: at its limit, control/saturated).")
