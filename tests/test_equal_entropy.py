"""Issue 17: every method at equal entropy. The per-run figures (law forecast, covariance-vs-ΔH agreement,
tracking, touched tokens, prompt standard errors) against hand-computed cases, the comparison rows and the
best-within-noise rule on made-up summaries, and ``erft compare --methods all --entropy-targets`` end to end on
the micro policy (two jobs), its summary checked against the run directories and its report page."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest

from entropy_rft.analysis import agreement, equal_entropy
from entropy_rft.analysis.law import forecast_final, run_law
from entropy_rft.analysis.summary import prompt_standard_errors, setpoint_tracking, touched_frac
from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError
from entropy_rft.control import available_methods, get_method_class
from entropy_rft.launch.variants import expand_variants
from entropy_rft.rundir.files import read_jsonl
from micro import make_micro_policy, micro_overrides

# ----------------------------------------------------------------------------- agreement


def _step_rows(cov, pred_dh, actual, cov_c=None):
    return [{"step": i + 1, "dynamics/cov_logp_adv": c, "dynamics/pred_dH": p, "probe/dH_actual": a,
             "dynamics/cov_adv_s_centered": (cov_c or cov)[i]}
            for i, (c, p, a) in enumerate(zip(cov, pred_dh, actual))]


def test_run_agreement_signs_and_fall_shares():
    # The measured change is exactly -0.5 x the covariance: Paper B's prediction matches perfectly.
    cov = [0.02, 0.01, -0.005, 0.03, 0.015]
    actual = [-0.5 * c for c in cov]
    pred_dh = [0.001, -0.002, -0.001, 0.0005, -0.003]
    out = agreement.run_agreement([{"step": 0, "probe/dH_actual": 1.0}, *_step_rows(cov, pred_dh, actual)])
    assert out["dH_agree/cov_r"] == pytest.approx(1.0, abs=1e-12)
    assert out["dH_agree/cov_sign"] == 1.0
    assert out["dH_agree/cov_fall"] == pytest.approx(4 / 5)  # covariance positive on 4 of 5 steps
    # Paper A: predicted signs +,-,-,+,- against actual -,-,+,-,- -> steps 2 and 5 agree.
    assert out["dH_agree/a_sc_sign"] == pytest.approx(2 / 5)
    assert out["dH_agree/a_sc_fall"] == pytest.approx(3 / 5)
    assert out["dH_agree/a_sc_r"] == pytest.approx(float(np.corrcoef(pred_dh, actual)[0, 1]), abs=1e-12)
    assert out["dH_agree/steps"] == 5  # the step-0 row is not a training step


def test_run_agreement_without_probe_is_none():
    rows = [{"step": 1, "dynamics/cov_logp_adv": 0.1}, {"step": 2, "dynamics/cov_logp_adv": -0.1}]
    out = agreement.run_agreement(rows)
    assert out["dH_agree/cov_r"] is None and out["dH_agree/cov_sign"] is None
    assert out["dH_agree/cov_fall"] == 0.5 and out["dH_agree/steps"] == 0


# ----------------------------------------------------------------------------- the law's forecast


def test_forecast_of_an_exact_law_has_no_error():
    steps = list(range(0, 101, 10))
    h = [0.8 - 0.05 * i for i in range(len(steps))]
    r = [-0.2 * math.exp(x) + 0.6 for x in h]
    out = forecast_final(steps, h, r)
    for frac in ("10%", "20%", "40%"):
        assert abs(out[f"law/forecast_err@{frac}"]) < 1e-9
        assert out[f"law/forecast_rmse@{frac}"] < 1e-9


def test_forecast_error_by_hand():
    # Head (steps <= 20% of 40 = 8): the two points (H=1, R=0.1) and (H=0, R=0.2) give a line in x = e^H:
    # R = 0.2 - 0.1 (x - 1) / (e - 1). The last point (H = 0.5, R = 0.3) is then predicted at
    # 0.2 - 0.1 (e^0.5 - 1)/(e - 1); err = predicted - 0.3.
    steps, h, r = [0, 8, 20, 40], [1.0, 0.0, 0.7, 0.5], [0.1, 0.2, 0.25, 0.3]
    pred = 0.2 - 0.1 * (math.exp(0.5) - 1) / (math.e - 1)
    out = forecast_final(steps, h, r, fracs=(0.2,))
    assert out["law/forecast_err@20%"] == pytest.approx(pred - 0.3, abs=1e-12)
    # Only one point at or before 10% of 40 steps: no forecast, not an error.
    assert forecast_final(steps, h, r, fracs=(0.1,))["law/forecast_err@10%"] is None


def test_run_law_fits_the_evaluation_rows():
    rows = [{"step": s, "eval/pass@1": -0.1 * math.exp(h) + 0.5, "eval/entropy": h}
            for s, h in zip(range(0, 60, 10), (0.9, 0.7, 0.6, 0.5, 0.45, 0.4))]
    out = run_law(rows)
    assert out["law/a"] == pytest.approx(0.1, abs=1e-9) and out["law/b"] == pytest.approx(0.5, abs=1e-9)
    assert out["law/ceiling"] == pytest.approx(0.4, abs=1e-9) and out["law/points"] == 6
    assert run_law([{"step": 1, "entropy/mean": 0.5}])["law/a"] is None


# ----------------------------------------------------------------------------- per-run figures


def test_prompt_standard_errors_by_hand():
    # K = 2; hist [1, 1, 2]: one prompt 0/2, one 1/2, two 2/2 correct.
    se = prompt_standard_errors([1, 1, 2])
    p1 = [0.0, 0.5, 1.0, 1.0]
    pk = [0.0, 1.0, 1.0, 1.0]
    assert se["final/pass@1_se"] == pytest.approx(statistics.stdev(p1) / 2, rel=1e-12)
    assert se["final/pass@K_se"] == pytest.approx(statistics.stdev(pk) / 2, rel=1e-12)
    assert prompt_standard_errors(None)["final/pass@1_se"] is None


def test_touched_fraction_rules():
    rows = [{"control/kept_frac": 0.9, "control/kl_cov_selected_frac": 0.02},
            {"control/kept_frac": 0.8, "control/kl_cov_selected_frac": 0.04}]
    assert touched_frac("clip_v", rows) == pytest.approx(0.15)
    assert touched_frac("kl_cov", rows) == pytest.approx(0.03)
    assert touched_frac("entropy_bonus", rows) == 1.0
    assert touched_frac("clip_higher", rows) is None and touched_frac("fec", rows) is None
    # Entrocraft: the share of steps off GRPO (RAFT++ +1 or NSR -1); AEPO: the share of rollouts swapped in
    modes = [{"control/own_output": m, "control/kept_frac": 1.0} for m in (1.0, 0.0, -1.0, 0.0)]
    assert touched_frac("entrocraft", modes) == pytest.approx(0.5)
    assert touched_frac("aepo", [{"control/spliced_frac": 0.05}, {"control/spliced_frac": 0.15}]) == pytest.approx(0.1)


def test_setpoint_tracking_by_hand():
    # Target 0.5 from above; the smoothed entropy first reaches it at step 3; then 0.52, 0.6 (out: 20%), 0.5.
    smooth = [0.8, 0.6, 0.5, 0.52, 0.6, 0.5]
    raw = [0.8, 0.55, 0.45, 0.4, 0.5, 0.5]
    rows = [{"step": i + 1, "control/entropy_target": 0.5, "control/entropy_smoothed": s, "entropy/mean": r}
            for i, (s, r) in enumerate(zip(smooth, raw))]
    out = setpoint_tracking(rows)
    assert out["autopilot/reach_step"] == 3
    assert out["autopilot/in_band"] == pytest.approx(3 / 4)
    # Raw: reaches at step 3 (0.45); then 0.45 (10%), 0.4 (20%), 0.5, 0.5 -> 3 of 4 in band.
    assert out["autopilot/in_band_raw"] == pytest.approx(3 / 4)
    never = [{**r, "control/entropy_smoothed": 0.9} for r in rows]
    assert setpoint_tracking(never)["autopilot/reach_step"] is None
    assert setpoint_tracking([{"step": 1, "entropy/mean": 0.5}])["autopilot/in_band"] is None


# ----------------------------------------------------------------------------- comparison rows


def _summ(method, setpoint, p1, pk, t, *, reach=10, in_band=0.9, seed=0):
    return {"method": f"{method}@{setpoint}", "method_name": method, "setpoint": setpoint, "seed": seed, "k": 8,
            "final/pass@1": p1, "final/pass@8": pk, "time/step_train": t, "autopilot/reach_step": reach,
            "autopilot/in_band": in_band, "final/pass@1_se": 0.02, "final/pass@K_se": 0.03}


def test_comparison_rows_statistics_overhead_and_status():
    summ = [_summ("none", "preset", 0.20, 0.30, 1.0, reach=None, in_band=None, seed=0),
            _summ("none", "preset", 0.22, 0.34, 1.0, reach=None, in_band=None, seed=1),
            _summ("clip_v", "0.5x", 0.18, 0.45, 1.2, seed=0), _summ("clip_v", "0.5x", 0.16, 0.47, 1.4, seed=1),
            _summ("kl_cov", "0.5x", 0.10, 0.20, 1.1, reach=None, in_band=None, seed=0),
            _summ("kl_cov", "0.5x", 0.12, 0.22, 1.1, reach=None, in_band=None, seed=1),
            _summ("clip_b", "0.5x", 0.17, 0.46, 1.0, in_band=0.3, seed=0),
            _summ("clip_b", "0.5x", 0.17, 0.46, 1.0, seed=1),
            _summ("clip_higher", "0.5x", 0.17, 0.30, 1.0, in_band=0.1, seed=0),
            _summ("clip_higher", "0.5x", 0.16, 0.31, 1.0, in_band=0.2, seed=1)]
    rows = equal_entropy.comparison_rows(summ)
    assert [(r["setpoint"], r["method"]) for r in rows] == [
        ("preset", "none"), ("0.5x", "none"), ("0.5x", "clip_b"), ("0.5x", "clip_higher"), ("0.5x", "clip_v"),
        ("0.5x", "kl_cov")]
    ref = rows[1]
    assert ref["reference"] and ref["final/pass@1"]["mean"] == pytest.approx(0.21)
    cv = rows[4]
    assert cv["final/pass@1"]["mean"] == pytest.approx(0.17) and cv["final/pass@1"]["std"] == pytest.approx(0.01)
    assert cv["final/pass@1"]["se"] == pytest.approx(0.01)  # population std / sqrt(n - 1)
    assert cv["overhead"]["mean"] == pytest.approx(1.3)  # 1.3 s/step against none's 1.0
    assert cv["status"] == "held"
    assert rows[5]["status"] == "not reached"
    assert rows[2]["status"] == "held on 1 of 2 seeds"
    assert rows[3]["status"] == "not held"  # reached on both seeds, then in the band less than half the time
    md = equal_entropy.comparison_markdown(rows, 8)
    assert "| 0.5x | none (reference) | 2 |" in md and "not reached" in md and "1.30×" in md
    # a method's own law (issue 28): the in-band cell is its own controller's figure, the one its status uses
    own = [dict(_summ("entropic", "0.5x", 0.2, 0.4, 1.0, reach=None, in_band=None, seed=i), method_name=
                "entropic (own law)", **{"controller/kind": "own", "controller/reach_step": 5,
                                          "controller/in_band": band}) for i, band in enumerate((0.6, 0.8))]
    (row,) = [r for r in equal_entropy.comparison_rows(own) if r["method"] == "entropic (own law)"]
    assert row["autopilot/in_band"]["mean"] == pytest.approx(0.7) and row["status"] == "held"
    assert "pass@8" in md.splitlines()[0]


def test_best_within_noise():
    block = [{"method": "a", "x": {"mean": 0.50, "std": 0.01, "n": 3, "se": 0.01}},
             {"method": "b", "x": {"mean": 0.48, "std": 0.01, "n": 3, "se": 0.01}},  # 0.02 <= 2 * sqrt(2) * 0.01
             {"method": "c", "x": {"mean": 0.46, "std": 0.01, "n": 3, "se": 0.01}},  # 0.04 > 0.0283
             {"method": "d", "x": None}]
    assert equal_entropy.best_within_noise(block, "x") == ("a", ["b"])
    one = [{"method": "a", "x": {"mean": 0.5, "std": 0.0, "n": 1, "se": None}},
           {"method": "b", "x": {"mean": 0.5, "std": 0.0, "n": 1, "se": None}},
           {"method": "c", "x": {"mean": 0.49, "std": 0.0, "n": 1, "se": None}}]
    assert equal_entropy.best_within_noise(one, "x") == ("a", ["b"])


def test_the_verdict_ranks_only_the_methods_that_held_the_setpoint():
    # kl_cov has the best pass@1 at 0.5x but never reached it (it trained at lower entropy): it is reported as
    # missed with its held entropy, and the ranking is among clip_v (0.17 ± 0.01) and clip_b (0.12 ± 0.00).
    summ = [_summ("none", "preset", 0.20, 0.30, 1.0, reach=None, in_band=None, seed=s) for s in (0, 1)]
    summ += [_summ("clip_v", "0.5x", 0.18, 0.45, 1.0, seed=0), _summ("clip_v", "0.5x", 0.16, 0.47, 1.0, seed=1),
             _summ("clip_b", "0.5x", 0.12, 0.40, 1.0, seed=0), _summ("clip_b", "0.5x", 0.12, 0.40, 1.0, seed=1)]
    for s, h in ((0, 0.30), (1, 0.34)):
        summ.append({**_summ("kl_cov", "0.5x", 0.30, 0.50, 1.0, reach=None, in_band=None, seed=s),
                     "train/entropy_held": h})
    text = equal_entropy.verdict(equal_entropy.comparison_rows(summ), 8)
    assert "At setpoint 0.5x, among the methods that held it: best pass@1 clip_v (0.170)" in text
    assert "best pass@8 clip_v (0.460), clearly ahead of the rest" in text  # 0.46 - 0.40 > 2 * sqrt(0.01^2 + 0)
    assert "Setpoint missed, so not ranked: kl_cov (not reached, 0.32 nats held)." in text
    alone = equal_entropy.verdict(equal_entropy.comparison_rows(summ[:4]), 8)  # none and clip_v only
    assert "At the presets: best pass@1 none (0.200), the only method ranked" in alone
    assert "best pass@8 clip_v (0.460), the only method ranked" in alone and "clearly ahead" not in alone
    nobody = [r for r in summ if r["method_name"] == "kl_cov"]
    assert "At setpoint 0.5x, among the methods that held it: no method held it." in equal_entropy.verdict(
        equal_entropy.comparison_rows(nobody), 8)


def test_one_seed_uses_the_prompt_standard_error():
    # One seed each: no seed standard error, so the means' errors over the validation prompts decide.
    block = [{"method": "a", "x": {"mean": 0.50, "std": 0.0, "n": 1, "se": None, "se_prompts": 0.02}},
             {"method": "b", "x": {"mean": 0.45, "std": 0.0, "n": 1, "se": None, "se_prompts": 0.02}},  # 0.05 < 0.057
             {"method": "c", "x": {"mean": 0.44, "std": 0.0, "n": 1, "se": None, "se_prompts": 0.02}}]  # 0.06 > 0.057
    assert equal_entropy.best_within_noise(block, "x") == ("a", ["b"])
    rows = equal_entropy.comparison_rows([_summ("clip_v", "0.5x", 0.2, 0.4, 1.0)])
    assert rows[-1]["final/pass@1"]["se_prompts"] == pytest.approx(0.02)  # one run: its own prompt error


def test_train_step_time_leaves_out_measurement():
    from entropy_rft.analysis.summary import train_step_time

    rows = [{"step": 1, "time/step": 1.0, "time/probe": 0.1}, {"step": 2, "time/step": 5.0, "time/eval": 4.2},
            {"step": 3, "time/step": 1.2, "time/counterfactual": 0.3, "time/probe": 0.1}, {"step": 4, "time/step": 9.0}]
    assert train_step_time(rows) == pytest.approx((0.8 + 0.9) / 2)  # median of 0.9, 0.8, 0.8, 9.0


def test_setpoint_order():
    assert equal_entropy.setpoint_order(["0.8x", "preset", "0.5x", "0.65x", "0.4"]) == [
        "preset", "0.5x", "0.65x", "0.8x", "0.4"]


# ----------------------------------------------------------------------------- variants


def test_expand_variants_all_and_targets():
    names = available_methods()
    assert [v.label for v in expand_variants("all", None)] == names
    knobbed = [m for m in names if get_method_class(m).knob is not None]
    assert "none" not in knobbed and "grad_mask" not in knobbed and len(knobbed) >= 8
    vs = expand_variants("all", "0.5x,preset")
    labels = [v.label for v in vs]
    want = set()
    for m in names:
        if m in knobbed:
            want |= {f"{m}@0.5x", m}
        else:
            want.add(m)
    assert set(labels) == want and len(labels) == len(want)
    assert {v.target for v in vs if v.label.endswith("@0.5x")} == {"0.5x"}
    # none joins as the reference; a method without a knob runs at its preset only.
    assert [v.label for v in expand_variants("clip_v,grad_mask", "0.6x")] == ["none", "clip_v@0.6x", "grad_mask"]
    with pytest.raises(UserError, match="nosuch.*known methods"):
        expand_variants("nosuch", "0.5x")
    with pytest.raises(UserError, match="--entropy-targets"):
        expand_variants("clip_v", " , ")


# ----------------------------------------------------------------------------- end to end


def _sets(model, **extra):
    base = {"train.max_steps": 2, "eval.every": 1, "probe.jvp_every": 0, "probe.counterfactual_every": 0}
    return [a for s in micro_overrides(model, **{**base, **extra}) for a in ("--set", s)]


# 3 steps: enough for a correlation over steps, when each has a signal: OverlapTask's dense reward gives every
# group non-uniform rewards (with DigitTask's 0/1 reward the first steps had A = 0 everywhere: no prediction, no
# update, and such steps do not count for r, core.correlation)
SWEEP = {"train.max_steps": 3, "task.name": "micro:OverlapTask"}


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return make_micro_policy(tmp_path_factory.mktemp("ee") / "model")


@pytest.fixture(scope="module")
def swept(tmp_path_factory, micro):
    out = tmp_path_factory.mktemp("ee") / "cmp"
    sets = _sets(micro, **SWEEP)
    assert main(["compare", "--methods", "all", "--entropy-targets", "0.9x", "--out", str(out), *sets]) == 0
    return out


def test_compare_all_methods_at_setpoints(swept):
    names = available_methods()
    knobbed = [m for m in names if get_method_class(m).knob is not None]
    unknobbed = [m for m in names if m not in knobbed]
    dirs = sorted(p.name for p in swept.iterdir() if p.is_dir())
    assert dirs == sorted([f"{m}-s0" for m in unknobbed] + [f"{m}@0.9x-s0" for m in knobbed])
    summ = json.loads((swept / "summary.json").read_text())
    rows = summ["comparison"]["rows"]
    assert {(r["setpoint"], r["method"]) for r in rows} == (
        {("preset", m) for m in unknobbed} | {("0.9x", m) for m in knobbed} | {("0.9x", "none")})
    # Independent of the summary code: figures read back from one run directory's metrics.jsonl.
    row = next(r for r in rows if r["setpoint"] == "0.9x" and r["method"] == "clip_v")
    m = read_jsonl(swept / "clip_v@0.9x-s0" / "metrics.jsonl")
    evals = [r for r in m if "eval/pass@1" in r]
    train = [r for r in m if r["step"] >= 1]
    assert row["final/pass@1"]["mean"] == evals[-1]["eval/pass@1"]
    assert row["final/pass@K"]["mean"] == evals[-1]["eval/pass@4"]
    assert row["final/distinct_correct"]["mean"] == evals[-1]["eval/distinct_correct"]
    assert row["train/entropy_held"]["mean"] == pytest.approx(np.mean([r["entropy/mean"] for r in train[1:]]))
    assert row["control/touched_frac"]["mean"] == pytest.approx(1 - np.mean([r["control/kept_frac"] for r in train]))
    def train_time(rows):  # the median training part of a step: evaluations and probes left out
        return statistics.median(r["time/step"] - (r.get("time/eval") or 0) - (r.get("time/probe") or 0)
                                 - (r.get("time/counterfactual") or 0) for r in rows if r["step"] >= 1)

    none_t = train_time(read_jsonl(swept / "none-s0" / "metrics.jsonl"))
    assert row["overhead"]["mean"] == pytest.approx(train_time(m) / none_t)
    assert row["status"] in ("held", "not reached", "not held")
    md = (swept / "summary.md").read_text()
    for head in ("pass@1", "pass@4", "distinct correct", "final entropy (val)", "held entropy (train)",
                 "tokens touched", "train step time × none", "in ±15%", "status", "forecast err, 10%", "Cov > 0"):
        assert head in md
    assert summ["comparison"]["verdict"].startswith("At the presets")


def test_parallel_jobs_train_the_same_runs(micro, tmp_path, capsys):
    """--jobs 2 trains each run in its own process, its output in OUT/logs; the runs equal --jobs 1's."""
    rows = {}
    for jobs in (1, 2):
        out = tmp_path / f"j{jobs}"
        assert main(["compare", "--methods", "none,clip_v", "--jobs", str(jobs), "--out", str(out),
                     *_sets(micro, **{"train.progress": True})]) == 0
        rows[jobs] = {d: [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
                          for r in read_jsonl(out / d / "metrics.jsonl")] for d in ("none-s0", "clip_v-s0")}
    assert rows[1] == rows[2]
    logs = sorted(p.name for p in (tmp_path / "j2" / "logs").iterdir())
    assert logs == ["clip_v-s0.log", "none-s0.log"]
    log = (tmp_path / "j2" / "logs" / "none-s0.log").read_text()
    assert "step 2/2" in log
    # Run again: the finished runs are kept without starting a process for them.
    capsys.readouterr()
    assert main(["compare", "--methods", "none,clip_v", "--jobs", "2", "--out", str(tmp_path / "j2"),
                 *_sets(micro, **{"train.progress": True})]) == 0
    said = capsys.readouterr().out
    assert "[1/2] none seed 0: already finished, kept" in said and "clip_v seed 0: already finished" in said
    assert "started" not in said
    assert (tmp_path / "j2" / "logs" / "none-s0.log").read_text() == log


