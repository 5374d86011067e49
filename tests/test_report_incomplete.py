"""``erft report`` says what it left out (issue 73, item 6): a log whose last line is unfinished, a run without
``run.json`` or ``config.yaml`` (never labelled as a method or model it may not be), and a run that ends before its
siblings, one line each, near the top of the page (escaped), in the terminal and in report.json. The runs are
written by hand (config.yaml, metrics.jsonl, run.json): no training."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from entropy_rft.cli.main import main
from entropy_rft.report.page import build_report

TORN = ("its last line is unfinished (no newline at its end: a write cut by a kill, or a copy still under way) and "
        "is left out; copy the run again once its writer has finished")
SHORT = ("its last steps are missing (a run still training, stopped, or copied in part): resume it, or copy it again "
         "once it has finished")


def write_run(d: Path, method: str = "none", *, seed: int = 0, steps: int = 4, planned: int = 4,
              config: bool = True, status: bool = True) -> Path:
    """A run of ``steps`` steps (entropy 1.0 falling by 0.1 a step, an evaluation at step 0 and at its last step)
    planned for ``planned``; without ``config`` no config.yaml, without ``status`` no run.json."""
    d.mkdir(parents=True)
    if config:
        cfg = {"method": {"name": method}, "train": {"seed": seed, "max_steps": planned}}
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for s in range(steps + 1):
        row: dict = {"step": s}
        if s:
            row.update({"entropy/mean": 1.0 - 0.1 * s, "reward/mean": 0.1 * s})
        if s in (0, steps):
            row.update({"eval/pass@1": 0.2 + 0.05 * s, "eval/entropy": 1.0 - 0.1 * s})
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if status:
        (d / "run.json").write_text(json.dumps({"schema": "erft.run/1", "status": "finished", "step": steps,
                                                "max_steps": planned}))
    return d


def tear(path: Path, cut: str) -> None:
    """Append ``cut``, a row cut mid-line (no newline), as a kill or a copy under way leaves it."""
    path.write_text(path.read_text() + cut)


def test_a_torn_last_line_and_a_run_short_of_its_siblings_are_named(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    short = write_run(cmp / "none-s0", steps=3)  # its step 4 was being copied: cut mid-line
    tear(short / "metrics.jsonl", '{"step": 4, "entropy/mean": 0.6, "rew')
    whole = write_run(cmp / "clip_b-s0", "clip_b")
    (whole / "token_records.jsonl").write_text('{"step": 1, "pred_dH": 0.5}\n{"step": 1, "pred')
    nums = build_report([cmp], tmp_path / "rep")
    lines = [f"{whole / 'token_records.jsonl'}: {TORN}", f"{short / 'metrics.jsonl'}: {TORN}",
             f"{short}: it ends at step 3, its siblings at step 4 (the runs of train.max_steps 4: clip_b-s0); {SHORT}"]
    assert nums["incomplete"] == lines  # clip_b-s0 comes first: erft compare folders are read in name order
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["incomplete"] == lines
    page = (tmp_path / "rep" / "report.html").read_text()
    assert page.index('<h2 id="incomplete">Incomplete runs</h2>') < page.index("<h2>Summary</h2>")
    assert all(f"<li>{line.replace(chr(39), '&#x27;')}</li>" in page for line in lines)
    assert main(["report", str(cmp), "--out", str(tmp_path / "rep2")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(f"  incomplete: {line}" in out for line in lines)


def test_a_run_without_config_yaml_or_run_json_is_unknown_not_the_default_model(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    write_run(cmp / "a-none", seed=0)
    bare = write_run(cmp / "b-copy", config=False, status=False)  # a half-copied run: its metrics.jsonl only
    nums = build_report([cmp], tmp_path / "rep")
    assert [(x["label"], x["method"], x["model"], x["seeds"]) for x in nums["series"]] == [
        ("none", "none", "default", [0]), ("unknown", "unknown", "unknown", [None])]
    assert nums["incomplete"] == [
        f"{bare}: no run.json, so whether the run finished is unknown; its rows are read as they are: copy the whole "
        "run folder",
        f"{bare}: no config.yaml, so its method, model and seed are unknown; shown as the series 'unknown', a run of "
        "no method: copy the run's config.yaml beside its metrics.jsonl"]
    assert [q["method"] for q in nums["quadrants"]] == ["none", "unknown"]  # not the vanilla loss's effects
    assert main(["report", str(cmp), "--out", str(tmp_path / "rep2")]) == 0
    out = capsys.readouterr().out
    assert f"  incomplete: {bare}: no config.yaml, so its method, model and seed are unknown" in out


def test_only_runs_of_the_same_planned_steps_are_siblings(tmp_path):
    cmp = tmp_path / "cmp"
    for seed in (0, 1):
        write_run(cmp / f"none-s{seed}", seed=seed, steps=4)
    stopped = write_run(cmp / "none-s2", seed=2, steps=2)  # planned for 4, stopped at 2
    write_run(cmp / "clip_b-s0", "clip_b", steps=2, planned=2)  # planned for 2: done, and no sibling of the 4s
    nums = build_report([cmp], tmp_path / "rep")
    assert nums["incomplete"] == [
        f"{stopped}: it ends at step 2, its siblings at step 4 (the runs of train.max_steps 4: none-s0, none-s1); "
        f"{SHORT}"]


def test_names_from_the_runs_are_shown_not_obeyed(tmp_path, capsys):
    run = write_run(tmp_path / "<img src=x onerror=alert(1)>\x1b[2J")
    tear(run / "metrics.jsonl", '{"step": 5')
    build_report([run], tmp_path / "rep")
    page = (tmp_path / "rep" / "report.html").read_text()
    listed = page[page.index('<h2 id="incomplete">'):page.index("<h2>Summary</h2>")]
    assert f"<li>{tmp_path}/&lt;img src=x onerror=alert(1)&gt;" in listed
    assert "<img src=x" not in page
    assert main(["report", str(run), "--out", str(tmp_path / "rep2")]) == 0
    out = capsys.readouterr().out
    assert f"  incomplete: {tmp_path}/<img src=x onerror=alert(1)>\\x1b[2J/metrics.jsonl: {TORN}" in out
    assert "\x1b" not in out
