"""The last score's forecast with a prediction interval, for the law and for a baseline linear in H (issue 75).

Both forms are a straight line in one regressor: the law R = −a·exp(H) + b is R = b − a·x with x = exp(H), the
baseline R = c + d·H is the same with x = H. Fitted by ordinary least squares on the n early evaluations
(x_i, R_i), the classical prediction interval for a new observation R_0 at a known x_0 is (e.g. Montgomery, Peck
& Vining, *Introduction to Linear Regression Analysis*, §2.5; Draper & Smith §1.4)

    R̂_0 ± t_{1−α/2, n−2} · s · sqrt(1 + 1/n + (x_0 − x̄)² / S_xx),

with R̂_0 = β̂_0 + β̂_1·x_0, S_xx = Σ (x_i − x̄)², s² = Σ (R_i − R̂_i)² / (n − 2) and t the Student quantile with
n − 2 degrees of freedom (``t_quantile``). It needs n ≥ 3 (one residual degree of freedom) and S_xx > 0.

Which x_0. ``analysis.law.forecast_final`` forecasts the last evaluation's score from the *last evaluation's
entropy*, which it reads from the run (Paper B's test); the interval keeps that definition. Given x_0, the
prediction interval for a new observation is the right one: it holds the fit's uncertainty (1/n and the leverage
(x_0 − x̄)²/S_xx) and the score's own scatter about the line (the 1). It does not hold any uncertainty about
the final entropy itself: mid-run, with the final entropy still to come, the interval is conditional on it.
It assumes the form is right and the residuals independent, equal in spread and normal; whether it holds the
final score as often as it says is measured, not assumed: ``benchmarks/law_backtest.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from entropy_rft.common.errors import UserError

FORMS = ("law", "linear")  # R = -a*exp(H) + b; R = c + d*H
FORM_TEXT = {"law": "R = -a*exp(H) + b", "linear": "R = c + d*H"}
DEFAULT_LEVEL = 0.9


@dataclass
class Interval:
    """One form's forecast at x_0 with its prediction interval, and its fit on the early points."""

    form: str
    intercept: float  # β̂_0: b for the law, c for the linear baseline
    slope: float  # β̂_1: −a for the law, d for the linear baseline
    predicted: float
    low: float
    high: float
    level: float
    n: int
    dof: int
    s: float  # residual standard deviation, sqrt(SSR / (n − 2))
    ss_res: float  # the early fit's residual sum of squares
    leverage: float  # 1/n + (x_0 − x̄)² / S_xx

    def covers(self, value: float) -> bool:
        return self.low <= value <= self.high

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def regularized_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz; Press et
    al., *Numerical Recipes*, 3rd ed., §6.4, eq. 6.4.5), on the side of ``(a + 1)/(a + b + 2)`` where it converges
    fast, using I_x(a, b) = 1 − I_{1−x}(b, a) on the other. float64; relative error about 1e-15."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"regularized_beta: x must be in [0, 1], got {x}")
    if x == 0.0 or x == 1.0:
        return x
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    tiny, eps = 1e-300, 1e-16
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),  # the even step d_{2m}
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # the odd step d_{2m+1}
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return front * f / a