def test_a_rerun_with_other_settings_is_refused_and_changes_nothing(swept, micro, capsys):
    def snapshot():
        return {p: p.read_bytes() for p in sorted(swept.rglob("*")) if p.is_file() and p.suffix in (".jsonl", ".md")}

    before = snapshot()
    sets = _sets(micro, **{**SWEEP, "optim.lr": 0.02})  # the sweep ran at micro's lr 0.01
    assert main(["compare", "--methods", "all", "--entropy-targets", "0.9x", "--out", str(swept), *sets]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was trained with other settings (optim.lr: 0.01 there, 0.02 now)" in err[0], err
    assert "--overwrite" in err[0]
    assert snapshot() == before


def test_report_has_the_equal_entropy_page(swept, tmp_path):
    assert main(["report", str(swept), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<h2>Methods at equal entropy</h2>" in page and 'id="equal-entropy"' in page
    assert 'alt="pass@1 against pass@K"' in page and 'alt="Entropy per setpoint"' in page
    assert "none (reference)" in page and "forecast err, 20%" in page
    numbers = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert numbers["comparison"]["verdict"].startswith("At the presets")
    assert "Paper B's −Cov(log π, A)" in numbers["comparison"]["dynamics"]
    assert "<h2>The law's forecast and the batch predictions of the entropy change</h2>" in page
