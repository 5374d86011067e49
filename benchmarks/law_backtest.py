"""Backtest of the last score's forecast and its prediction interval (issue 75): how often does the nominal
interval hold the final score?

For each run and fit fraction, the law R = -a*exp(H) + b and the baseline R = c + d*H are fitted on the
evaluations at steps <= frac * the last step, the last evaluation's score is forecast from its entropy with the
OLS prediction interval (``entropy_rft.analysis.interval``), and the table reports per form and fraction the runs
with an interval (3 early points at least), the share whose final score fell inside (coverage), the mean error
(predicted - actual), the mean absolute error and the mean interval width.

    python -m benchmarks.law_backtest results/smollm2-cpu --fracs 0.2,0.4,0.6,0.8 --level 0.9 --out backtest.json

RUN arguments are erft run directories, folders of them, or other engines' logs (as ``erft fit-law`` reads them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from entropy_rft.analysis.interval import FORMS, final_forecasts
from entropy_rft.common.errors import UserError


def run_points(path: Path) -> tuple[str, list[int], list[float], list[float]]:
    """(name, steps, entropies, scores) of one run: an erft run by its eval entropy and pass@1, another
    engine's log by ``analysis.byo``'s keys."""
    from entropy_rft.analysis.engine_logs import is_erft_path

    if is_erft_path(path):
        from entropy_rft.analysis.law import law_points
        from entropy_rft.rundir.files import read_step_log

        steps, hs, rs = law_points(read_step_log(path / "metrics.jsonl"), what=str(path / "metrics.jsonl"))
        return path.name, steps, hs, rs
    from entropy_rft.analysis.byo import choose_keys, paired_points
    from entropy_rft.analysis.engine_logs import read_engine_log

    log = read_engine_log(path)
    steps, hs, rs = paired_points(log, choose_keys(log))
    return path.name, steps, hs, rs


def expand(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        subs = sorted(d for d in p.iterdir() if (d / "metrics.jsonl").is_file()) if p.is_dir() else []
        out.extend(subs if subs and not (p / "metrics.jsonl").is_file() else [p])
    return out


def backtest(paths: list[Path], fracs: list[float], level: float) -> dict:
    """Every run's forecasts per fraction, and per form and fraction the coverage and errors."""
    runs = [run_points(p) for p in paths]
    per_run: list[dict] = []
    summary: list[dict] = []
    for frac in fracs:
        rows = []
        for name, steps, hs, rs in runs:
            try:
                rows.append({"run": name, "frac": frac, **final_forecasts(steps, hs, rs, frac, level, what=name)})
            except UserError as e:
                rows.append({"run": name, "frac": frac, "skipped": str(e)})
        per_run += rows
        done = [r for r in rows if "skipped" not in r]
        for form in FORMS:
            ivs = [r[form] for r in done]
            k = len(ivs)
            summary.append({
                "form": form, "frac": frac, "runs": len(rows), "with_interval": k,
                "fit_points": sorted({len(r["fit_steps"]) for r in done}),
                "covered": sum(iv["covered"] for iv in ivs),
                "coverage": sum(iv["covered"] for iv in ivs) / k if k else None,
                "mean_error": sum(iv["error"] for iv in ivs) / k if k else None,
                "mean_abs_error": sum(abs(iv["error"]) for iv in ivs) / k if k else None,
                "mean_width": sum(iv["high"] - iv["low"] for iv in ivs) / k if k else None,
                "too_low": sum(iv["error"] < 0 for iv in ivs),
                "better_early_fit": sum(r["better_early_fit"] == form for r in done)})
    return {"level": level, "fracs": fracs, "runs": [str(p) for p in paths], "summary": summary,
            "per_run": per_run}


def _n(v: float | None, sign: str = "") -> str:
    return "–" if v is None else format(v, f"{sign}.3f")


def markdown(res: dict) -> str:
    lines = [f"| form | fit on | runs with an interval | fit points | {res['level']:.0%} interval held the final "
             "score | mean error (pred − actual) | mean abs error | mean width | forecast too low | fits the early "
             "points better |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in res["summary"]:
        cov = "–" if s["coverage"] is None else f"{s['covered']}/{s['with_interval']} ({s['coverage']:.0%})"
        lines.append(f"| {s['form']} | first {s['frac']:.0%} | {s['with_interval']}/{s['runs']} | "
                     f"{','.join(map(str, s['fit_points'])) or '–'} | {cov} | {_n(s['mean_error'], '+')} | "
                     f"{_n(s['mean_abs_error'])} | {_n(s['mean_width'])} | {s['too_low']} | "
                     f"{s['better_early_fit']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="RUN")
    ap.add_argument("--fracs", default="0.2,0.4,0.6,0.8")
    ap.add_argument("--level", type=float, default=0.9)
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    try:
        fracs = [float(f) for f in args.fracs.split(",")]
        res = backtest(expand(args.runs), fracs, args.level)
    except (UserError, ValueError, OSError) as e:
        print(f"law_backtest: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
