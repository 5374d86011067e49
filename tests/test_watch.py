"""Runs you can watch with no terminal: a line per training step (train.log_every), evaluation notes as lines,
``erft eval`` and ``erft filter`` progress as lines, and ``erft eval`` results written after each model."""

from __future__ import annotations

import io
import json
import math
import re
import sys
from pathlib import Path

import pytest

from entropy_rft.analysis import evaluate as eval_lib
from entropy_rft.cli.main import main
from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.training.step_log import StepLines, progress_bar, step_line
from micro import make_micro_policy, micro_overrides

STEP = re.compile(r"^step (\d+)/(\d+)  reward (\S+)  entropy (\S+)  kept (\S+)(?:  val pass@1 (\S+))?  (\S+) s/step$")


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


def _f3(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def test_non_tty_training_prints_one_line_per_step(micro_model, tmp_path, capsys):
    cfg = load_config(None, micro_overrides(micro_model, **{"train.progress": True, "train.log_every": 1}))
    start(cfg, tmp_path / "run")
    out = capsys.readouterr().out.splitlines()
    steps = [STEP.match(line) for line in out if line.startswith("step ") and "s/step" in line]
    assert all(steps), out
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert [int(m.group(1)) for m in steps] == [1, 2, 3, 4]
    for m in steps:
        row = rows[int(m.group(1))]
        assert m.group(2) == "4"
        assert m.group(3) == _f3(row["reward/mean"])
        assert m.group(4) == _f3(row["entropy/mean"])
        assert m.group(5) == _f3(row["control/kept_frac"])
        # eval.every = 2: the validation pass@1 on steps 2 and 4 only
        assert m.group(6) == (_f3(row["eval/pass@1"]) if "eval/pass@1" in row else None)
        assert math.isclose(float(m.group(7)), row["time/step"], abs_tol=0.006)
    assert [int(m.group(1)) for m in steps if m.group(6)] == [2, 4]
    # evaluation progress as lines, the step-0 evaluation included (eval.prompts = 8)
    assert "step 0 evaluation: 8/8 prompts" in out and "step 2 evaluation: 8/8 prompts" in out


def test_log_every_interval_first_and_last_step():
    def lines(every: int, start: int = 0) -> list[str]:
        buf = io.StringIO()
        bar = StepLines(10, every, start, file=buf)
        bar.note("step 0 evaluation: 0/8 prompts")
        for step in range(start + 1, 11):
            bar({"step": step, "reward/mean": 0.5, "entropy/mean": 0.25, "control/kept_frac": None,
                 "time/step": 29.34})
        return buf.getvalue().splitlines()

    got = lines(4)
    assert got[0] == "step 0 evaluation: 0/8 prompts"
    assert [int(STEP.match(s).group(1)) for s in got[1:]] == [1, 4, 8, 10]  # first, every 4th, last
    assert got[1] == "step 1/10  reward 0.500  entropy 0.250  kept -  29.3 s/step"
    assert [int(STEP.match(s).group(1)) for s in lines(4, start=5)[1:]] == [6, 8, 10]  # a resume's first step
    assert lines(0) == []  # 0: never, notes included
    assert step_line({"step": 3, "eval/pass@1": 0.125, "time/step": 0.042}, 5) == \
        "step 3/5  reward -  entropy -  kept -  val pass@1 0.125  0.04 s/step"


def test_progress_off_prints_nothing_and_terminal_gets_the_bar(monkeypatch, capsys):
    cfg = load_config(None, ["train.progress=false"])
    with progress_bar(cfg, 0) as bar:
        bar({"step": 1})
        bar.note("x")
    assert capsys.readouterr().out == ""
    cfg = load_config(None, [])
    with progress_bar(cfg, 0) as bar:
        assert isinstance(bar, StepLines)  # captured stdout: no terminal
    import entropy_rft.training.step_log as step_log

    monkeypatch.setattr(step_log, "is_live", lambda: True)
    with progress_bar(cfg, 0) as bar:
        assert not isinstance(bar, StepLines)


# ----------------------------------------------------------------------------- erft eval, erft filter


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("watch_eval")
    src = tmp / "d.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{a}{b}", "answer": str(a)}) + "\n"
                           for a in range(1, 10) for b in range(1, 4)))
    (tmp / "erft_watch_reward.py").write_text(
        "def rew(response, answer):\n    return float(response[:1] == str(answer))\n")
    sys.path.insert(0, str(tmp))
    return tmp, src


def _task_args(src: Path) -> list[str]:
    return ["--task-param", f"source={src}", "--task-param", "val_size=6", "--task-param", "prompt_format=plain",
            "--task-param", "reward=erft_watch_reward:rew", "--temperature", "1.0", "--max-new-tokens", "2",
            "--threads", "1"]


def test_eval_keeps_finished_models_when_interrupted(micro_model, data, tmp_path, monkeypatch, capsys):
    tmp, src = data
    second = make_micro_policy(tmp_path / "second", seed=1)
    out = tmp_path / "eval"
    args = ["eval", "--model", str(micro_model), "--model", str(second), "--dataset", "math", "--samples", "4",
            "--batch-size", "8", "--out", str(out), *_task_args(src)]
    real = eval_lib.load_model

    def load_model(spec, device, dtype):
        if spec["path"] == str(second):
            raise KeyboardInterrupt  # Ctrl-C while the second model loads
        return real(spec, device, dtype)

    monkeypatch.setattr(eval_lib, "load_model", load_model)
    assert main(args) == 130
    rep = json.loads((out / "eval.json").read_text())
    assert rep["complete"] is False
    assert [(r["model"], r["dataset"]) for r in rep["results"]] == [(str(micro_model), "math")]
    assert str(micro_model) in (out / "eval.md").read_text()
    assert not (out / "pass_rate_hist.png").exists()
    # progress with no terminal: a line before the first batch and after each (6 questions, 2 per batch)
    lines = [s for s in capsys.readouterr().out.splitlines()
             if s.startswith(f"{micro_model} on math: ") and s.endswith(" s")]
    assert [s.split(": ")[1].split()[0] for s in lines] == ["0/6", "2/6", "4/6", "6/6"]

    monkeypatch.setattr(eval_lib, "load_model", real)
    assert main(args) == 0
    rep2 = json.loads((out / "eval.json").read_text())
    assert rep2["complete"] is True and [r["model"] for r in rep2["results"]] == [str(micro_model), str(second)]
    assert rep2["results"][0]["metrics"] == rep["results"][0]["metrics"]  # same seed, same figures


def test_filter_prints_progress_per_batch(micro_model, data, tmp_path, capsys):
    tmp, src = data
    args = ["filter", "--model", str(micro_model), "--dataset", "math", "--n", "4", "--batch-size", "8",
            "--out", str(tmp_path / "f"), *_task_args(src)]
    assert main(args) == 0
    lines = [s for s in capsys.readouterr().out.splitlines() if s.startswith(f"filter math with {micro_model}: ")]
    # 27 rows, 6 held out: 21 training questions, 2 per batch of 8 sequences
    assert [s.split(": ")[1].split()[0] for s in lines] == [f"{d}/21" for d in (*range(0, 21, 2), 21)]
    assert json.loads((tmp_path / "f" / "filter.json").read_text())["questions"] == 21
