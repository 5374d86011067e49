"""``erft fit-law``: fit Paper B's entropy-performance law R = −a·exp(H) + b to one run, and test its forecast."""

from __future__ import annotations

import argparse
from pathlib import Path

from entropy_rft.common.errors import UserError

NAME = "fit-law"
HELP = ("Fit the entropy-performance law R = -a*exp(H) + b (Cui et al. 2025) to a run's (entropy, validation "
        "accuracy) pairs; report a, b, the ceiling b - a, R^2, and the forecast error from the first steps. Reads "
        "erft runs and verl / TRL / TensorBoard / table logs.")
SOURCES = ("verl-console", "verl-file", "trl", "tensorboard", "table")  # analysis.engine_logs.SOURCES (no torch)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="A run directory written by erft train, or another engine's run as it lies on disk: verl's "
                        "console log or file-logger JSONL, a TRL output_dir or checkpoint folder, TensorBoard event "
                        "files, or a CSV/JSONL table with a step column (a W&B or MLflow export).")
    p.add_argument("--source", choices=SOURCES,
                   help="Read RUN_DIR as this kind of log instead of detecting it from the path.")
    p.add_argument("--entropy-key", metavar="KEY",
                   help="Another engine's run: the policy-entropy key (default: actor/entropy, actor/entropy_loss, "
                        "entropy or train/entropy, the first logged).")
    p.add_argument("--fit-frac", type=float, default=0.2,
                   help="Forecast test: fit on evaluations at steps <= this fraction of the last step, "
                        "report the RMSE on the rest (Paper B: ~1%% RMSE on real models). Default 0.2.")
    p.add_argument("--entropy", choices=("eval", "train"), default="eval",
                   help="H: 'eval' = entropy of the validation samples (eval/entropy), 'train' = the training "
                        "batch's entropy/mean at the same step.")
    p.add_argument("--metric", default=None,
                   help="R: for an erft run 'pass@1' (default), 'avg@K', or any eval/ key suffix such as pass@8; for "
                        "another engine's run the validation key (default: verl's val-core/<data>/acc|reward/"
                        "mean@N or val/test_score/<data>, TRL's eval_reward; with several, the first, named).")
    p.add_argument("--level", type=float, default=0.9,
                   help="The nominal level of the last score's prediction interval, for the law and for the "
                        "baseline linear in H, both fitted on the --fit-frac head (default 0.9). Its measured "
                        "coverage on the project's runs: docs/your-own-run.md.")
    p.add_argument("--json", metavar="FILE", help="Also write the fit and forecast as JSON.")


def say(line: str) -> None:
    """Print one line of the report: keys, paths and notes come from a foreign log, so their control characters
    are shown, not obeyed (``common.text.visible``)."""
    from entropy_rft.common.text import visible

    print(visible(line), flush=True)