def t_quantile(p: float, dof: int) -> float:
    """The Student t quantile t_{p, dof}: the t with P(T ≤ t) = p for T ~ t(dof) (what ``scipy.stats.t.ppf``
    gives; here without scipy, which a verl environment need not have). With x = dof/(dof + t²), the two tails
    beyond ±t hold I_x(dof/2, ½) together (Abramowitz & Stegun 26.7.1 with 26.5.27), the middle I_{1−x}(½, dof/2).
    The x (tails: 2·min(p, 1 − p)) or y = 1 − x (middle: |2p − 1|) whichever is the smaller is found by bisection,
    to a relative precision near float64's, then t = ±sqrt(dof·(1 − x)/x)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if dof < 1:
        raise ValueError(f"t_quantile: dof must be at least 1, got {dof}")
    if p == 0.5:
        return 0.0
    tails, middle = 2.0 * min(p, 1.0 - p), abs(2.0 * p - 1.0)
    a, b, target = (dof / 2.0, 0.5, tails) if tails < middle else (0.5, dof / 2.0, middle)
    lo, hi = 0.0, 1.0  # I_z(a, b) rises with z
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi) or hi - lo <= 1e-17 * hi:
            break
        if regularized_beta(mid, a, b) < target:
            lo = mid
        else:
            hi = mid
    z = 0.5 * (lo + hi)
    t = math.sqrt(dof * (1.0 - z) / z) if tails < middle else math.sqrt(dof * z / (1.0 - z))
    return t if p > 0.5 else -t


def prediction_interval(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, x0: float,
                        level: float = DEFAULT_LEVEL, *, form: str = "line", what: str = "points") -> Interval:
    """OLS of y on [1, x] (float64) and the prediction interval of a new y at ``x0`` (the module docstring's
    formula). ``what`` names the data in the one-line refusals: fewer than 3 points, x without spread, a value
    not finite, a level outside (0, 1)."""
    if not 0 < level < 1:  # also NaN
        raise UserError(f"--level must be in (0, 1), got {level}")
    xs = np.asarray(x, dtype=np.float64).ravel()
    ys = np.asarray(y, dtype=np.float64).ravel()
    if xs.shape != ys.shape:
        raise UserError(f"{what}: {xs.size} regressor values but {ys.size} scores")
    if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys)) and math.isfinite(x0)):
        raise UserError(f"{what}: the entropies and scores must be finite numbers (found NaN/inf)")
    n = int(xs.size)
    if n < 3:
        raise UserError(f"{what}: a prediction interval needs at least 3 points (one residual degree of freedom), "
                        f"got {n}; fit on more of the run (--fit-frac) or evaluate more often")
    xbar = float(xs.mean())
    dx = xs - xbar
    sxx = float(dx @ dx)
    if sxx <= 1e-24 * max(1.0, float(np.abs(xs).max())) ** 2:
        raise UserError(f"{what}: the entropy does not change across the {n} points, so the line's slope is "
                        "undetermined and no interval exists; fit on more of the run (--fit-frac)")
    slope = float(dx @ (ys - ys.mean())) / sxx
    intercept = float(ys.mean()) - slope * xbar
    resid = ys - (intercept + slope * xs)
    ss_res = float(resid @ resid)
    dof = n - 2
    s = math.sqrt(ss_res / dof)
    leverage = 1.0 / n + (x0 - xbar) ** 2 / sxx
    predicted = intercept + slope * x0
    half = t_quantile(0.5 + level / 2, dof) * s * math.sqrt(1.0 + leverage)
    return Interval(form=form, intercept=intercept, slope=slope, predicted=predicted, low=predicted - half,
                    high=predicted + half, level=level, n=n, dof=dof, s=s, ss_res=ss_res, leverage=leverage)


def regressor(form: str, entropy: np.ndarray) -> np.ndarray:
    """x of each form: exp(H) for the law, H for the linear baseline."""
    if form == "law":
        return np.exp(entropy)
    if form == "linear":
        return entropy
    raise ValueError(f"unknown form {form!r}; one of {FORMS}")


def final_forecasts(steps: Sequence[int], entropy: Sequence[float], perf: Sequence[float], fit_frac: float,
                    level: float = DEFAULT_LEVEL, *, what: str = "points") -> dict[str, Any]:
    """The last evaluation's score forecast from its entropy by each form fitted on the points at steps
    <= ``fit_frac`` · the last step (``analysis.law.forecast``'s cut), each with its prediction interval at
    ``level``; the actual score, each form's error (predicted − actual) and whether its interval holds it, and
    which form fits the early points better (the smaller residual sum of squares: both have two parameters)."""
    if not 0 < fit_frac < 1:
        raise UserError(f"--fit-frac must be in (0, 1), got {fit_frac}")
    s = np.asarray(steps, dtype=np.float64)
    h = np.asarray(entropy, dtype=np.float64)
    r = np.asarray(perf, dtype=np.float64)
    if s.size == 0 or s.shape != h.shape or s.shape != r.shape:
        raise UserError(f"{what}: no (entropy, score) points at the same steps")
    cutoff = fit_frac * float(s.max())
    head = s <= cutoff
    last = int(np.argmax(s))
    if head[last]:
        raise UserError(f"{what}: no evaluation after step {cutoff:g} to forecast; lower --fit-frac")
    cut = f"{what} (the {int(head.sum())} evaluations at steps <= {cutoff:g}, --fit-frac {fit_frac:g})"
    out: dict[str, Any] = {"fit_frac": fit_frac, "cutoff_step": cutoff, "level": level,
                           "fit_steps": [int(v) for v in s[head]], "final_step": int(s[last]),
                           "final_entropy": float(h[last]), "actual": float(r[last])}
    for form in FORMS:
        iv = prediction_interval(regressor(form, h[head]), r[head], float(regressor(form, h[last:last + 1])[0]),
                                 level, form=form, what=cut)
        out[form] = {**iv.to_dict(), "error": iv.predicted - float(r[last]), "covered": iv.covers(float(r[last]))}
    law_ss, lin_ss = out["law"]["ss_res"], out["linear"]["ss_res"]
    out["better_early_fit"] = ("law" if law_ss < lin_ss else "linear" if lin_ss < law_ss else "tie")
    return out


def ceiling_forecasts(entropy: Sequence[float], perf: Sequence[float], level: float = DEFAULT_LEVEL, *,
                      what: str = "points") -> dict[str, Any]:
    """Where a run is heading if its entropy keeps falling: the score at H = 0 by each form fitted on every
    (entropy, score) pair so far, with its prediction interval at ``level``. For the law that is its ceiling
    b − a (x_0 = exp(0) = 1); for the linear baseline its intercept c (x_0 = 0). Mid-run the fitted entropies lie
    above 0, so both are extrapolations and their intervals widen with the leverage (x_0 − x̄)²/S_xx; the coverage
    ``benchmarks/law_backtest.py`` measured is that of the last-score forecast (``final_forecasts``), not of this
    one. Refused in one line with fewer than 3 pairs or no spread in H."""
    h = np.asarray(entropy, dtype=np.float64)
    r = np.asarray(perf, dtype=np.float64)
    out: dict[str, Any] = {"level": level, "n": int(h.size), "at_entropy": 0.0}
    for form in FORMS:
        iv = prediction_interval(regressor(form, h), r, float(regressor(form, np.zeros(1))[0]), level, form=form,
                                 what=what)
        out[form] = iv.to_dict()
    return out
