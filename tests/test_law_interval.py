"""Issue 75 (item 3): the last score's forecast with its OLS prediction interval, for the law and the baseline
linear in H; ``erft fit-law`` prints and writes both; ``benchmarks/law_backtest.py`` measures their coverage.
Expected values are hand-derived or from numpy's polyfit, numpy's matrix algebra and scipy.stats.t."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from entropy_rft.analysis.interval import final_forecasts, prediction_interval, regularized_beta, t_quantile
from entropy_rft.analysis.law import law_points
from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError
from entropy_rft.rundir.files import read_step_log

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results" / "smollm2-cpu"


def reference(x, y, x0, level):
    """(prediction, low, high) by numpy polyfit and the matrix form s^2 (1 + x0' (X'X)^-1 x0), scipy's t."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    slope, icept = np.polyfit(x, y, 1)
    design = np.stack([np.ones_like(x), x], 1)
    s2 = float(((y - (icept + slope * x)) ** 2).sum()) / (x.size - 2)
    v0 = np.array([1.0, x0])
    se = math.sqrt(s2 * (1 + v0 @ np.linalg.inv(design.T @ design) @ v0))
    half = stats.t.ppf(0.5 + level / 2, x.size - 2) * se
    pred = icept + slope * x0
    return pred, pred - half, pred + half



def _t_closed_form(p: float, dof: int) -> float:
    """The t quantile's closed forms for 1, 2 and 4 degrees of freedom (Hill 1970; Shaw 2006, §2)."""
    if dof == 1:
        return -1 / math.tan(math.pi * p)  # tan(π(p − ½)), without the rounding of p − ½
    if dof == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    alpha = 4 * p * (1 - p)
    q = math.cos(math.acos(math.sqrt(alpha)) / 3) / math.sqrt(alpha)
    return math.copysign(2 * math.sqrt(q - 1), p - 0.5)


@pytest.mark.parametrize("dof", [1, 2, 4])
@pytest.mark.parametrize("p", [1e-9, 0.001, 0.05, 0.3, 0.4999, 0.55, 0.75, 0.95, 0.975, 0.999])
def test_t_quantile_matches_the_closed_forms(p, dof):
    assert t_quantile(p, dof) == pytest.approx(_t_closed_form(p, dof), rel=1e-9)


@pytest.mark.parametrize("dof", [3, 5, 9, 30, 250])
def test_t_quantile_and_regularized_beta_match_30_digit_references(dof):
    import mpmath

    mpmath.mp.dps = 30
    for p in (1e-6, 0.01, 0.2, 0.5 + 1e-7, 0.9, 0.95, 0.995):
        ref = mpmath.findroot(lambda t, p=p: mpmath.betainc(dof / 2, 0.5, 0, dof / (dof + t * t), regularized=True)
                              / 2 - min(p, 1 - p), math.copysign(1.0, p - 0.5) * abs(stats.t.ppf(p, dof)))
        assert t_quantile(p, dof) == pytest.approx(math.copysign(float(abs(ref)), p - 0.5), rel=1e-9)
    for x in (1e-12, 0.3, 0.9, 1 - 1e-9):
        ref = float(mpmath.betainc(dof / 2, 0.5, 0, x, regularized=True))
        assert regularized_beta(x, dof / 2, 0.5) == pytest.approx(ref, rel=1e-12)
    assert t_quantile(0.5, dof) == 0.0
    with pytest.raises(ValueError, match="p must be in"):
        t_quantile(1.0, dof)

def test_hand_computed_case():
    # x = 0,1,2; y = 0,1,3: slope 3/2, intercept -1/6, residuals 1/6,-1/3,1/6, SSR 1/6, s^2 = 1/6 (1 dof);
    # at x0 = 3: 13/3, leverage 1/3 + 4/2, se = sqrt(1/6 * 10/3) = sqrt(5)/3; t(0.95, 1) = tan(0.45 pi)
    iv = prediction_interval([0, 1, 2], [0, 1, 3], 3.0, 0.9)
    half = math.tan(0.45 * math.pi) * math.sqrt(5) / 3
    assert iv.predicted == pytest.approx(13 / 3, abs=1e-12)
    assert iv.low == pytest.approx(13 / 3 - half, abs=1e-12)
    assert iv.high == pytest.approx(13 / 3 + half, abs=1e-12)
    assert (iv.dof, iv.n) == (1, 3)
    assert iv.ss_res == pytest.approx(1 / 6, abs=1e-14)
    assert iv.leverage == pytest.approx(1 / 3 + 2, abs=1e-14)


@pytest.mark.parametrize("n,level", [(4, 0.9), (9, 0.8), (30, 0.95)])
def test_matches_numpy_and_scipy_ols(n, level):
    rng = np.random.default_rng(n)
    x = rng.uniform(0.5, 3.0, n)
    y = 0.7 - 0.2 * x + rng.normal(0, 0.05, n)
    iv = prediction_interval(x, y, 4.0, level)
    pred, low, high = reference(x, y, 4.0, level)
    assert (iv.predicted, iv.low, iv.high) == pytest.approx((pred, low, high), rel=1e-10, abs=1e-12)


def test_coverage_is_nominal_when_the_model_holds():
    # 2000 draws of a true line with normal noise: coverage of the 90% interval within 3 binomial sd of 0.9
    rng = np.random.default_rng(0)
    x = np.linspace(0.0, 1.0, 5)
    hits = 0
    draws = 2000
    for _ in range(draws):
        y = 1.0 - 0.5 * x + rng.normal(0, 0.1, 5)
        hits += prediction_interval(x, y, 1.5, 0.9).covers(1.0 - 0.75 + rng.normal(0, 0.1))
    assert abs(hits / draws - 0.9) < 3 * math.sqrt(0.09 / draws)


