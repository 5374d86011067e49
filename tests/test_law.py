"""The entropy-performance law R = -a*exp(H) + b: exact recovery, an independent regression, forecast, errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import curve_fit

from entropy_rft.analysis.law import MIN_RELIABLE_POINTS, fit_law, fit_run, forecast, law_points, reliability_warning
from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError


def _write_run(d, rows):
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_exact_recovery_of_known_a_b():
    a, b = 0.3, 0.9
    h = [0.2, 0.35, 0.5, 0.7, 1.1]
    r = [b - a * math.exp(x) for x in h]
    fit = fit_law(h, r)
    assert fit.a == pytest.approx(a, abs=1e-12)
    assert fit.b == pytest.approx(b, abs=1e-12)
    assert fit.ceiling == pytest.approx(0.6, abs=1e-12)  # b - a by hand
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit.rmse == pytest.approx(0.0, abs=1e-12)
    assert fit.n == 5


def test_noisy_fit_matches_independent_simple_regression_and_curve_fit():
    rng = np.random.default_rng(3)
    h = rng.uniform(0.05, 1.2, size=40)
    r = 0.8 - 0.25 * np.exp(h) + rng.normal(0, 0.02, size=40)
    # Independent: simple linear regression of r on x = exp(h): slope = cov/var = -a, intercept = b.
    x = np.exp(h)
    slope = float(((x - x.mean()) * (r - r.mean())).sum() / ((x - x.mean()) ** 2).sum())
    intercept = float(r.mean() - slope * x.mean())
    fit = fit_law(h, r)
    assert fit.a == pytest.approx(-slope, rel=1e-9)
    assert fit.b == pytest.approx(intercept, rel=1e-9)
    # And scipy's nonlinear optimiser lands on the same point.
    (ca, cb), _ = curve_fit(lambda hh, aa, bb: -aa * np.exp(hh) + bb, h, r, p0=(1.0, 0.0))
    assert fit.a == pytest.approx(ca, rel=1e-6)
    assert fit.b == pytest.approx(cb, rel=1e-6)
    # R^2 from its definition, by a naive loop.
    pred = [-fit.a * math.exp(v) + fit.b for v in h]
    ss_res = sum((ri - pi) ** 2 for ri, pi in zip(r, pred))
    ss_tot = sum((ri - r.mean()) ** 2 for ri in r)
    assert fit.r2 == pytest.approx(1 - ss_res / ss_tot, rel=1e-9)
    assert 0.5 < fit.r2 < 1.0


def test_forecast_rmse_of_a_known_offset():
    a, b = 0.2, 0.7
    steps = list(range(0, 101, 10))  # cutoff 0.2*100 = 20 -> steps 0, 10, 20 fit
    h = [1.2 - 0.01 * s for s in steps]
    r = [b - a * math.exp(x) + (0.05 if s > 20 else 0.0) for s, x in zip(steps, h)]
    fc = forecast(steps, h, r, 0.2)
    assert fc.fit_steps == [0, 10, 20]
    assert fc.test_steps == list(range(30, 101, 10))
    assert fc.fit.a == pytest.approx(a, abs=1e-10)
    assert fc.fit.b == pytest.approx(b, abs=1e-10)
    assert fc.test_rmse == pytest.approx(0.05, abs=1e-10)  # every held-out point is off by exactly 0.05
    assert fc.test_mae == pytest.approx(0.05, abs=1e-10)


@pytest.mark.parametrize("h,r,msg", [
    ([0.5], [0.2], "at least 3"),
    ([0.5, 0.6], [0.2, 0.1], "at least 3"),
    ([0.5, 0.5, 0.5, 0.5], [0.1, 0.2, 0.3, 0.4], "constant"),
    ([0.5, float("nan"), 0.7], [0.1, 0.2, 0.3], "finite"),
    ([0.5, 0.6, 0.7], [0.1, 0.2], "different lengths"),
])
def test_bad_input_raises_user_error(h, r, msg):
    with pytest.raises(UserError, match=msg):
        fit_law(h, r)


def test_forecast_errors():
    with pytest.raises(UserError, match="fit-frac"):
        forecast([0, 1, 2], [1, 0.9, 0.8], [0.1, 0.2, 0.3], 1.5)
    with pytest.raises(UserError, match="need 2"):  # cutoff 0.2*100: only step 0 before it
        forecast([0, 50, 100], [1, 0.9, 0.8], [0.1, 0.2, 0.3], 0.2)


def _law_rows(a=0.25, b=0.75, steps=range(0, 101, 10)):
    rows = []
    for s in steps:
        h = 1.0 - 0.008 * s
        acc = b - a * math.exp(h)
        row = {"step": s, "eval/pass@1": acc, "eval/avg@4": acc, "eval/entropy": h}
        if s > 0:
            row["entropy/mean"] = h + 0.1
        rows.append(row)
        if s < 100:  # training rows between evaluations carry no eval keys
            rows.append({"step": s + 1, "entropy/mean": 0.5, "reward/mean": 0.3})
    return rows


def test_law_points_sources_and_nulls():
    rows = _law_rows()
    rows.append({"step": 200, "eval/pass@1": None, "eval/entropy": 0.1})
    steps, hs, rs = law_points(rows)
    assert steps == list(range(0, 101, 10))
    assert hs[0] == pytest.approx(1.0)
    steps_t, hs_t, _ = law_points(rows, entropy="train")
    assert steps_t == list(range(10, 101, 10))  # step 0 has no training entropy
    assert hs_t[0] == pytest.approx(1.0 - 0.08 + 0.1)
    with pytest.raises(UserError, match="eval.every"):
        law_points([{"step": 1, "entropy/mean": 0.3}])


def test_fit_law_cli_text_and_json(tmp_path, capsys):
    run = _write_run(tmp_path / "run", _law_rows())
    out = tmp_path / "law.json"
    assert main(["fit-law", str(run), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "a = 0.2500" in text and "b = 0.7500" in text and "ceiling b - a = 0.5000" in text
    res = json.loads(out.read_text())
    assert res["fit"]["a"] == pytest.approx(0.25, abs=1e-9)
    assert res["forecast"]["fit_steps"] == [0, 10, 20]
    assert res["forecast"]["test_rmse"] == pytest.approx(0.0, abs=1e-9)
    # The rows follow the law exactly: the final pass@1 is forecast without error from 10, 20 and 40% of steps.
    assert all(abs(v) < 1e-9 for v in res["final_forecast"].values())
    assert "from the first 10% / 20% / 40% of steps (predicted - actual): 0.0000 / 0.0000 / 0.0000" in text
    assert fit_run(run, metric="avg@K")["fit"]["b"] == pytest.approx(0.75, abs=1e-9)


def test_fit_law_cli_bad_input_exits_2(tmp_path, capsys):
    assert main(["fit-law", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    flat = _write_run(tmp_path / "flat", [{"step": s, "eval/pass@1": 0.1 * s, "eval/entropy": 0.7}
                                          for s in range(5)])
    assert main(["fit-law", str(flat)]) == 2
    assert "constant" in capsys.readouterr().err
    few = _write_run(tmp_path / "few", [{"step": 0, "eval/pass@1": 0.1, "eval/entropy": 0.7}])
    assert main(["fit-law", str(few)]) == 2
    assert "at least 3" in capsys.readouterr().err
    # Too few early points for the forecast: the fit is still reported, the forecast says why not.
    sparse = _write_run(tmp_path / "sparse", [{"step": s, "eval/pass@1": 0.8 - 0.3 * math.exp(1 - s / 200),
                                               "eval/entropy": 1 - s / 200} for s in (0, 100, 150, 200)])
    assert main(["fit-law", str(sparse)]) == 0
    assert "forecast test: not possible" in capsys.readouterr().out


def test_reliability_warning_below_eight_points(tmp_path):
    assert MIN_RELIABLE_POINTS == 8
    assert reliability_warning(4) == "fit on 4 points: not reliable (fewer than 8 evaluations)"
    assert reliability_warning(7) is not None
    assert reliability_warning(8) is None and reliability_warning(36) is None
    # The threshold's reason (law.py): the two-sided 5% critical r for n points, r = t / sqrt(t² + n - 2),
    # squared, is the R² that noise alone exceeds 5% of the time: about 0.90 at n = 4 and 0.50 at n = 8.
    from scipy.stats import t as student_t

    def r2_crit(n):
        t = student_t.ppf(0.975, n - 2)
        return t * t / (t * t + n - 2)

    assert r2_crit(4) == pytest.approx(0.9025, abs=1e-3) and r2_crit(8) == pytest.approx(0.500, abs=2e-3)
    few = _write_run(tmp_path / "few", _law_rows(steps=range(0, 31, 10)))  # 4 evaluations
    assert fit_run(few)["warning"].startswith("fit on 4 points: not reliable")
    assert fit_run(_write_run(tmp_path / "many", _law_rows()))["warning"] is None  # 11 evaluations
