"""The report's one record (``analysis.report_data``): each run read once, and a page rendered from the record
alone."""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from entropy_rft.analysis.report_data import ReportData, report_data
from entropy_rft.report.page import build_report, write_report
from test_byo import verl_console
from test_damaged_runs import make_run

# The functions that read a run's files: (module file, function) -> the argument that names the file or folder.
READERS = {("rundir/files.py", "read_step_log"): "path", ("rundir/files.py", "read_jsonl"): "path",
           ("rundir/files.py", "read_status"): "out", ("rundir/checkpoints.py", "read_config_dict"): "out",
           ("analysis/engine_logs.py", "read_engine_log"): "path"}


@contextmanager
def counted_reads() -> Iterator[collections.Counter]:
    """Every call of a reader of ``READERS`` while the block runs, by (function, what it read), however the
    caller imported it."""
    reads: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            where = code.co_filename.replace("\\", "/").split("entropy_rft/")[-1]
            arg_name = READERS.get((where, code.co_name))
            if arg_name is not None:
                reads[(code.co_name, str(frame.f_locals.get(arg_name)))] += 1

    sys.setprofile(profile)
    try:
        yield reads
    finally:
        sys.setprofile(None)


def _runs(tmp_path: Path) -> list[Path]:
    """Two erft runs (one with a token view) and two logs of another engine (verl's console and file logs)."""
    a, b = make_run(tmp_path / "cmp" / "none-s0"), make_run(tmp_path / "cmp" / "none-s1")
    for d in (a, b):
        (d / "run.json").write_text(json.dumps({"schema": "erft.run/1", "status": "finished", "step": 20}))
    (b / "config.yaml").write_text((b / "config.yaml").read_text().replace("seed: 0", "seed: 1"))
    view = {"step": 20, "group": 0, "engine": "native", "prompt": "1+1",
            "responses": [{"reward": 1.0, "adv": 0.5, "tokens": ["2"], "h": [0.5], "sc": [0.1], "mark": ["kept"]}]}
    (a / "token_view.jsonl").write_text(json.dumps(view) + "\n")
    rows = [{"step": s, "data": {"actor/entropy": 1.0 / s, "val-core/gsm8k/acc/mean@1": 0.1 * s}} for s in range(1, 9)]
    (tmp_path / "exp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [tmp_path / "cmp", verl_console(tmp_path / "verl.log"), tmp_path / "exp.jsonl"]


def test_building_a_report_reads_each_file_of_each_run_once(tmp_path):
    paths = _runs(tmp_path)
    with counted_reads() as reads:
        nums = build_report(paths, tmp_path / "rep")
    assert len(nums["runs"]) == 4 and nums["token_view"]["runs"] == ["none-s0"]
    assert {f["run"] for f in nums["law"]} >= {"verl.log", "exp.jsonl"} and len(nums["doctor"]) == 4
    again = {what: n for what, n in reads.items() if n > 1}
    assert not again, f"read more than once: {again}"
    read = {what for _, what in reads}
    for run in ("none-s0", "none-s1"):
        d = tmp_path / "cmp" / run
        assert {str(d / "metrics.jsonl"), str(d), str(d / "token_records.jsonl")} <= read
    assert {str(tmp_path / "verl.log"), str(tmp_path / "exp.jsonl")} <= read
    assert str(tmp_path / "cmp" / "none-s0" / "token_view.jsonl") in read


def test_the_page_is_rendered_from_the_record_alone(tmp_path):
    data = report_data(_runs(tmp_path))
    assert isinstance(data, ReportData) and data.labels == (
        "none · native · default", "verl.log · verl · ?", "exp.jsonl · verl · ?")
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.paragraph = "another"  # type: ignore[misc]
    with counted_reads() as reads:
        nums = write_report(data, tmp_path / "rep")
    assert not reads  # no section reads a run again
    assert nums["summary"] == data.paragraph and nums["doctor"] == list(data.doctor)
    assert json.loads((tmp_path / "rep" / "report.json").read_text()) == json.loads(json.dumps(nums))
