"""Methods compared at equal entropy: one row per method and setpoint, and which methods are best within noise.

``erft compare --entropy-targets`` drives every method that has a knob to the same entropy setpoints (the
autopilot), so that methods are compared at equal held entropy rather than at their own papers' settings. This
module turns the runs' summaries (``summary.run_summary``) into that comparison:

- ``comparison_rows``: per (setpoint, method) the mean ± std over seeds of pass@1, pass@K, distinct correct
  answers, final and held entropy, the share of tokens the method touched, the step-time overhead against
  ``none`` (median training time per step, evaluations and probes left out: ``summary.train_step_time``) and how
  the autopilot held the setpoint (reached or not, share of steps within ±15%).
- ``best_within_noise``: per setpoint, the best method and those whose mean is within two standard errors of
  it (standard error of the mean over seeds, combined in quadrature).
- ``comparison_markdown`` and ``verdict``: the table and the computed paragraph of summary.md, the report and
  docs/results.md; ``comparison_numbers``: the report's (rows, verdict, the law's and predictions' paragraph).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np

from entropy_rft.common.text import table_cell

PRESET = "preset"
# (summary key, column header); '@K' is the run's own K.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("final/pass@1", "pass@1"),
    ("final/pass@K", "pass@K"),
    ("final/distinct_correct", "distinct correct"),
    ("final/entropy", "final entropy (val)"),
    ("train/entropy_held", "held entropy (train)"),
    ("control/touched_frac", "tokens touched"),
    ("overhead", "train step time × none"),
    ("autopilot/in_band", "in ±15%"),
)
# The law per setpoint and method: its fit, and its forecast of the final pass@1 from early evaluations.
LAW_COLUMNS: tuple[tuple[str, str], ...] = (
    ("law/r2", "law R²"),
    ("law/ceiling", "ceiling b − a"),
    ("law/forecast_err@10%", "forecast err, 10%"),
    ("law/forecast_err@20%", "forecast err, 20%"),
    ("law/forecast_err@40%", "forecast err, 40%"),
)
# Paper B's and Paper A's batch predictions of the entropy change against the measured change.
AGREEMENT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("dH_agree/cov_r", "r −Cov(logπ,A)"),
    ("dH_agree/cov_sign", "sign −Cov(logπ,A)"),
    ("dH_agree/cov_fall", "Cov > 0"),
    ("dH_agree/cov_centered_r", "r −Cov(A,S_c)"),
    ("dH_agree/cov_centered_sign", "sign −Cov(A,S_c)"),
    ("dH_agree/a_sc_r", "r −A·S_c"),
    ("dH_agree/a_sc_sign", "sign −A·S_c"),
    ("dH_agree/a_sc_fall", "−A·S_c < 0"),
)
DYNAMICS_COLUMNS = LAW_COLUMNS + AGREEMENT_COLUMNS
NOISE_SE = 2.0  # "within noise": within this many standard errors of the best mean


def summaries_k(summaries: Sequence[dict]) -> int | None:
    """K of pass@K: the samples per validation prompt of the first run that evaluated."""
    return next((s["k"] for s in summaries if s.get("k")), None)


def _key(key: str, k: int | None) -> str:
    return key.replace("@K", f"@{k}") if k and key.endswith("@K") else key


class _Stats(TypedDict):
    mean: float
    std: float
    n: int
    se: float | None


def _stats(vals: Sequence[Any]) -> _Stats | None:
    v = [float(x) for x in vals if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return None
    n = len(v)
    std = float(np.std(v))
    return {"mean": float(np.mean(v)), "std": std, "n": n, "se": std / math.sqrt(n - 1) if n > 1 else None}


def setpoint_order(setpoints: Sequence[str]) -> list[str]:
    """'preset' first, then the setpoints by value (0.5x before 0.65x; numbers in nats after fractions)."""
    def key(sp: str) -> tuple[int, float, str]:
        if sp == PRESET:
            return (0, 0.0, sp)
        try:
            return (1, float(sp[:-1]), sp) if sp.endswith("x") else (2, float(sp), sp)
        except ValueError:
            return (3, 0.0, sp)
    return sorted(dict.fromkeys(setpoints), key=key)


def comparison_rows(summaries: Sequence[dict]) -> list[dict[str, Any]]:
    """One row per (setpoint, method): the columns' statistics over seeds and the setpoint's status.

    ``status`` is ``preset`` (no target), ``held`` (on every seed reached, then ≥ 50% of the later steps within
    ±15%), ``held on k of n seeds``, ``not held`` (on no seed) or ``not reached`` (never reached it within the
    knob's clamps on any seed); a method that
    misses its setpoint stays in the table with that status. The reference ``none`` sits in every setpoint's
    block as the row ``none (reference)``.
    """
    k = summaries_k(summaries)
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in summaries:
        groups.setdefault((str(s.get("setpoint") or PRESET), str(s.get("method_name") or s["method"])), []).append(s)
    none_time = _stats([s.get("time/step_train") for (sp, m), ss in groups.items() if m == "none" for s in ss])
    rows = []
    for sp in setpoint_order([sp for sp, _ in groups]):
        block = [(m, ss) for (p, m), ss in groups.items() if p == sp]
        if sp != PRESET and not any(m == "none" for m, _ in block):
            block = [(m, ss) for (p, m), ss in groups.items() if p == PRESET and m == "none"] + block
        for method, ss in sorted(block, key=lambda b: (b[0] != "none", b[0])):
            row: dict[str, Any] = {"setpoint": sp, "method": method, "seeds": len(ss),
                                   "reference": sp != PRESET and method == "none"}
            for key, _ in COLUMNS:
                if key == "overhead":
                    t = _stats([s.get("time/step_train") for s in ss])
                    if t and none_time and none_time["mean"] > 0:
                        row[key] = {"mean": t["mean"] / none_time["mean"], "std": t["std"] / none_time["mean"],
                                    "n": t["n"], "se": None}
                    else:
                        row[key] = None
                elif key == "autopilot/in_band":  # an own-law row: its own controller's figure, as its status
                    row[key] = _stats([_tracked(s, "in_band") for s in ss])
                else:
                    row[key] = _stats([s.get(_key(key, k)) for s in ss])
            for key, _ in DYNAMICS_COLUMNS:
                row[key] = _stats([s.get(key) for s in ss])
            row["pass@1_se_prompts"] = _stats([s.get("final/pass@1_se") for s in ss])
            row["pass@K_se_prompts"] = _stats([s.get("final/pass@K_se") for s in ss])
            for key, se in (("final/pass@1", "pass@1_se_prompts"), ("final/pass@K", "pass@K_se_prompts")):
                if row[key] and row[se]:  # the mean's error over the validation prompts
                    row[key]["se_prompts"] = row[se]["mean"] / math.sqrt(row[key]["n"])
            row["status"] = _status(sp, method, ss)
            rows.append(row)
    return rows


def _tracked(s: dict, key: str) -> Any:
    """A run's tracking figure: a method's own law (controller/kind "own") by its own controller's tracking of
    the raw batch entropy, the autopilot by the smoothed entropy it reads."""
    return s.get(("controller/" if s.get("controller/kind") == "own" else "autopilot/") + key)


def _status(setpoint: str, method: str, runs: Sequence[dict]) -> str:
    if setpoint == PRESET or method == "none":
        return PRESET
    reached = [s for s in runs if _tracked(s, "reach_step") is not None]
    if not reached:
        return "not reached"
    held = [s for s in reached if (_tracked(s, "in_band") or 0.0) >= 0.5]
    if len(held) == len(runs):
        return "held"
    return "not held" if not held else f"held on {len(held)} of {len(runs)} seeds"


def _se(v: dict) -> float:
    """A mean's standard error: over seeds with two or more, else over the validation prompts (0 if unknown)."""
    return v["se"] if v.get("se") is not None else (v.get("se_prompts") or 0.0)


def best_within_noise(rows: Sequence[dict], key: str) -> tuple[str | None, list[str]]:
    """The method with the highest mean of ``key`` among ``rows`` and every method within ``NOISE_SE`` standard
    errors of it: the two means' standard errors in quadrature, each over seeds (two or more) or else over the
    validation prompts (``_se``)."""
    have = [r for r in rows if r.get(key)]
    if not have:
        return None, []
    best = max(have, key=lambda r: r[key]["mean"])
    b = best[key]
    near = []
    for r in have:
        if r is best:
            continue
        v = r[key]
        se = math.sqrt(_se(b) ** 2 + _se(v) ** 2)
        if b["mean"] - v["mean"] <= NOISE_SE * se:
            near.append(r["method"])
    return best["method"], near


def _cell(v: Mapping[str, Any] | None, pct: bool = False) -> str:
    if v is None:
        return "–"
    m, s = (100 * v["mean"], 100 * v["std"]) if pct else (v["mean"], v["std"])
    unit = "%" if pct else ""
    fmt = ".1f" if pct else ".3f"
    return f"{m:{fmt}}{unit}" if v["n"] <= 1 else f"{m:{fmt}}{unit} ± {s:{fmt}}{unit}"


def comparison_markdown(rows: Sequence[dict], k: int | None) -> str:
    """The comparison table: a row per setpoint and method, 'mean ± std' over seeds."""
    heads = [h.replace("@K", f"@{k}") if k else h for _, h in COLUMNS]
    lines = ["| setpoint | method | seeds | " + " | ".join(heads) + " | status |",
             "|" + "---|" * (len(COLUMNS) + 4)]
    for r in rows:
        cells = []
        for key, _ in COLUMNS:
            v = r.get(key)
            if key == "overhead":
                cells.append("–" if v is None else f"{v['mean']:.2f}×")
            else:
                cells.append(_cell(v, pct=key in ("control/touched_frac", "autopilot/in_band")))
        name = "none (reference)" if r["reference"] else r["method"]
        lines.append(f"| {r['setpoint']} | {table_cell(name)} | {r['seeds']} | " + " | ".join(cells)
                     + f" | {r['status']} |")
    return "\n".join(lines) + "\n"


def dynamics_markdown(rows: Sequence[dict], columns: Sequence[tuple[str, str]] = DYNAMICS_COLUMNS) -> str:
    """Per setpoint and method, mean ± std over seeds: the law's fit and forecast errors (predicted − actual final
    pass@1, fitted on the first 10/20/40% of the steps), ``LAW_COLUMNS``; or the batch predictions' agreement with
    the measured entropy change, ``AGREEMENT_COLUMNS``."""
    lines = ["| setpoint | method | seeds | " + " | ".join(h for _, h in columns) + " |",
             "|" + "---|" * (len(columns) + 3)]
    for r in rows:
        if r["reference"]:
            continue
        cells = [_cell(r.get(key), pct=key.endswith(("_sign", "_fall"))) for key, _ in columns]
        lines.append(f"| {r['setpoint']} | {table_cell(r['method'])} | {r['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def ranked(block: Sequence[dict]) -> list[dict]:
    """The rows of one setpoint that are compared at equal entropy: at the presets all of them, at a setpoint
    only the methods that held it on every seed. A method that missed it trained at other entropy, so its
    pass@K is not an equal-entropy figure; it is reported with its status, not ranked."""
    return [r for r in block if r["status"] in (PRESET, "held")]


def _held_text(r: dict) -> str:
    v = r.get("train/entropy_held")
    return f", {v['mean']:.2f} nats held" if v else ""


def verdict(rows: Sequence[dict], k: int | None) -> str:
    """The computed paragraph: per setpoint, the methods best within noise on pass@1 and pass@K among those that
    held it (``ranked``), the methods that missed it with the entropy they held, and the size of the noise (seed
    std, and the standard error over validation prompts)."""
    parts = []
    kk = f"pass@{k}" if k else "pass@K"
    for sp in setpoint_order([r["setpoint"] for r in rows]):
        block = [r for r in rows if r["setpoint"] == sp and not r["reference"]]
        if not block:
            continue
        bits = []
        among = ranked(block)
        if not among:
            bits.append("no method held it")
        for key, name in (("final/pass@1", "pass@1"), ("final/pass@K", kk)):
            best, near = best_within_noise(among, key)
            if best is None:
                continue
            val = next(r[key]["mean"] for r in block if r["method"] == best)
            txt = f"best {name} {best} ({val:.3f})"
            if near:
                txt += f", within noise of it: {', '.join(near)}"
            elif len(among) > 1:
                txt += ", clearly ahead of the rest"
            else:
                txt += ", the only method ranked"
            bits.append(txt)
        missed = [f"{r['method']} ({r['status']}{_held_text(r)})" for r in block if r not in among]
        where = "At the presets" if sp == PRESET else f"At setpoint {sp}, among the methods that held it"
        line = f"{where}: " + "; ".join(bits) + "."
        if missed:
            line += f" Setpoint missed, so not ranked: {', '.join(missed)}."
        parts.append(line)
    se1 = _stats([r["pass@1_se_prompts"]["mean"] for r in rows if r.get("pass@1_se_prompts")])
    sek = _stats([r["pass@K_se_prompts"]["mean"] for r in rows if r.get("pass@K_se_prompts")])
    sd1 = _stats([r["final/pass@1"]["std"] for r in rows if r.get("final/pass@1") and r["final/pass@1"]["n"] > 1])
    sdk = _stats([r["final/pass@K"]["std"] for r in rows if r.get("final/pass@K") and r["final/pass@K"]["n"] > 1])
    noise = []
    if sd1 and sdk:
        noise.append(f"the seed standard deviation averaged {sd1['mean']:.3f} (pass@1) and {sdk['mean']:.3f} "
                     f"({kk})")
    if se1 and sek:
        noise.append(f"one run's standard error over the validation prompts {se1['mean']:.3f} and {sek['mean']:.3f}")
    if noise:
        parts.append(f"'Within noise' means within {NOISE_SE:g} standard errors of the seed means; for scale, "
                     + " and ".join(noise) + ", so differences smaller than these are not significant.")
    return " ".join(parts)


def dynamics_verdict(summaries: Sequence[dict]) -> str:
    """The law's forecast error against Paper B's (~1% RMSE at step 200 from the first 36 steps) and the two
    batch predictions' agreement with the measured entropy change, over all runs and for GRPO (``none``)."""
    parts = []
    all_errs = {f: _stats([abs(s[f"law/forecast_err@{f}"]) for s in summaries
                           if isinstance(s.get(f"law/forecast_err@{f}"), (int, float))]) for f in ("10%", "20%", "40%")}
    errs = {f: v for f, v in all_errs.items() if v}
    if errs:
        bits = [f"{100 * v['mean']:.1f} points from the first {f} (n = {v['n']})" for f, v in errs.items()]
        r2 = _stats([s.get("law/r2") for s in summaries])
        txt = ("The entropy-performance law forecast each run's final pass@1 from its final entropy with a mean "
               "absolute error of " + ", ".join(bits))
        if r2:
            txt += f"; fitted on the whole run, its R² averaged {r2['mean']:.2f}"
        parts.append(txt + ". Paper B reports about 1% from the first 36 of 200 steps on 7B models.")
    for who, ss in (("over all runs", list(summaries)),
                    ("under GRPO", [s for s in summaries if (s.get("method_name") or s.get("method")) == "none"])):
        st = {key: _stats([s.get(key) for s in ss]) for key in
              ("dH_agree/cov_r", "dH_agree/cov_sign", "dH_agree/cov_fall", "dH_agree/cov_centered_r",
               "dH_agree/cov_centered_sign", "dH_agree/a_sc_r", "dH_agree/a_sc_sign", "dH_agree/a_sc_fall")}
        if not st["dH_agree/cov_r"] or not st["dH_agree/a_sc_r"]:
            continue

        def m(key: str, pct: bool = False, st: dict = st) -> str:
            v = st[f"dH_agree/{key}"]
            return "n/a" if v is None else (f"{100 * v['mean']:.0f}%" if pct else f"{v['mean']:.2f}")

        parts.append(
            f"Per step, {who} ({len(ss)} runs), Paper B's −Cov(log π, A) tracked the measured entropy change with "
            f"Pearson r = {m('cov_r')} and the right sign on {m('cov_sign', True)} of steps, and the covariance "
            f"was positive on {m('cov_fall', True)} of steps; its centred-discriminator form −Cov(A, S_c) gave "
            f"r = {m('cov_centered_r')} and {m('cov_centered_sign', True)}; Paper A's −A·S_c gave "
            f"r = {m('a_sc_r')} and {m('a_sc_sign', True)}, predicting a fall on {m('a_sc_fall', True)} of steps.")
    return " ".join(parts)


def comparison_numbers(summaries: Sequence[dict]) -> dict[str, Any]:
    """The report's comparison (``report.json``'s ``comparison``): the rows (``comparison_rows``), the verdict at
    equal entropy when some run held a setpoint (else None) and the law's and batch predictions' paragraph."""
    rows = comparison_rows(summaries)
    numbers: dict[str, Any] = {"rows": rows, "verdict": None, "dynamics": dynamics_verdict(summaries)}
    if any(str(s.get("setpoint") or PRESET) != PRESET for s in summaries):
        numbers["verdict"] = verdict(rows, summaries_k(summaries))
    return numbers


def controller_markdown(summaries: Sequence[dict]) -> str:
    """Which controller holds entropy more tightly: per method, controller kind ("own": the method's published
    law, ``adaptive_entropy``/``entropic``; "autopilot": ours driving its knob) and target, mean ± std over seeds
    of ``controller/in_band`` (share of steps within ±15% after reaching the target) and ``controller/max_dev``
    (worst relative excursion after it), and how many seeds reached the target. Runs without a controller are
    left out; "" when no run has one. The target is the run's ``control`` target spec (``0.5x`` or nats)."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for s in summaries:
        if s.get("controller/kind") is None:
            continue
        spec = str(s.get("controller/target_spec") or s.get("setpoint") or "?")
        groups.setdefault((spec, str(s.get("method_name") or s["method"]), s["controller/kind"]), []).append(s)
    if not groups:
        return ""
    lines = ["| target | method | controller | seeds | reached | in ±15% | worst excursion |",
             "|---|---|---|---|---|---|---|"]
    order = setpoint_order([g[0] for g in groups])
    for (spec, method, kind) in sorted(groups, key=lambda g: (order.index(g[0]), g[1], g[2])):
        ss = groups[(spec, method, kind)]
        reached = sum(s.get("controller/reach_step") is not None for s in ss)
        band, dev = _stats([s.get("controller/in_band") for s in ss]), _stats([s.get("controller/max_dev") for s in ss])
        lines.append(f"| {spec} | {method} | {kind} | {len(ss)} | {reached}/{len(ss)} | {_cell(band, pct=True)} | "
                     f"{_cell(dev, pct=True)} |")
    return "\n".join(lines) + "\n"


def compare_markdown(summaries: list[dict], numbers: dict[str, Any], table: str) -> tuple[str, str]:
    """The equal-entropy comparison of a sweep's runs (``erft compare --entropy-targets``) added to
    summary.json's ``numbers`` and to summary.md; returns summary.md's text and the table to print. ``table``: the
    table of every figure per variant (``summary.markdown_table``)."""
    k = summaries_k(summaries)
    rows = comparison_rows(summaries)
    said, dyn = verdict(rows, k), dynamics_verdict(summaries)
    numbers["comparison"] = {"rows": rows, "verdict": said, "dynamics": dyn}
    main = comparison_markdown(rows, k)
    ctrl = controller_markdown(summaries)
    if any(s.get("controller/kind") == "own" for s in summaries):  # a method's own law next to the autopilot
        numbers["comparison"]["controllers"] = ctrl
        main += ("\n## Which controller holds entropy (own law vs autopilot, mean ± std over seeds)\n\n" + ctrl)
    md = ("## Methods at equal entropy (mean ± std over seeds)\n\n" + main + "\n" + said + "\n\n"
          "## The law and the batch predictions of the entropy change\n\n" + dynamics_markdown(rows, LAW_COLUMNS)
          + "\n" + dynamics_markdown(rows, AGREEMENT_COLUMNS) + "\n"
          + dyn + "\n\n## Every figure per variant\n\n" + table)
    return md, main + "\n" + said
