"""``erft experiment masking``: predicted directions, the verdict logic on known paths, and the runs themselves."""

from __future__ import annotations

import io
import json

import pytest
import yaml
from PIL import Image

from entropy_rft.analysis import masking
from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError
from entropy_rft.rundir.files import read_jsonl
from micro import make_micro_policy, micro_overrides


def test_predicted_directions_are_papers():
    # Paper A: rewarding likely tokens lowers entropy, rewarding unlikely ones raises it; penalising reverses.
    want = {("positive", "positive"): "falls", ("positive", "negative"): "rises",
            ("negative", "positive"): "rises", ("negative", "negative"): "falls"}
    got = {(c.sample_sign, c.s_sign): masking.DIRECTION[c.expected] for c in masking.CONDITIONS}
    assert got == want
    assert [c.label for c in masking.CONDITIONS] == ["A>0, S>0", "A>0, S<0", "A<0, S>0", "A<0, S<0"]


def _write(d, entropies, probe=None):
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval/pass@1": 0.1}]  # a base-eval row has no training entropy and is ignored
    for i, h in enumerate(entropies, 1):
        rows.append({"step": i, "entropy/mean": h, "probe/dH_actual": probe, "control/kept_frac": 0.25})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_analyse_judges_known_paths(tmp_path):
    # 6 steps, window 2: change = mean(last 2) - mean(first 2), computed by hand below.
    _write(tmp_path / "vanilla", [1.0, 1.0, 0.9, 0.9, 0.8, 0.8])  # -0.2
    _write(tmp_path / "grad_mask-Apos-Spos", [1.0, 1.0, 0.8, 0.7, 0.6, 0.6], probe=-0.01)  # -0.4: falls, agrees
    _write(tmp_path / "grad_mask-Apos-Sneg", [1.0, 1.0, 1.1, 1.2, 1.3, 1.3], probe=0.02)  # +0.3: rises, agrees
    _write(tmp_path / "grad_mask-Aneg-Spos", [1.0, 1.0, 0.9, 0.9, 0.9, 0.9], probe=0.01)  # -0.1: falls, wrong
    _write(tmp_path / "grad_mask-Aneg-Sneg", [1.0, 1.0, 1.0, 1.0, 1.005, 1.005])  # +0.005 < 1%: flat
    res = masking.analyse(tmp_path, window=2, tol=0.01)
    c = {r["run"]: r for r in res["conditions"]}
    assert c["grad_mask-Apos-Spos"]["change"] == pytest.approx(-0.4)
    assert c["grad_mask-Apos-Spos"]["vs_vanilla"] == pytest.approx(-0.2)
    assert (c["grad_mask-Apos-Spos"]["observed"], c["grad_mask-Apos-Spos"]["agrees"]) == ("falls", True)
    assert (c["grad_mask-Apos-Sneg"]["observed"], c["grad_mask-Apos-Sneg"]["agrees"]) == ("rises", True)
    assert (c["grad_mask-Aneg-Spos"]["observed"], c["grad_mask-Aneg-Spos"]["agrees"]) == ("falls", False)
    # Relative to vanilla (-0.2) the A<0,S>0 run's -0.1 is a rise: +0.1 -> agrees vs vanilla.
    assert c["grad_mask-Aneg-Spos"]["vs_vanilla"] == pytest.approx(0.1)
    assert c["grad_mask-Aneg-Spos"]["agrees_vs_vanilla"] is True
    assert (c["grad_mask-Aneg-Sneg"]["observed"], c["grad_mask-Aneg-Sneg"]["agrees"]) == ("flat", False)
    assert c["grad_mask-Aneg-Sneg"]["probe_agrees"] is None  # no probe values logged
    assert c["grad_mask-Aneg-Spos"]["probe_agrees"] is True  # +0.01 per step, predicted rise
    assert c["grad_mask-Apos-Spos"]["kept_frac"] == pytest.approx(0.25)
    assert res["agree"] == 2
    assert "2 of 4" in res["verdict"]
    md = masking.markdown(res)
    assert "| A<0, S>0 | rises | falls | NO |" in md
    png = masking.plot(tmp_path, res)
    assert Image.open(io.BytesIO(png)).format == "PNG"


def test_analyse_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        masking.analyse(tmp_path)
    for name in ["vanilla"] + [c.name for c in masking.CONDITIONS]:
        _write(tmp_path / name, [1.0])
    with pytest.raises(UserError, match="at least 2 training steps"):
        masking.analyse(tmp_path)


def test_masking_command_on_micro_model(tmp_path, capsys):
    model = make_micro_policy(tmp_path / "model")
    out = tmp_path / "mask"
    # Without the micro preset's eval.every, the experiment's own default (evaluation off) applies.
    sets = [a for s in micro_overrides(model) if not s.startswith("eval.every=") for a in ("--set", s)]
    argv = ["experiment", "masking", "--steps", "3", "--window", "1", "--out", str(out), *sets]
    assert main(argv) == 0
    names = ["vanilla"] + [c.name for c in masking.CONDITIONS]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(names)
    for c in masking.CONDITIONS:
        cfg = yaml.safe_load((out / c.name / "config.yaml").read_text())
        assert cfg["method"]["name"] == "grad_mask"
        assert cfg["method"]["params"]["sample_sign"] == c.sample_sign
        assert cfg["method"]["params"]["s_sign"] == c.s_sign
        assert cfg["eval"]["every"] == 0 and cfg["train"]["max_steps"] == 3
        rows = read_jsonl(out / c.name / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        # Only one sign of A, and within it one sign of S, trains: most tokens are dropped.
        assert all(r["control/kept_frac"] < 0.6 for r in rows)
    assert all(r["control/kept_frac"] == 1.0 for r in read_jsonl(out / "vanilla" / "metrics.jsonl"))
    res = json.loads((out / "masking.json").read_text())
    # Independent check of each reported change against metrics.jsonl (window 1: step 3 minus step 1).
    for r in res["conditions"]:
        ent = [row["entropy/mean"] for row in read_jsonl(out / r["run"] / "metrics.jsonl")]
        assert r["change"] == pytest.approx(ent[-1] - ent[0])
        assert r["agrees"] == (r["observed"] == r["expected"])
    assert Image.open(out / "masking.png").format == "PNG"
    assert "Verdict" in (out / "masking.md").read_text()
    assert "Verdict" in capsys.readouterr().out
    # Rerunning resumes: finished runs are not trained again.
    mtimes = {n: (out / n / "metrics.jsonl").stat().st_mtime_ns for n in names}
    assert main(argv) == 0
    assert {n: (out / n / "metrics.jsonl").stat().st_mtime_ns for n in names} == mtimes
    assert main(["experiment", "masking", "--steps", "1", "--out", str(tmp_path / "x"), *sets]) == 2
    assert "--steps must be >= 2" in capsys.readouterr().err
