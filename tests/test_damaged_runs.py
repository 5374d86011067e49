"""Damaged run directories in ``erft report`` and ``erft fit-law``: one line naming the file (and line) and the
fix with exit 2, or, for a damaged line among intact ones, one warning per line and the rest used. Never an
internal error.

The runs are written here (a config.yaml and a metrics.jsonl of 20 steps with evaluations every 5), so that
each case takes a second or two; the reading code is the one a trained run goes through.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from entropy_rft.analysis.summary import run_summary
from entropy_rft.cli.main import main

STEPS = 20


def _rows() -> list[dict]:
    rows = []
    for s in range(STEPS + 1):
        h = 1.0 - 0.03 * s
        row: dict = {"step": s}
        if s >= 1:
            row.update({"entropy/mean": h, "reward/mean": 0.1 + 0.01 * s, "control/knob": 1.0})
        if s % 5 == 0:
            acc = 0.8 - 0.2 * math.exp(h)
            row.update({"eval/pass@1": acc, "eval/avg@4": acc, "eval/pass@4": acc + 0.1, "eval/entropy": h,
                        "eval/pass_rate_hist": [3, 3, 1, 0, 1]})
        rows.append(row)
    return rows


def _lines(rows: list[dict]) -> list[str]:
    return [json.dumps(r) + "\n" for r in rows]


def make_run(d: Path, lines: list[str] | None = None, *, backup: bool = False) -> Path:
    """A run directory: config.yaml, metrics.jsonl (``lines``, default 20 intact steps), and with ``backup`` a
    complete checkpoint holding a copy of config.yaml (as erft train writes one)."""
    d.mkdir(parents=True)
    cfg = yaml.safe_dump({"method": {"name": "none", "params": {}}, "train": {"seed": 0}})
    (d / "config.yaml").write_text(cfg)
    (d / "metrics.jsonl").write_text("".join(_lines(_rows()) if lines is None else lines))
    if backup:
        ck = d / "checkpoints" / "step_000020"
        ck.mkdir(parents=True)
        (ck / "DONE").write_text("")
        (ck / "config.yaml").write_text(cfg)
    return d


def with_line(d: Path, bad: str, at: int = 3) -> tuple[Path, int]:
    """A run whose metrics.jsonl has ``bad`` inserted as line ``at`` (1-based) among the intact rows."""
    lines = _lines(_rows())
    lines.insert(at - 1, bad + "\n")
    return make_run(d, lines), at


def report(capsys, *dirs: Path, out: Path) -> tuple[int, str, str]:
    rc = main(["report", *map(str, dirs), "--out", str(out)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def fit_law(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["fit-law", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_error_line(err: str) -> str:
    """stderr of a refused command: exactly one line, an error, never an internal one."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "internal error" not in err and "Traceback" not in err
    assert ": error: " in lines[0], err
    return lines[0]


def warnings(err: str) -> list[str]:
    assert "internal error" not in err and "Traceback" not in err, err
    return [x for x in err.splitlines() if x.startswith("erft: warning:")]


# ----------------------------------------------------------------------------- 1, 2: a step that is not a number


@pytest.mark.parametrize("step", ['"abc"', "null"])
def test_only_line_with_a_bad_step_is_one_error_line(tmp_path, capsys, step):
    run = make_run(tmp_path / "run", [f'{{"step": {step}, "entropy/mean": "x"}}\n'])
    rc, _, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 2
    line = one_error_line(err)
    assert f"{run / 'metrics.jsonl'}: no intact row (line 1 has step {step}, not a whole number >= 0)" in line
    assert "restore the file" in line and "--overwrite" in line
    assert not (tmp_path / "rep" / "report.html").exists()

    law = make_run(tmp_path / "law", [f'{{"step": {step}, "eval/pass@1": 0.5, "eval/entropy": 0.3}}\n'])
    rc, _, err = fit_law(capsys, str(law))
    assert rc == 2
    assert f"{law / 'metrics.jsonl'}: no intact row (line 1 has step {step}" in one_error_line(err)


@pytest.mark.parametrize("step", ['"abc"', "null"])
def test_a_bad_step_among_intact_rows_is_skipped_with_one_warning(tmp_path, capsys, step):
    run, n = with_line(tmp_path / "run", f'{{"step": {step}, "eval/pass@1": 0.5, "eval/entropy": 0.3}}')
    rc, out, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 0, err
    assert warnings(err) == [f"erft: warning: {run / 'metrics.jsonl'}:{n} has step {step}, not a whole number "
                             ">= 0; skipped"]
    assert f"{STEPS} training steps each" in out
    rc, out, err = fit_law(capsys, str(run))
    assert rc == 0, err
    assert len(warnings(err)) == 1 and f"metrics.jsonl:{n} has step {step}" in err
    assert "over 5 evaluations" in out  # the 5 intact evaluations, not the damaged one


