"""The entropy-performance law of Cui et al. 2025 (arXiv 2505.22617): R = −a·exp(H) + b.

R is validation performance, H the policy entropy, both measured at the same step of one run. The law
is linear in its parameters (a, b): with x = exp(H), R = a·(−x) + b. So the least-squares fit is the
ordinary linear least-squares problem on the design matrix [−exp(H), 1], solved in closed form with
``numpy.linalg.lstsq``. No iterative optimiser (``scipy.optimize.curve_fit``) is needed; it would converge
to the same (a, b).

The predicted ceiling — the performance at zero entropy — is R(0) = b − a.

Forecast test (Paper B fits on the first ~36 of 200+ steps and reports ~1% RMSE): fit on the points whose
step is at most ``fit_frac`` of the last step, and report the RMSE of predicting the remaining points.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from entropy_rft.common.errors import UserError
from entropy_rft.rundir.files import read_step_log

ENTROPY_SOURCES = ("eval", "train")
# Above this entropy exp(H) is within a factor of e^10 of float64's overflow (709.78): not a per-token entropy.
MAX_LAW_ENTROPY = 700.0


@dataclass
class LawFit:
    """R = −a·exp(H) + b, fitted by linear least squares on [−exp(H), 1]."""

    a: float
    b: float
    ceiling: float  # b − a: the predicted performance at H = 0
    r2: float | None  # None when R is constant (no variance to explain)
    rmse: float  # in-sample
    n: int

    def predict(self, entropy: Sequence[float] | np.ndarray) -> np.ndarray:
        return -self.a * np.exp(np.asarray(entropy, dtype=np.float64)) + self.b

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_law(entropy: Sequence[float] | np.ndarray, perf: Sequence[float] | np.ndarray, *, what: str = "points",
            min_points: int = 3) -> LawFit:
    """Least-squares fit of R = −a·exp(H) + b. ``what`` names the data in error messages.

    Two points determine (a, b) exactly, so a fit that is meant to be judged needs ``min_points`` >= 3;
    the forecast test accepts 2 (its judgement is the held-out error). R² is None with 2 points.
    """
    h = np.asarray(entropy, dtype=np.float64).ravel()
    r = np.asarray(perf, dtype=np.float64).ravel()
    if h.shape != r.shape:
        raise UserError(f"{what}: entropy and accuracy have different lengths ({h.size} vs {r.size})")
    if not (np.all(np.isfinite(h)) and np.all(np.isfinite(r))):
        raise UserError(f"{what}: entropy and accuracy must be finite numbers (found NaN/inf)")
    if h.size < max(2, min_points):
        raise UserError(f"{what}: need at least {max(2, min_points)} (entropy, accuracy) points to fit "
                        f"R = -a*exp(H) + b, got {h.size}; evaluate more often (eval.every) or train longer")
    if h.max() > MAX_LAW_ENTROPY:  # exp(H) overflows float64 near 709.8: no least squares can use it
        raise UserError(f"{what}: the entropy reaches {h.max():.6g} nats, beyond {MAX_LAW_ENTROPY:g} where exp(H) "
                        "overflows; the law needs the mean per-token entropy (at most ln(vocabulary size), ~12 "
                        "nats), and this series is likely a summed or per-sequence entropy: name the per-token one "
                        "(--entropy-key KEY)")
    x = np.exp(h)
    if np.ptp(x) <= 1e-12 * max(1.0, float(np.abs(x).max())):
        raise UserError(f"{what}: entropy is constant ({h[0]:.6g}) across all {h.size} points, so a and b "
                        "cannot be told apart; fit a run whose entropy changes")
    design = np.stack([-x, np.ones_like(x)], axis=1)
    try:
        (a, b), *_ = np.linalg.lstsq(design, r, rcond=None)
    except np.linalg.LinAlgError as e:
        raise UserError(f"{what}: the least-squares fit of R = -a*exp(H) + b failed ({e}); the entropy spans "
                        f"{h.min():.6g} to {h.max():.6g} nats: is it the mean per-token entropy?") from None
    resid = r - (design @ np.array([a, b]))
    ss_res = float(resid @ resid)
    ss_tot = float(((r - r.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 and h.size > 2 else None
    return LawFit(a=float(a), b=float(b), ceiling=float(b - a), r2=r2,
                  rmse=math.sqrt(ss_res / h.size), n=int(h.size))


# Fewer evaluation points than this and a fit is flagged "not reliable" (report panel, report.json, fit-law).
# Why 8: the law has two parameters, so n points leave n - 2 residual degrees of freedom, and a high R² on few
# points is cheap. Under pure noise the R² of a one-regressor fit (here on x = exp(H)) exceeds the two-sided 5%
# critical value r_crit² — 0.90 at n = 4, 0.66 at n = 6, 0.50 at n = 8 (r_crit = 0.950, 0.811, 0.707) — so
# below 8 points even R² ≈ 0.6–0.9 does not separate the law from noise. Paper B's forecast fits use ~36
# evaluations; 8 is the smallest n at which a moderate R² (> 0.5) means something at the 5% level.
MIN_RELIABLE_POINTS = 8


def reliability_warning(n: int, min_points: int = MIN_RELIABLE_POINTS) -> str | None:
    """``"fit on 4 points: not reliable"`` when ``n`` is below ``min_points``; None otherwise."""
    if n >= min_points:
        return None
    return f"fit on {n} point{'s' if n != 1 else ''}: not reliable (fewer than {min_points} evaluations)"


@dataclass
class Forecast:
    fit: LawFit
    fit_frac: float
    cutoff_step: float
    fit_steps: list[int]
    test_steps: list[int]
    test_rmse: float
    test_mae: float
    predicted: list[float]
    actual: list[float]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fit"] = self.fit.to_dict()
        return d


def forecast(steps: Sequence[int], entropy: Sequence[float], perf: Sequence[float], fit_frac: float = 0.2,
             *, what: str = "points") -> Forecast:
    """Fit on points with step <= fit_frac · max(step); RMSE of the prediction on the rest."""
    if not 0 < fit_frac < 1:
        raise UserError(f"--fit-frac must be in (0, 1), got {fit_frac}")
    s = np.asarray(steps, dtype=np.float64)
    h = np.asarray(entropy, dtype=np.float64)
    r = np.asarray(perf, dtype=np.float64)
    if s.size == 0:
        raise UserError(f"{what}: no (entropy, accuracy) points")
    cutoff = fit_frac * float(s.max())
    head = s <= cutoff
    tail = ~head
    if not tail.any():
        raise UserError(f"{what}: no points after step {cutoff:g} to forecast; raise the number of evaluations")
    if head.sum() < 2:
        raise UserError(f"{what}: only {int(head.sum())} point(s) at or before step {cutoff:g} "
                        f"(--fit-frac {fit_frac}); need 2 to fit. Raise --fit-frac or evaluate more often")
    fit = fit_law(h[head], r[head], what=f"{what} (first {fit_frac:.0%} of steps)", min_points=2)
    pred = fit.predict(h[tail])
    err = pred - r[tail]
    return Forecast(fit=fit, fit_frac=fit_frac, cutoff_step=cutoff,
                    fit_steps=[int(v) for v in s[head]], test_steps=[int(v) for v in s[tail]],
                    test_rmse=float(np.sqrt(np.mean(err ** 2))), test_mae=float(np.mean(np.abs(err))),
                    predicted=[float(v) for v in pred], actual=[float(v) for v in r[tail]])


FORECAST_FRACS = (0.1, 0.2, 0.4)


def forecast_final(steps: Sequence[int], entropy: Sequence[float], perf: Sequence[float],
                   fracs: Sequence[float] = FORECAST_FRACS) -> dict[str, float | None]:
    """The law's forecast of the last evaluation's accuracy from the first ``frac`` of the steps, per frac.

    Paper B's test: fit on the early points only, then predict the final accuracy from the final entropy.
    Returns ``law/forecast_err@10%`` = predicted − actual at the last evaluation (accuracy units, so 0.01 is one
    point of pass@1) and ``law/forecast_rmse@10%`` over every later evaluation; None where the head holds fewer
    than 2 points at distinct entropies or nothing comes after it.
    """
    out: dict[str, float | None] = {}
    for frac in fracs:
        tag = f"{round(100 * frac)}%"
        try:
            fc = forecast(steps, entropy, perf, frac)
        except UserError:
            out[f"law/forecast_err@{tag}"] = out[f"law/forecast_rmse@{tag}"] = None
            continue
        out[f"law/forecast_err@{tag}"] = fc.predicted[-1] - fc.actual[-1]
        out[f"law/forecast_rmse@{tag}"] = fc.test_rmse
    return out


def run_law(rows: Sequence[dict]) -> dict[str, float | int | None]:
    """One run's law figures for summaries: ``law/a``, ``law/b``, ``law/ceiling`` (b − a), ``law/r2``,
    ``law/points`` and the forecasts of ``forecast_final``; None where the run cannot be fitted."""
    keys = ("law/a", "law/b", "law/ceiling", "law/r2")
    out: dict[str, float | int | None] = dict.fromkeys(keys)
    try:
        steps, hs, rs = law_points(rows)
    except UserError:
        steps, hs, rs = [], [], []
    out["law/points"] = len(steps)
    try:
        fit = fit_law(hs, rs)
        out.update({"law/a": fit.a, "law/b": fit.b, "law/ceiling": fit.ceiling, "law/r2": fit.r2})
    except UserError:
        pass
    out.update(forecast_final(steps, hs, rs))
    return out


def _perf_key(row: dict, metric: str) -> str | None:
    if metric == "pass@1":
        return "eval/pass@1"
    if metric == "avg@K":
        return next((k for k in row if k.startswith("eval/avg@")), None)
    return f"eval/{metric}"


def law_points(rows: Sequence[dict], *, entropy: str = "eval", metric: str = "pass@1",
               what: str = "metrics.jsonl") -> tuple[list[int], list[float], list[float]]:
    """(steps, entropies, accuracies) at the evaluation steps of one run's metrics rows.

    ``entropy="eval"`` uses ``eval/entropy`` (entropy of the policy's validation samples); ``"train"``
    uses the training batch's ``entropy/mean`` logged at the same step (step 0 has none and is skipped).
    Rows whose entropy or accuracy is null are skipped.
    """
    if entropy not in ENTROPY_SOURCES:
        raise UserError(f"--entropy must be one of {', '.join(ENTROPY_SOURCES)}, got {entropy!r}")
    if not metric.strip():
        raise UserError("--metric is empty; give pass@1 (the default), avg@K, or an eval/ metric of the run "
                        "such as pass@8")
    steps, hs, rs = [], [], []
    seen_metric = False
    for row in rows:
        key = _perf_key(row, metric)
        if key is None or key not in row:
            continue
        seen_metric = True
        h = row.get("eval/entropy") if entropy == "eval" else row.get("entropy/mean")
        r = row.get(key)
        if isinstance(h, (int, float)) and isinstance(r, (int, float)) and math.isfinite(h) and math.isfinite(r):
            steps.append(int(row.get("step", 0)))  # an integer >= 0 in rows of rundir.read_step_log
            hs.append(float(h))
            rs.append(float(r))
    if not seen_metric:
        have = eval_metrics(rows)
        if have:
            shown = ", ".join(have[:6]) + (", ..." if len(have) > 6 else "")
            raise UserError(f"{what}: --metric {metric!r} is not among the run's evaluation metrics; pick one of "
                            f"{shown} (or avg@K)")
        raise UserError(f"{what}: no evaluation rows (no eval/{metric}, nor any other eval/ metric); train with "
                        "eval.every > 0")
    return steps, hs, rs


def eval_metrics(rows: Sequence[dict]) -> list[str]:
    """The --metric values a run's rows hold: the suffixes of their numeric ``eval/`` keys (eval/entropy is H,
    not R), pass@1 first."""
    keys: dict[str, None] = {}
    for row in rows:
        for k, v in row.items():
            if (k.startswith("eval/") and k != "eval/entropy" and isinstance(v, (int, float))
                    and not isinstance(v, bool)):
                keys[k[5:]] = None
    return sorted(keys, key=lambda m: (m != "pass@1", m))


def fit_run(run_dir: str | Path, *, fit_frac: float = 0.2, entropy: str = "eval",
            metric: str = "pass@1") -> dict[str, Any]:
    """Full fit and forecast test for one run directory; forecast is None (with a reason) when impossible."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not os.path.lexists(path):
        raise UserError(f"{path}: not found; give a run directory written by erft train")
    rows = read_step_log(path)  # refuses a folder or a file of damaged lines; warns about each damaged line
    if not rows:
        raise UserError(f"{path}: empty; the run has not logged a step yet")
    steps, hs, rs = law_points(rows, entropy=entropy, metric=metric, what=str(path))
    return {"run": str(run_dir), "entropy": entropy, "metric": metric,
            **fit_and_forecast(steps, hs, rs, fit_frac, str(path))}


def fit_and_forecast(steps: Sequence[int], hs: Sequence[float], rs: Sequence[float], fit_frac: float,
                     what: str) -> dict[str, Any]:
    """The law fitted to (H, R) pairs at ``steps``, its reliability warning, the pairs, the last score's
    forecasts (``forecast_final``) and the forecast test at ``fit_frac`` (None with the reason when impossible)."""
    fit = fit_law(hs, rs, what=what)
    out: dict[str, Any] = {"fit": fit.to_dict(), "warning": reliability_warning(fit.n),
                           "points": {"step": list(steps), "entropy": list(hs), "accuracy": list(rs)},
                           "final_forecast": forecast_final(steps, hs, rs)}
    try:
        out["forecast"] = forecast(steps, hs, rs, fit_frac, what=what).to_dict()
        out["forecast_error"] = None
    except UserError as e:
        if not 0 < fit_frac < 1:
            raise
        out["forecast"], out["forecast_error"] = None, str(e)
    return out