@pytest.mark.parametrize("x,y,must", [([1.0, 2.0], [0.1, 0.2], "at least 3 points"),
                                      ([1.0, 1.0, 1.0], [0.1, 0.2, 0.3], "does not change"),
                                      ([1.0, float("nan"), 2.0], [0.1, 0.2, 0.3], "finite")])
def test_degenerate_input_is_one_line_naming_the_data(x, y, must):
    with pytest.raises(UserError, match=must) as e:
        prediction_interval(x, y, 1.0, 0.9, what="run.jsonl")
    assert str(e.value).startswith("run.jsonl") and "\n" not in str(e.value)


def points(run: str):
    return law_points(read_step_log(RUNS / run / "metrics.jsonl"))


def test_fit_law_prints_and_writes_both_forms_with_their_intervals(tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert main(["fit-law", str(RUNS / "none-s0"), "--fit-frac", "0.4", "--level", "0.8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    fc = json.loads(out.read_text())["interval_forecast"]
    steps, hs, rs = points("none-s0")
    assert fc["fit_steps"] == [0, 3, 6] and fc["actual"] == rs[-1]
    for form, x in (("law", np.exp(hs)), ("linear", np.asarray(hs))):
        pred, low, high = reference(x[:3], rs[:3], x[-1], 0.8)
        assert (fc[form]["predicted"], fc[form]["low"], fc[form]["high"]) == pytest.approx((pred, low, high))
        assert fc[form]["covered"] == (low <= rs[-1] <= high)
        assert f"{pred:.4f} [{low:.4f}, {high:.4f}]" in text
    law_ss = float(((np.polyval(np.polyfit(np.exp(hs[:3]), rs[:3], 1), np.exp(hs[:3])) - rs[:3]) ** 2).sum())
    lin_ss = float(((np.polyval(np.polyfit(hs[:3], rs[:3], 1), hs[:3]) - rs[:3]) ** 2).sum())
    assert fc["better_early_fit"] == ("law" if law_ss < lin_ss else "linear")
    assert ("the law fits better" if law_ss < lin_ss else "the linear baseline fits better") in text


def test_fit_law_says_why_no_interval_on_two_early_points(capsys):
    assert main(["fit-law", str(RUNS / "none-s0")]) == 0  # --fit-frac 0.2: steps 0 and 3 only
    line = [x for x in capsys.readouterr().out.splitlines() if "prediction interval" in x]
    assert len(line) == 1 and "not possible" in line[0] and "at least 3 points, got" not in line[0]
    assert "needs at least 3 points" in line[0] and "metrics.jsonl" in line[0]


def test_fit_law_refuses_a_level_outside_0_1(capsys):
    assert main(["fit-law", str(RUNS / "none-s0"), "--level", "1.5"]) != 0
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "--level" in err[0]


def test_final_forecasts_refuses_a_run_with_nothing_after_the_cut():
    with pytest.raises(UserError, match="no evaluation after"):
        final_forecasts([0, 0, 0], [1.0, 0.9, 0.8], [0.1, 0.2, 0.3], 0.5, what="x")  # all at step 0


def backtest_module():
    from benchmarks import law_backtest

    return law_backtest


def test_backtest_on_a_committed_subset_matches_an_independent_recomputation(tmp_path, capsys):
    subset = ["none-s0", "clip_v-s1", "kl_cov-s1", "clip_cov-s2"]
    out = tmp_path / "bt.json"
    rc = backtest_module().main([*(str(RUNS / r) for r in subset), "--fracs", "0.2,0.6", "--level", "0.9",
                                 "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    res = json.loads(out.read_text())
    by = {(s["form"], s["frac"]): s for s in res["summary"]}
    for form in ("law", "linear"):
        assert by[(form, 0.2)]["with_interval"] == 0 and by[(form, 0.2)]["coverage"] is None  # 2 early points
        hits, errs = 0, []
        for run in subset:
            steps, hs, rs = points(run)
            head = [i for i, s in enumerate(steps) if s <= 0.6 * max(steps)]
            x = np.exp(hs) if form == "law" else np.asarray(hs)
            pred, low, high = reference(x[head], np.asarray(rs)[head], x[-1], 0.9)
            hits += low <= rs[-1] <= high
            errs.append(pred - rs[-1])
        s = by[(form, 0.6)]
        assert s["with_interval"] == 4 and s["covered"] == hits
        assert s["coverage"] == pytest.approx(hits / 4)
        assert s["mean_error"] == pytest.approx(float(np.mean(errs)))
        assert s["mean_abs_error"] == pytest.approx(float(np.mean(np.abs(errs))))
        assert f"| {form} | first 60% | 4/4 | 5 | {hits}/4 ({hits / 4:.0%}) | {float(np.mean(errs)):+.3f}" in table


def test_the_interval_needs_no_scipy(tmp_path):
    """A verl environment has the package without its optional scientific stack (make test-verl installs it
    ``--no-deps``): fit-law's interval (and the report's, which calls the same code) must not import scipy. Run
    with scipy made unimportable, the interval equals the reference's (scipy's t, here in the test)."""
    import subprocess
    import sys

    out = tmp_path / "fit.json"
    code = ("import sys; sys.modules['scipy'] = None\n"
            "from entropy_rft.cli.main import main\n"
            f"sys.exit(main(['fit-law', {str(RUNS / 'none-s0')!r}, '--fit-frac', '0.4', '--json', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fc = json.loads(out.read_text())["interval_forecast"]["law"]
    _, hs, rs = points("none-s0")
    pred, low, high = reference(np.exp(hs[:3]), rs[:3], math.exp(hs[-1]), 0.9)
    assert (fc["predicted"], fc["low"], fc["high"]) == pytest.approx((pred, low, high), rel=1e-9)