# ----------------------------------------------------------------------------- 3: config.yaml


def test_empty_config_names_the_cp_that_restores_it(tmp_path, capsys):
    run = make_run(tmp_path / "run", backup=True)
    (run / "config.yaml").write_text("")
    rc, _, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 2
    backup = run / "checkpoints" / "step_000020" / "config.yaml"
    assert one_error_line(err).endswith(
        f"run config {run / 'config.yaml'} is empty; restore it with `cp {backup} {run / 'config.yaml'}`")

    # Inside a compare folder: the same line, about that run.
    cmp = tmp_path / "cmp"
    make_run(cmp / "none-s0")
    bad = make_run(cmp / "none-s1")
    (bad / "config.yaml").write_text("")
    rc, _, err = report(capsys, cmp, out=tmp_path / "rep2")
    assert rc == 2
    line = one_error_line(err)
    assert f"run config {bad / 'config.yaml'} is empty; restore it, or start a new run with --overwrite" in line


@pytest.mark.parametrize("text,what", [(b"\xff\xfe\x00", "is not UTF-8 text"), (b"[1, 2]\n", "must hold a mapping"),
                                       (b"method: [\n", "is not valid YAML"),
                                       (b"method: clip_v\n", "'method' must be a mapping")])
def test_damaged_config_is_one_line(tmp_path, capsys, text, what):
    run = make_run(tmp_path / "run", backup=True)
    (run / "config.yaml").write_bytes(text)
    rc, _, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 2
    line = one_error_line(err)
    assert f"run config {run / 'config.yaml'}" in line and what in line and "`cp " in line


def test_summary_of_a_run_without_config_reads_the_rest(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "config.yaml").unlink()
    s = run_summary(run)
    assert s["method"] is None and s["steps"] == STEPS


# ----------------------------------------------------------------------------- 4: a metrics.jsonl of garbage


@pytest.mark.parametrize("data", [b"garbage\n", b"\x00\x01\xff\xfe\n", b"[1,2]\n",
                                  b"[1,2]\n\"text\"\n{\"step\": -1}\n"])
def test_metrics_of_garbage_is_damaged_not_empty(tmp_path, capsys, data):
    run = make_run(tmp_path / "run")
    (run / "metrics.jsonl").write_bytes(data)
    rc, _, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 2
    line = one_error_line(err)  # no warning per line before it
    assert f"{run / 'metrics.jsonl'}: no intact row (line 1 is not a JSON object" in line
    assert "empty" not in line and "restore the file" in line
    if data.count(b"\n") == 3:
        assert "and 2 more line(s) are damaged" in line
    rc, _, err = fit_law(capsys, str(run))
    assert rc == 2 and "no intact row (line 1 is not a JSON object" in one_error_line(err)


def test_an_empty_metrics_file_is_still_empty(tmp_path, capsys):
    run = make_run(tmp_path / "run", [])
    rc, _, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 2 and "metrics.jsonl: empty; the run has not logged a step yet" in one_error_line(err)
    rc, _, err = fit_law(capsys, str(run))
    assert rc == 2 and "metrics.jsonl: empty; the run has not logged a step yet" in one_error_line(err)


def test_metrics_that_is_a_directory_is_named(tmp_path, capsys):
    run = make_run(tmp_path / "cmp" / "none-s0")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    want = f"{run / 'metrics.jsonl'}: is a directory, not a file; move it away and put the run's metrics.jsonl back"
    for target in (run, tmp_path / "cmp"):  # given directly, and inside a compare folder
        rc, _, err = report(capsys, target, out=tmp_path / "rep")
        assert rc == 2 and one_error_line(err).endswith(want)
    rc, _, err = fit_law(capsys, str(run))
    assert rc == 2 and one_error_line(err).endswith(want)


# ----------------------------------------------------------------------------- 5: one warning per damaged line


