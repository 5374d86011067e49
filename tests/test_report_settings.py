"""``erft report`` keeps runs of one method apart when their settings differ (issue 65, item 7): only runs that
differ in ``train.seed`` (and ``train.max_steps``) are seeds of one series, as ``erft compare`` requires of a
folder it reuses. The runs are written by hand (config.yaml, metrics.jsonl, run.json): no training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from entropy_rft.analysis.runs import assign_labels, load_run
from entropy_rft.cli.main import main
from entropy_rft.report.page import build_report


def _write_run(d: Path, *, seed: int, entropy_end: float = 0.5, **sections: dict) -> Path:
    """A finished 'none' run of 4 steps: entropy 1.0 falling to ``entropy_end``, evaluations at 0 and 4;
    ``sections`` are config sections laid over the method and the seed (``optim={"lr": 0.05}``)."""
    d.mkdir(parents=True)
    cfg = {"method": {"name": "none"}, **sections}
    cfg["train"] = {**cfg.get("train", {}), "seed": seed}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for s in range(5):
        h = 1.0 + (entropy_end - 1.0) * s / 4
        row: dict = {"step": s}
        if s:
            row.update({"entropy/mean": h, "reward/mean": 0.1 * s})
        if s in (0, 4):
            row.update({"eval/pass@1": 0.2 + 0.05 * s, "eval/entropy": h})
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "run.json").write_text(json.dumps({"schema": "erft.run/1", "status": "finished", "engine": "native"}))
    return d


def test_runs_of_one_method_with_other_settings_are_separate_named_series(tmp_path, capsys):
    # The example: two 'none' runs, seeds 0 and 1, optim.lr 2e-4 and 5e-2: not 'none ×2'.
    cmp = tmp_path / "cmp"
    _write_run(cmp / "none-s0", seed=0, optim={"lr": 2e-4})
    _write_run(cmp / "none-s1", seed=1, optim={"lr": 5e-2})
    nums = build_report([cmp], tmp_path / "rep")
    low, high = "none (optim.lr=0.0002)", "none (optim.lr=0.05)"
    assert [(x["label"], x["n"], x["seeds"], x["settings"]) for x in nums["series"]] == [
        (low, 1, [0], {"optim.lr": "0.0002"}), (high, 1, [1], {"optim.lr": "0.05"})]
    assert list(nums["methods"]) == [low, high]  # the table: one row each, not a mean of the two
    assert f"2 runs of 2 series ({low} ×1 and {high} ×1)" in nums["summary"]
    assert "none ×2" not in nums["summary"]
    (note,) = nums["settings"]
    assert note == ("the runs of none differ in settings other than the seed: optim.lr (0.0002, 0.05); each "
                    "setting is a series of its own, not averaged as seeds")
    page = (tmp_path / "rep" / "report.html").read_text()
    assert f'<p class="warn">Settings: {note}.</p>' in page
    assert f"<td>{low}</td>" in page and f"<td>{high}</td>" in page
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["settings"] == [note]
    # The terminal says it too.
    assert main(["report", str(cmp), "--out", str(tmp_path / "rep2")]) == 0
    out = capsys.readouterr().out
    assert f"2 series: {low}; {high};" in out and f"  settings: {note}" in out


def test_runs_that_differ_only_in_seed_and_max_steps_are_one_series_of_seeds(tmp_path):
    cmp = tmp_path / "cmp"
    _write_run(cmp / "none-s0", seed=0, entropy_end=0.6, optim={"lr": 5e-2}, train={"max_steps": 4})
    _write_run(cmp / "none-s1", seed=1, entropy_end=0.4, optim={"lr": 5e-2}, train={"max_steps": 8})
    nums = build_report([cmp], tmp_path / "rep")
    assert [(x["label"], x["n"], x["seeds"], x["settings"]) for x in nums["series"]] == [("none", 2, [0, 1], {})]
    assert nums["settings"] == []
    assert "2 runs of 1 method (none ×2)" in nums["summary"]
    # Averaged: final training entropy 0.6 and 0.4.
    assert nums["methods"]["none"]["n"] == 2
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "Settings:" not in page


def test_seeds_of_each_setting_stay_together_and_every_differing_field_is_named(tmp_path):
    cmp = tmp_path / "cmp"
    for seed in (0, 1):
        _write_run(cmp / f"a-s{seed}", seed=seed)
        _write_run(cmp / f"b-s{seed}", seed=seed, optim={"lr": 1e-3}, rollout={"temperature": 0.7})
    runs = [load_run(cmp / n) for n in ("a-s0", "a-s1", "b-s0", "b-s1")]
    (note,) = assign_labels(runs)
    a = "none (optim.lr=0.0002, rollout.temperature=1.0)"
    b = "none (optim.lr=0.001, rollout.temperature=0.7)"
    assert [r.label for r in runs] == [a, a, b, b]  # seeds 0 and 1 of each setting: one series of 2
    assert "optim.lr (0.0002, 0.001); rollout.temperature (1.0, 0.7)" in note


@pytest.mark.filterwarnings("ignore:Glyph 27")  # the ESC in a legend: matplotlib's font has no glyph for it
def test_settings_from_a_run_folder_are_shown_escaped_and_unreadable_ones_kept_apart(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    _write_run(cmp / "none-s0", seed=0, train={"project": "<img src=x onerror=alert(1)>\x1b[2J"})
    _write_run(cmp / "none-s1", seed=1)
    _write_run(cmp / "none-s2", seed=2, optim={"lr": -1.0})  # does not validate: its settings cannot be compared
    nums = build_report([cmp], tmp_path / "rep")
    labels = [x["label"] for x in nums["series"]]
    assert labels == ["none (train.project=<img src=x onerror=alert(1)>\x1b[2J)",
                      "none (train.project=entropy-rft)", "none [none-s2]"]
    assert any(n.startswith("none-s2: settings not compared (") and "optim.lr" in n for n in nums["settings"])
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert main(["report", str(cmp), "--out", str(tmp_path / "rep2")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "train.project=<img src=x onerror=alert(1)>\\x1b[2J" in out
