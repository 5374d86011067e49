"""Issue 74's verdicts: the conditions A-E of docs/results-smollm2-cpu-long.md, judged on the committed runs of
``results/smollm2-cpu-long/`` exactly as that page fixed them before the runs, with the paired tests it names.

    python -m benchmarks.long_horizon [--results results/smollm2-cpu-long] [--json OUT.json] [--figures DIR]

Prints a markdown table per condition and the verdict (D's words); ``--json`` writes every number; ``--figures``
draws the curves with the design's windows (``curves.png``) and E's forecasts against the outcomes (``law.png``).
The code was
written and committed before any long-run result was committed. It refuses, in one line, to judge fewer runs than
the design's 12 finished ones: no condition is judged on part of them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("clip_v", "clip_b", "clip_cov")  # judged against GRPO ("none")
SEEDS = (0, 1, 2)
W = range(70, 101)  # the window of evaluations (and training steps) judged
M = range(40, 66)
LAW_STEPS = range(0, 31)
# The thresholds, as the page fixed them
A_ENTROPY, A_GAIN, A_LAST3 = 0.25, 0.03, 0.06
B_RATIO, B_FLOOR = 2.0, 0.5
C_MEAN, C_IMPROVING = 0.05, 0.03
E_WITHIN, E_RUNS = 0.05, 10


@dataclass(frozen=True)
class Run:
    """One run's series: pass@1 and pass@8 at T = 0.7 by evaluation step, ``entropy/mean`` by training step, the
    per-question correct counts by evaluation step, and the readings beside the conditions (``described``: each key
    of :data:`DESCRIBED` and :data:`BRIDGE_KEY`, by step)."""

    name: str
    pass1: dict[int, float]
    pass8: dict[int, float]
    entropy: dict[int, float]
    per_question: dict[int, list[int]]
    question_ids: list[str] | None
    described: dict[str, dict[int, float]]


DESCRIBED = ("eval/pass@1", "eval/pass@8", "eval/greedy_pass@1", "eval/maj@8", "eval/entropy", "eval/response_tokens")
BRIDGE_KEY = "eval_t1/pass@1"  # pass@1 at T = 1, evaluated up to step 20 in this design


def load(folder: Path) -> Run:
    """A run's rows from its ``metrics.jsonl`` (the main evaluation's keys, ``eval/``: T = 0.7 in this design)."""
    pass1, pass8, entropy, perq, ids = {}, {}, {}, {}, None
    described: dict[str, dict[int, float]] = {k: {} for k in (*DESCRIBED, BRIDGE_KEY)}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        s = int(row["step"])
        for k, series in described.items():
            if isinstance(row.get(k), (int, float)):
                series[s] = float(row[k])
        if isinstance(row.get("eval/pass@1"), (int, float)):
            pass1[s] = float(row["eval/pass@1"])
        if isinstance(row.get("eval/pass@8"), (int, float)):
            pass8[s] = float(row["eval/pass@8"])
        if isinstance(row.get("entropy/mean"), (int, float)):
            entropy[s] = float(row["entropy/mean"])
        if isinstance(row.get("eval/correct_per_question"), list):
            perq[s] = [int(c) for c in row["eval/correct_per_question"]]
        if isinstance(row.get("eval/question_ids"), list):
            ids = [str(q) for q in row["eval/question_ids"]]
    return Run(folder.name, pass1, pass8, entropy, perq, ids, described)


def window_mean(series: dict[int, float], steps: range) -> float:
    """The mean of ``series`` over its steps inside ``steps`` (nan when none is)."""
    vals = [v for s, v in series.items() if s in steps]
    return float(np.mean(vals)) if vals else math.nan


def law_entropy(run: Run, step: int) -> float:
    """The training entropy an evaluation at ``step`` is paired with: ``entropy/mean`` of the row at ``step``
    (``analysis.law.law_points(entropy="train")``'s rule); the step-0 evaluation, which has no training row, takes
    step 1's (the batch the same base policy sampled)."""
    return run.entropy[max(step, 1)]


def cond_a(grpo: Run) -> dict:
    """A, on one GRPO seed: mean training entropy over W <= 0.25; W-mean pass@1 - M-mean <= 0.03; the last three
    evaluations within 0.06 (max - min)."""
    h = window_mean(grpo.entropy, W)
    gain = window_mean(grpo.pass1, W) - window_mean(grpo.pass1, M)
    last = [grpo.pass1[s] for s in sorted(grpo.pass1)[-3:]]
    spread = max(last) - min(last)
    return {"run": grpo.name, "entropy_W": h, "gain_W_minus_M": gain, "last3_spread": spread,
            "holds": bool(h <= A_ENTROPY and gain <= A_GAIN and spread <= A_LAST3)}


def cond_b(clip_v: Run, grpo: Run) -> dict:
    """B, on one seed: ClipV's mean training entropy over W >= 2x GRPO's, and >= 0.5 nats."""
    hv, hg = window_mean(clip_v.entropy, W), window_mean(grpo.entropy, W)
    return {"seed_runs": [clip_v.name, grpo.name], "clip_v_entropy_W": hv, "grpo_entropy_W": hg,
            "holds": bool(hv >= B_RATIO * hg and hv >= B_FLOOR)}


def cond_c(method: Sequence[Run], grpo: Sequence[Run], key: str = "pass1") -> dict:
    """C for one method against GRPO, paired by seed: W-mean higher on every seed, by >= 0.05 on average, and
    the method still improving (W-mean - M-mean >= +0.03 on average over seeds). ``key``: pass1 (the verdict) or
    pass8 (the secondary reading, judged the same way)."""
    diffs = [window_mean(getattr(m, key), W) - window_mean(getattr(g, key), W) for m, g in zip(method, grpo)]
    improving = float(np.mean([window_mean(getattr(m, key), W) - window_mean(getattr(m, key), M) for m in method]))
    return {"diffs_by_seed": diffs, "mean_diff": float(np.mean(diffs)), "improving": improving,
            "holds": bool(all(d > 0 for d in diffs) and np.mean(diffs) >= C_MEAN and improving >= C_IMPROVING)}


def paired_questions(method: Sequence[Run], grpo: Sequence[Run], k: int = 8) -> dict:
    """Each question's W-mean correct share (over W's evaluations, out of ``k`` samples), method - GRPO, paired
    by question and seed (questions matched by id when both runs name them): the mean difference, a two-sided
    exact sign test over the non-zero differences and a paired t test."""
    from scipy import stats

    diffs: list[float] = []
    for m, g in zip(method, grpo):
        steps = [s for s in m.per_question if s in W and s in g.per_question]
        if not steps:
            continue
        share_m = np.mean([m.per_question[s] for s in steps], axis=0) / k
        share_g = np.mean([g.per_question[s] for s in steps], axis=0) / k
        if m.question_ids and g.question_ids and m.question_ids != g.question_ids:
            where = {q: i for i, q in enumerate(g.question_ids)}
            share_g = np.array([share_g[where[q]] if q in where else np.nan for q in m.question_ids])
        diffs += [float(d) for d in share_m - share_g if np.isfinite(d)]
    d = np.asarray(diffs)
    nonzero = d[d != 0]
    pos = int((nonzero > 0).sum())
    sign_p = float(stats.binomtest(pos, len(nonzero), 0.5).pvalue) if len(nonzero) else 1.0
    t = stats.ttest_1samp(d, 0.0) if len(d) > 1 and np.ptp(d) > 0 else None
    return {"pairs": len(d), "mean_diff": float(d.mean()) if len(d) else math.nan, "positive": pos,
            "negative": int((nonzero < 0).sum()), "sign_p": sign_p,
            "t": float(t.statistic) if t is not None else None, "t_p": float(t.pvalue) if t is not None else None}


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares of y = c0 + c1 x (float64)."""
    c1, c0 = np.polyfit(x, y, 1)
    return float(c0), float(c1)


def cond_e(run: Run) -> dict:
    """E on one run: the law R = -a e^H + b fitted on the evaluations at steps 0-30 (pass@1 against
    :func:`law_entropy`) forecasts the W-mean pass@1 from the mean training entropy over W within 0.05; the
    linear-in-H fit on the same points beside it."""
    steps = [s for s in sorted(run.pass1) if s in LAW_STEPS]
    h = np.array([law_entropy(run, s) for s in steps], dtype=np.float64)
    r = np.array([run.pass1[s] for s in steps], dtype=np.float64)
    h_w, r_w = window_mean(run.entropy, W), window_mean(run.pass1, W)
    c0, c1 = _fit(np.exp(h), r)  # R = b - a e^H: b = c0, a = -c1
    law = c0 + c1 * math.exp(h_w)
    l0, l1 = _fit(h, r)
    lin = l0 + l1 * h_w
    return {"run": run.name, "points": len(steps), "a": -c1, "b": c0, "forecast_law": law, "forecast_linear": lin,
            "actual_W": r_w, "law_holds": bool(abs(law - r_w) <= E_WITHIN),
            "linear_holds": bool(abs(lin - r_w) <= E_WITHIN)}


def outcome(a_holds: bool, b_holds: bool, c_holds: dict[str, bool]) -> str:
    """D: the outcome in the words the page named in advance."""
    if not a_holds:
        return "the regime was not reached; the design does not decide C"
    words = [f"reproduced for {m} at this setting" for m, ok in c_holds.items() if ok]
    if not b_holds:
        words.insert(0, "ClipV did not keep entropy at these settings; C for ClipV is not a test of the claim")
    if not any(c_holds.values()):
        words.append("not reproduced at 135M on arith1" if b_holds else "C holds for no method")
    return "; ".join(words)


def judge(runs: dict[str, Run]) -> dict:
    """Every condition on the 12 runs (``runs`` by folder name)."""
    grpo = [runs[f"none-s{s}"] for s in SEEDS]
    a = [cond_a(g) for g in grpo]
    b = [cond_b(runs[f"clip_v-s{s}"], runs[f"none-s{s}"]) for s in SEEDS]
    c = {m: cond_c([runs[f"{m}-s{s}"] for s in SEEDS], grpo) for m in METHODS}
    c8 = {m: cond_c([runs[f"{m}-s{s}"] for s in SEEDS], grpo, key="pass8") for m in METHODS}
    tests = {m: paired_questions([runs[f"{m}-s{s}"] for s in SEEDS], grpo) for m in METHODS}
    e = [cond_e(runs[f"{m}-s{s}"]) for s in SEEDS for m in ("none", *METHODS)]
    a_ok, b_ok = all(x["holds"] for x in a), all(x["holds"] for x in b)
    e_law = sum(x["law_holds"] for x in e)
    return {"A": {"seeds": a, "holds": a_ok}, "B": {"seeds": b, "holds": b_ok},
            "C": {m: {**v, "pass8": c8[m], "paired_questions": tests[m]} for m, v in c.items()},
            "D": outcome(a_ok, b_ok, {m: v["holds"] for m, v in c.items()}),
            "E": {"runs": e, "law_within": e_law, "linear_within": sum(x["linear_holds"] for x in e),
                  "holds": e_law >= E_RUNS}}


def _f(x: float | None, nd: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown(v: dict) -> str:
    """The verdict tables, for the page."""
    out = ["| GRPO run | entropy over W | W − M pass@1 | last-3 spread | A |", "|---|---|---|---|---|"]
    out += [f"| {x['run']} | {_f(x['entropy_W'])} | {_f(x['gain_W_minus_M'])} | {_f(x['last3_spread'])} | "
            f"{'holds' if x['holds'] else 'fails'} |" for x in v["A"]["seeds"]]
    out += ["", "| seed | ClipV entropy over W | GRPO entropy over W | B |", "|---|---|---|---|"]
    out += [f"| {s} | {_f(x['clip_v_entropy_W'])} | {_f(x['grpo_entropy_W'])} | {'holds' if x['holds'] else 'fails'} |"
            for s, x in zip(SEEDS, v["B"]["seeds"])]
    out += ["", "| method | W pass@1 − GRPO by seed | mean | W − M (method) | C | pass@8 by seed | questions: mean "
            "diff, +/−, sign p, t (p) |", "|---|---|---|---|---|---|---|"]
    for m, x in v["C"].items():
        q = x["paired_questions"]
        out.append(f"| {m} | {', '.join(_f(d) for d in x['diffs_by_seed'])} | {_f(x['mean_diff'])} | "
                   f"{_f(x['improving'])} | {'holds' if x['holds'] else 'fails'} | "
                   f"{', '.join(_f(d) for d in x['pass8']['diffs_by_seed'])} | {_f(q['mean_diff'])}, "
                   f"{q['positive']}/{q['negative']}, {_f(q['sign_p'])}, {_f(q['t'], 2)} ({_f(q['t_p'])}) |")
    out += ["", "| run | law forecast of W pass@1 | linear-in-H forecast | actual | law within 0.05 | linear within "
            "0.05 |", "|---|---|---|---|---|---|"]
    out += [f"| {x['run']} | {_f(x['forecast_law'])} | {_f(x['forecast_linear'])} | {_f(x['actual_W'])} | "
            f"{'yes' if x['law_holds'] else 'no'} | {'yes' if x['linear_holds'] else 'no'} |" for x in v["E"]["runs"]]
    out += ["", f"E: the law within 0.05 on {v['E']['law_within']} of {len(v['E']['runs'])} runs (needs "
            f"{E_RUNS}), the linear fit on {v['E']['linear_within']}: "
            + ("holds" if v["E"]["holds"] else "fails"), "", f"D: {v['D']}"]
    return "\n".join(out)


def described(runs: dict[str, Run]) -> dict[str, dict[str, tuple[float, float, float, float]]]:
    """Descriptive readings beside the conditions (none of them is judged): for each method and each key of
    :data:`DESCRIBED` (the main evaluation, T = 0.7; greedy pass@1 and maj@8 beside it), the mean and population
    std over seeds of each run's W-mean, then of its M-mean."""
    out: dict[str, dict[str, tuple[float, float, float, float]]] = {}
    for m in ("none", *METHODS):
        seeds = [runs[f"{m}-s{s}"] for s in SEEDS]
        out[m] = {}
        for k in DESCRIBED:
            w = [window_mean(r.described[k], W) for r in seeds]
            x = [window_mean(r.described[k], M) for r in seeds]
            out[m][k] = (float(np.mean(w)), float(np.std(w)), float(np.mean(x)), float(np.std(x)))
    return out


BRIDGED = ("none", "clip_v", "clip_cov")  # the methods whose settings the 20-step page shares (ClipB's mu differs)
BRIDGE_STEP = 20


def bridge(runs: dict[str, Run], short_dir: Path) -> list[dict]:
    """The bridge to the 20-step page: for each run of a method both pages train with the same settings, pass@1
    at T = 1 at step 20 here (:data:`BRIDGE_KEY`) and there (``eval/pass@1``, that page's only temperature). The
    two trained the same design on other CPUs (the difference is the trajectory noise between machines)."""
    out = []
    for m in BRIDGED:
        for s in SEEDS:
            here = runs[f"{m}-s{s}"].described[BRIDGE_KEY].get(BRIDGE_STEP)
            there = load(short_dir / f"{m}-s{s}").pass1.get(BRIDGE_STEP)
            out.append({"run": f"{m}-s{s}", "long_t1": here, "short_t1": there,
                        "diff": None if here is None or there is None else here - there})
    return out


METHOD_NAMES = {"none": "GRPO", "clip_v": "ClipV", "clip_b": "ClipB (mu 1.0)", "clip_cov": "Clip-Cov"}
COLORS = {"none": "#1f77b4", "clip_v": "#ff7f0e", "clip_b": "#2ca02c", "clip_cov": "#d62728"}


def method_curve(runs: Sequence[Run], key: str) -> tuple[list[int], list[float]]:
    """The mean over seeds of a series (``pass1`` or ``entropy``) at the steps every seed has."""
    steps = sorted(set.intersection(*(set(getattr(r, key)) for r in runs)))
    return steps, [float(np.mean([getattr(r, key)[s] for r in runs])) for s in steps]


def figures(runs: dict[str, Run], verdict: dict, out: Path) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """``curves.png``: pass@1 at T = 0.7 and training entropy by step, each seed thin and the method's mean over
    seeds thick, with M and W shaded and A's and B's thresholds drawn; ``law.png``: each run's forecast of its
    W-mean pass@1 (the law, and the linear fit) against the outcome, with E's band of 0.05. Returns the mean
    curves drawn (by panel and method)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from entropy_rft.report.plots import figure_png

    out.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, dict[str, tuple[list[int], list[float]]]] = {"pass1": {}, "entropy": {}}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for ax, key, title in ((axes[0], "pass1", "validation pass@1 at T = 0.7 (Avg@8, 32 questions)"),
                           (axes[1], "entropy", "training entropy (entropy/mean, nats)")):
        ax.axvspan(M.start, M.stop - 1, color="0.9", zorder=0)
        ax.axvspan(W.start, W.stop - 1, color="0.8", zorder=0)
        for m in ("none", *METHODS):
            seeds = [runs[f"{m}-s{s}"] for s in SEEDS]
            for r in seeds:
                xs = sorted(getattr(r, key))
                ax.plot(xs, [getattr(r, key)[x] for x in xs], color=COLORS[m], lw=0.6, alpha=0.35)
            drawn[key][m] = method_curve(seeds, key)
            ax.plot(*drawn[key][m], color=COLORS[m], lw=2, label=f"{METHOD_NAMES[m]} (mean of {len(SEEDS)} seeds)")
        ax.set_xlabel("step")
        ax.set_title(title, fontsize=10)
    axes[1].axhline(A_ENTROPY, color="k", ls=":", lw=1, label=f"A: GRPO at most {A_ENTROPY} over W")
    axes[1].axhline(B_FLOOR, color="k", ls="--", lw=1, label=f"B: ClipV at least {B_FLOOR} over W")
    axes[0].text(M.start + 1, 0.95, "M", transform=axes[0].get_xaxis_transform())
    axes[0].text(W.start + 1, 0.95, "W", transform=axes[0].get_xaxis_transform())
    axes[0].legend(fontsize=8, loc="lower right")
    axes[1].legend(fontsize=8, loc="upper right")
    (out / "curves.png").write_bytes(figure_png(fig))

    fig, ax = plt.subplots(figsize=(6.2, 5))
    e = verdict["E"]["runs"]
    actual = [x["actual_W"] for x in e]
    lo, hi = min(actual) - 0.15, max(actual) + 0.15
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.8)
    ax.fill_between([lo, hi], [lo - E_WITHIN, hi - E_WITHIN], [lo + E_WITHIN, hi + E_WITHIN], color="0.88",
                    label=f"within {E_WITHIN} (E)")
    for x in e:
        m = x["run"].rsplit("-s", 1)[0]
        ax.scatter(x["actual_W"], x["forecast_law"], color=COLORS.get(m, "k"), marker="o", s=30)
        ax.scatter(x["actual_W"], x["forecast_linear"], color=COLORS.get(m, "k"), marker="x", s=30)
    for m in ("none", *METHODS):
        ax.scatter([], [], color=COLORS[m], marker="s", label=METHOD_NAMES[m])
    ax.scatter([], [], color="0.3", marker="o", label="the law R = -a e^H + b")
    ax.scatter([], [], color="0.3", marker="x", label="linear in H")
    ax.set_xlabel("W-mean pass@1 (outcome)")
    ax.set_ylabel("forecast from the fit on steps 0-30")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(lo, *(x["forecast_law"] for x in e)) - 0.02, max(hi, *(x["forecast_law"] for x in e)) + 0.02)
    ax.legend(fontsize=8, loc="upper left")
    (out / "law.png").write_bytes(figure_png(fig))
    return drawn


def _status(folder: Path) -> str | None:
    try:
        return json.loads((folder / "run.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "results" / "smollm2-cpu-long")
    p.add_argument("--json", type=Path, help="Write every number here.")
    p.add_argument("--figures", type=Path, help="Draw curves.png and law.png into this folder.")
    p.add_argument("--bridge", type=Path, metavar="SHORT_RESULTS",
                   help="Also compare pass@1 at T = 1 at step 20 with the 20-step page's runs in this folder "
                        "(results/smollm2-cpu).")
    args = p.parse_args(argv)
    wanted = [f"{m}-s{s}" for s in SEEDS for m in ("none", *METHODS)]
    missing = [n for n in wanted if _status(args.results / n) != "finished"]
    if missing:
        print(f"long_horizon: {len(missing)} of the design's 12 runs are not finished in {args.results} "
              f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); the conditions are judged "
              "on all 12 only: `make run-real-cpu-long` trains the rest", file=sys.stderr)
        return 2
    runs = {n: load(args.results / n) for n in wanted}
    verdict = judge(runs)
    print(markdown(verdict))
    if args.figures:
        figures(runs, verdict, args.figures)
    desc = described(runs)
    print("\nDescriptive, not conditions: W-mean (M-mean), mean ± std over the 3 seeds\n")
    print("| method | " + " | ".join(k.removeprefix("eval/") for k in DESCRIBED) + " |")
    print("|---|" + "---|" * len(DESCRIBED))
    for m, v in desc.items():
        print(f"| {m} | " + " | ".join(f"{_f(w)} ± {_f(ws)} ({_f(x)})" for w, ws, x, _ in v.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps({**verdict, "described": desc}, indent=1) + "\n")
    if args.bridge:
        rows = bridge(runs, args.bridge)
        print("\n| run | pass@1 at T = 1, step 20, here | on the 20-step page | difference |\n|---|---|---|---|")
        print("\n".join(f"| {r['run']} | {_f(r['long_t1'])} | {_f(r['short_t1'])} | {_f(r['diff'])} |" for r in rows))
        diffs = [abs(r["diff"]) for r in rows if r["diff"] is not None]
        if diffs:
            print(f"\nmean absolute difference {_f(float(np.mean(diffs)))}, largest {_f(max(diffs))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