def test_report_warns_once_per_damaged_line(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    make_run(cmp / "none-s0")
    run, n = with_line(cmp / "none-s1", "garbage", at=7)
    want = [f"erft: warning: {run / 'metrics.jsonl'}:{n} is not a JSON object; skipped"]
    rc, _, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 0 and warnings(err) == want


def test_report_over_a_compare_folder_warns_once(tmp_path, capsys):
    cmp = tmp_path / "cmp"
    make_run(cmp / "none-s0")
    run, n = with_line(cmp / "none-s1", "garbage", at=7)
    rc, _, err = report(capsys, cmp, out=tmp_path / "rep")
    assert rc == 0 and warnings(err) == [f"erft: warning: {run / 'metrics.jsonl'}:{n} is not a JSON object; skipped"]


def test_compare_summary_reads_warn_once(tmp_path, capsys, monkeypatch):
    """erft compare reads each run's metrics.jsonl once, for the summary and the last knob: one warning."""
    from entropy_rft.analysis import summary

    run, n = with_line(tmp_path / "cmp" / "none-s0", "garbage", at=7)
    reads = []
    read = summary.read_step_log
    monkeypatch.setattr(summary, "read_step_log", lambda path, *a, **k: reads.append(path) or read(path, *a, **k))
    numbers, _, _ = summary.compare_summary([("none", run)], knob=True, equal_entropy=False)
    s = numbers["runs"][0]
    assert s["control/knob_last"] == 1.0 and s["steps"] == STEPS and len(reads) == 1
    assert warnings(capsys.readouterr().err) == [
        f"erft: warning: {run / 'metrics.jsonl'}:{n} is not a JSON object; skipped"]


# ----------------------------------------------------------------------------- 6: steps that are not steps


@pytest.mark.parametrize("bad,why", [
    ('{"entropy/mean": 0.5}', "has no step"),
    ('{"step": -3, "entropy/mean": 0.5}', "has step -3, not a whole number >= 0"),
    ('{"step": 1.5, "entropy/mean": 0.5}', "has step 1.5, not a whole number >= 0"),
    ('{"step": true, "entropy/mean": 0.5}', "has step true, not a whole number >= 0"),
    ('{"step": 999.5, "entropy/mean": 0.5}', "has step 999.5, not a whole number >= 0"),
    ('{"step": "7", "entropy/mean": 0.5}', 'has step "7", not a whole number >= 0'),
])
def test_rows_without_a_whole_step_are_skipped_with_one_warning(tmp_path, capsys, bad, why):
    lines = _lines(_rows())
    lines.append(bad + "\n")  # after the last step: would be the run's length if it were read
    run = make_run(tmp_path / "run", lines)
    n = len(lines)
    rc, out, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 0, err
    assert warnings(err) == [f"erft: warning: {run / 'metrics.jsonl'}:{n} {why}; skipped"]
    assert f"{STEPS} training steps each" in out
    assert "1.5 training" not in out and "True training" not in out and "999.5" not in out


def test_one_step_run_says_step_not_steps(tmp_path, capsys):
    run = make_run(tmp_path / "run", _lines(_rows()[:2]))
    rc, out, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 0, err
    assert "1 training step each." in out


def test_a_value_that_is_text_is_read_as_null(tmp_path, capsys):
    rows = _rows()
    rows[10]["eval/pass@1"] = "z"  # an evaluation row: max() over numbers and text used to fail
    rows[10]["eval/pass@4"] = {"a": 1}
    rows[11]["eval/pass_rate_hist"] = ["a"]
    rows[11]["eval/pass@1"] = 0.5
    run = make_run(tmp_path / "run", _lines(rows))
    rc, _, err = report(capsys, run, out=tmp_path / "rep")
    assert rc == 0, err
    assert warnings(err) == [f"erft: warning: {run / 'metrics.jsonl'}:11 has eval/pass@1 = \"z\", not a number "
                             "(and 1 other value(s)); read as null, the rest of the row used"]


# ----------------------------------------------------------------------------- 7: fit-law --metric


def test_fit_law_metric_not_in_the_run_lists_the_ones_it_has(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    rc, _, err = fit_law(capsys, str(run), "--metric", "nope")
    assert rc == 2
    line = one_error_line(err)
    assert f"{run / 'metrics.jsonl'}: --metric 'nope' is not among the run's evaluation metrics" in line
    assert "pick one of pass@1, avg@4, pass@4" in line and "eval.every" not in line
    rc, _, err = fit_law(capsys, str(run), "--metric", "")
    assert rc == 2 and "--metric is empty; give pass@1" in one_error_line(err)
    rc, out, err = fit_law(capsys, str(run), "--metric", "pass@4")
    assert rc == 0, err


def test_fit_law_on_a_run_without_evaluations_says_eval_every(tmp_path, capsys):
    run = make_run(tmp_path / "run", _lines([{"step": s, "entropy/mean": 0.5} for s in range(1, 4)]))
    rc, _, err = fit_law(capsys, str(run), "--metric", "nope")
    assert rc == 2
    assert "no evaluation rows (no eval/nope, nor any other eval/ metric); train with eval.every > 0" in (
        one_error_line(err))