def _f(v: float | None, fmt: str = ".4f") -> str:
    if v is None:
        return "–"
    text = format(v, fmt)
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.0000"


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not args.run_dir.strip():
        raise UserError("RUN_DIR is empty; give a run directory written by erft train")
    if not run_dir.exists():
        raise UserError(f"{run_dir}: no such run directory or log file")
    if not 0 < args.fit_frac < 1:  # also NaN
        raise UserError(f"--fit-frac must be in (0, 1), got {args.fit_frac}")
    if not 0 < args.level < 1:
        raise UserError(f"--level must be in (0, 1), got {args.level}")
    if args.json is not None:
        from entropy_rft.training import preflight

        preflight.check_out_file(args.json, "--json")
    from entropy_rft.analysis.engine_logs import detect, is_erft_path

    erft = args.source is None and is_erft_path(run_dir)
    if not erft and args.source is None:
        detect(run_dir)  # an unrecognised file: its one line before torch loads
    from entropy_rft.analysis.byo import fit_engine_log
    from entropy_rft.analysis.law import fit_run
    from entropy_rft.rundir.files import atomic_write_json, forget_warnings

    forget_warnings()  # each damaged line of metrics.jsonl: one warning in this command
    if erft:
        if args.entropy_key is not None:
            raise UserError("--entropy-key names another engine's key; for an erft run use --entropy eval|train")
        metric = "pass@1" if args.metric is None else args.metric
        res = fit_run(run_dir, fit_frac=args.fit_frac, entropy=args.entropy, metric=metric)
        say(f"entropy-performance law for {run_dir}  (R = {metric}, H = {args.entropy} entropy)")
    else:
        res = fit_engine_log(run_dir, source=args.source, entropy_key=args.entropy_key, metric=args.metric,
                             fit_frac=args.fit_frac)
        say(f"entropy-performance law for {res['note']}")
    fit = res["fit"]
    say(f"  R = -a*exp(H) + b, linear least squares on [-exp(H), 1] over {fit['n']} evaluations")
    say(f"  a = {_f(fit['a'])}   b = {_f(fit['b'])}   ceiling b - a = {_f(fit['ceiling'])}   "
          f"R^2 = {_f(fit['r2'])}   RMSE = {_f(fit['rmse'])}")
    if res.get("warning"):
        say(f"  warning: {res['warning']}")
    fc = res["forecast"]
    if fc is None:
        say(f"  forecast test: not possible: {res['forecast_error']}")
    else:
        say(f"  forecast test: fit on steps {fc['fit_steps']} (<= {fc['cutoff_step']:g}), "
              f"a = {_f(fc['fit']['a'])}, b = {_f(fc['fit']['b'])}")
        say(f"    predicting steps {fc['test_steps']}: RMSE = {_f(fc['test_rmse'])}, "
              f"MAE = {_f(fc['test_mae'])} (accuracy units; Paper B reports ~0.01 on real models)")
    ff = res["final_forecast"]
    say("  the last evaluation forecast from the first 10% / 20% / 40% of steps (predicted - actual): "
          + " / ".join(_f(ff[f"law/forecast_err@{p}"]) for p in ("10%", "20%", "40%")))
    _intervals(res, args, str(run_dir / "metrics.jsonl") if erft else str(run_dir))
    if args.json:
        atomic_write_json(args.json, res)
        say(f"  written to {args.json}")
    return 0


def _intervals(res: dict, args: argparse.Namespace, what: str) -> None:
    """The last score forecast by the law and by the linear-in-H baseline, fitted on the --fit-frac head, with
    their prediction intervals (``analysis.interval``); printed, and kept in ``res`` for --json."""
    from entropy_rft.analysis.interval import FORM_TEXT, FORMS, final_forecasts

    pts = res["points"]
    try:
        res["interval_forecast"] = fc = final_forecasts(pts["step"], pts["entropy"], pts["accuracy"],
                                                        args.fit_frac, args.level, what=what)
        res["interval_error"] = None
    except UserError as e:
        res["interval_forecast"], res["interval_error"] = None, str(e)
        say(f"  the last score with a {args.level:.0%} prediction interval: not possible: {e}")
        return
    say(f"  the last score (step {fc['final_step']}, from its entropy {fc['final_entropy']:.4f}) with a "
        f"{fc['level']:.0%} prediction interval, fitted on steps {fc['fit_steps']}; actual {_f(fc['actual'])}:")
    for form in FORMS:
        iv = fc[form]
        say(f"    {form:<6} {FORM_TEXT[form]:<17} {_f(iv['predicted'])} [{_f(iv['low'])}, {_f(iv['high'])}]  "
            f"error {_f(iv['error'])}  {'inside' if iv['covered'] else 'OUTSIDE'}  (early RSS {iv['ss_res']:.3g}, "
            f"{iv['dof']} residual dof)")
    better = fc["better_early_fit"]
    say("  on the early points " + ("both forms fit equally well" if better == "tie" else
                                   f"the {'law' if better == 'law' else 'linear baseline'} fits better (smaller "
                                   "residual sum of squares, both with two parameters)"))
