"""A run directory loses nothing: damaged logs, damaged checkpoints, two writers, --overwrite on a foreign
folder, a damaged run config, signals. Each fault ends with the metrics of an uninterrupted run (or with one
clear line and nothing changed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from entropy_rft.cli.main import main
from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from entropy_rft.rundir.files import read_jsonl, truncate_jsonl
from micro import again, make_micro_policy, micro_overrides

TESTS = Path(__file__).parent
VOLATILE = ("time/", "perf/")
ENV = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def steps(path: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(path)]


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


SETS = {"train.max_steps": 10, "train.checkpoint_every": 2, "train.keep_checkpoints": 3}


@pytest.fixture(scope="module")
def reference(micro_model, tmp_path_factory) -> list[dict]:
    """An uninterrupted 10-step run: checkpoints at 6, 8 and 10 are kept."""
    out = tmp_path_factory.mktemp("ref") / "run"
    start(load_config(None, micro_overrides(micro_model, **SETS)), out)
    return stable(read_jsonl(out / "metrics.jsonl"))


def finished_copy(micro_model, tmp_path, max_steps: int = 10) -> Path:
    out = tmp_path / "run"
    start(load_config(None, micro_overrides(micro_model, **{**SETS, "train.max_steps": max_steps})), out)
    return out


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def last_stderr_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


# ----------------------------------------------------------------------------- logs


def test_damaged_middle_line_is_rewritten_from_an_older_checkpoint(micro_model, tmp_path, reference, capsys):
    out = finished_copy(micro_model, tmp_path)
    m = out / "metrics.jsonl"
    ls = lines(m)
    assert json.loads(ls[7])["step"] == 7  # line 8 holds step 7 (step 0 is the base evaluation)
    ls[7] = ls[7][:25] + "\x00garbage\n"
    m.write_text("".join(ls))
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "12"]) == 0
    err = capsys.readouterr().err
    assert "lacks step(s) 7" in err and "step_000006" in err
    got = stable(read_jsonl(m))
    assert [r["step"] for r in got] == list(range(13))  # every step exactly once
    # Resuming at 6 reproduces steps 7..10 of the uninterrupted run exactly.
    assert got[:11] == reference
    assert (out / "metrics.jsonl.damaged").read_text().count("garbage") == 1


def test_damaged_line_before_every_checkpoint_keeps_every_intact_row(micro_model, tmp_path, capsys):
    out = finished_copy(micro_model, tmp_path)
    m = out / "metrics.jsonl"
    before = read_jsonl(m)
    ls = lines(m)
    ls[4] = "{not json\n"  # step 4: older than every kept checkpoint (6, 8, 10)
    m.write_text("".join(ls))
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "12"]) == 0
    err = capsys.readouterr().err
    assert f"{m}:5" in err and "set aside" in err and "stay missing" in err
    rows = read_jsonl(m)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, *range(5, 13)]
    assert stable(rows[:4]) == stable(before[:4]) and stable(rows[4:10]) == stable(before[5:11])
    assert json.loads((out / "metrics.jsonl.damaged").read_text()) == {"line": 5, "text": "{not json"}


def test_log_cut_short_before_the_checkpoint_is_written_again(micro_model, tmp_path, reference, capsys):
    out = finished_copy(micro_model, tmp_path)
    m = out / "metrics.jsonl"
    m.write_text("".join(lines(m)[:8]))  # steps 0..7 survive; the checkpoint is at 10
    (out / "run.json").write_text(json.dumps({"schema": "erft.run/1", "status": "running", "max_steps": 10}))
    assert main(["train", "--resume", str(out), *again(out)]) == 0
    assert "lacks step(s) 8, 9, 10" in capsys.readouterr().err
    assert stable(read_jsonl(m)) == reference


def test_torn_last_line_is_the_only_line_cut(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n{"step": 1}\nxx\n{"step": 2}\n{"step": 3}\n{"step": 4, "x"')
    assert truncate_jsonl(p, 3) == 4
    assert p.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    aside = [json.loads(x) for x in (tmp_path / "m.jsonl.damaged").read_text().splitlines()]
    assert aside == [{"line": 3, "text": "xx"}, {"line": 6, "text": '{"step": 4, "x"'}]


def test_read_jsonl_skips_a_bad_line_with_its_number(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n[1, 2]\n{"step": 2}\n{bad\n{"step": 4}\n{"step": 5, "tor')
    assert [r["step"] for r in read_jsonl(p)] == [0, 2, 4]
    err = capsys.readouterr().err
    assert f"{p}:2" in err and f"{p}:4" in err and ":6" not in err  # the torn tail is a write in progress


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("damage", ["truncate_model", "empty_optim", "missing_optim"])
def test_damaged_checkpoint_falls_back_to_the_newest_intact_one(micro_model, tmp_path, reference, capsys, damage):
    out = finished_copy(micro_model, tmp_path, max_steps=8)
    ck = out / "checkpoints" / "step_000008"
    if damage == "truncate_model":
        data = (ck / "model.pt").read_bytes()
        (ck / "model.pt").write_bytes(data[: len(data) // 2])
    elif damage == "empty_optim":
        (ck / "optim.pt").write_bytes(b"")
    else:
        (ck / "optim.pt").unlink()
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "10"]) == 0
    err = capsys.readouterr().err
    assert "step_000008" in err and "falling back to the older intact step_000006" in err
    assert stable(read_jsonl(out / "metrics.jsonl")) == reference


def test_no_intact_checkpoint_is_refused_in_one_line(micro_model, tmp_path, capsys):
    out = finished_copy(micro_model, tmp_path, max_steps=4)
    for ck in (out / "checkpoints").iterdir():
        (ck / "model.pt").write_bytes(b"PK\x03\x04 not a zip")
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "6"]) == 2
    line = last_stderr_line(capsys)
    assert line.startswith("erft train: error: no intact checkpoint") and "model.pt" in line
    assert (out / "metrics.jsonl").read_text() == before


def test_deleted_checkpoints_are_refused_not_retrained(micro_model, tmp_path, capsys):
    import shutil

    out = finished_copy(micro_model, tmp_path, max_steps=2)
    shutil.rmtree(out / "checkpoints")
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "4"]) == 2
    line = last_stderr_line(capsys)
    assert "no checkpoint in" in line and "the run finished" in line and "--overwrite" in line
    assert (out / "metrics.jsonl").read_text() == before


# ----------------------------------------------------------------------------- the run's config


@pytest.mark.parametrize("content", ["", "train: {max_steps: [1,\n", "- a list\n"])
def test_damaged_run_config_is_refused_and_left_alone(micro_model, tmp_path, capsys, content):
    out = finished_copy(micro_model, tmp_path, max_steps=2)
    (out / "config.yaml").write_text(content)
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "4"]) == 2
    line = last_stderr_line(capsys)
    assert f"run config {out / 'config.yaml'}" in line
    assert "checkpoints/step_000002/config.yaml" in line  # the fix: the checkpoint's copy
    assert (out / "config.yaml").read_text() == content
    assert steps(out / "metrics.jsonl") == [0, 1, 2]


def test_run_config_with_a_bad_field_names_the_file_and_the_fix(micro_model, tmp_path, capsys):
    out = finished_copy(micro_model, tmp_path, max_steps=2)
    text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(text + "foo: 1\n")
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "4"]) == 2
    line = last_stderr_line(capsys)
    assert f"run config {out / 'config.yaml'}" in line and "'foo'" in line
    assert "checkpoints/step_000002/config.yaml" in line
    assert steps(out / "metrics.jsonl") == [0, 1, 2]


@pytest.mark.parametrize("kind", ["empty", "foreign", "file"])
def test_resume_of_a_folder_that_is_not_a_run_writes_nothing(tmp_path, capsys, kind):
    target = tmp_path / kind
    if kind == "file":
        target.write_text("x")
    else:
        target.mkdir()
        if kind == "foreign":
            (target / "notes.txt").write_text("mine")
    before = sorted(p.name for p in target.iterdir()) if target.is_dir() else None
    assert main(["train", "--resume", str(target), *again(target)]) == 2
    line = last_stderr_line(capsys)
    assert ("is a file, not a run directory" if kind == "file" else "no config.yaml there") in line
    if before is not None:  # no lock file left behind
        assert sorted(p.name for p in target.iterdir()) == before


def test_training_that_diverges_stops_in_one_line_naming_the_lr(micro_model, tmp_path, capsys):
    out = tmp_path / "run"
    sets = micro_overrides(micro_model, **{"train.max_steps": 3, "optim.lr": 1e9})
    assert main(["train", "--out", str(out), *sum((["--set", s] for s in sets), [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logits are not finite" in err[0] and "lower optim.lr (now 1e+09)" in err[0], err
    assert json.loads((out / "run.json").read_text())["status"] == "failed"


# ----------------------------------------------------------------------------- --overwrite


def test_overwrite_refuses_a_folder_erft_did_not_create(micro_model, tmp_path, capsys):
    foreign = tmp_path / "mine"
    (foreign / "src").mkdir(parents=True)
    (foreign / "config.yaml").write_text("my: notes\n")
    (foreign / "notes.txt").write_text("keep me")
    sets = sum((["--set", s] for s in micro_overrides(micro_model, **{"train.max_steps": 1})), [])
    assert main(["train", "--out", str(foreign), "--overwrite", *sets]) == 2
    assert "not a run directory made by erft" in last_stderr_line(capsys)
    assert sorted(p.name for p in foreign.iterdir()) == ["config.yaml", "notes.txt", "src"]
    assert main(["train", "--out", str(foreign), *sets]) == 2  # without --overwrite: no advice to resume it
    line = last_stderr_line(capsys)
    assert "not a run directory made by erft" in line and "--resume" not in line
    assert sorted(p.name for p in foreign.iterdir()) == ["config.yaml", "notes.txt", "src"]

    run = finished_copy(micro_model, tmp_path, max_steps=1)
    (run / "notes.txt").write_text("keep me")
    assert main(["train", "--out", str(run), "--overwrite", *sets]) == 2
    assert "holds files erft did not write (notes.txt)" in last_stderr_line(capsys)
    assert (run / "notes.txt").read_text() == "keep me" and (run / "final").is_dir()

    (run / "notes.txt").unlink()
    assert main(["train", "--out", str(run), "--overwrite", *sets]) == 0
    assert steps(run / "metrics.jsonl") == [0, 1]


# ----------------------------------------------------------------------------- processes


def _train_cmd(out: Path, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "entropy_rft.cli", "train", "--out", str(out),
            *sum((["--set", s] for s in sets), [])]


def _wait_rows(path: Path, n: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(read_jsonl(path)) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not write {n} rows in time (exit {proc.poll()})")


def test_a_run_directory_has_one_writer(micro_model, tmp_path):
    # The first run must outlive three process starts even on a loaded machine: it is stopped by SIGTERM below.
    sets = micro_overrides(micro_model, **{"train.max_steps": 100_000, "train.checkpoint_every": 100_000,
                                           "eval.every": 0})
    out = tmp_path / "run"
    first = subprocess.Popen(_train_cmd(out, sets), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_rows(out / "metrics.jsonl", 2, first)
        cmds = (_train_cmd(out, sets),
                [sys.executable, "-m", "entropy_rft.cli", "train", "--resume", str(out), *again(out)],
                [*_train_cmd(out, sets), "--overwrite"])
        seconds = [subprocess.Popen(c, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for c in cmds]  # at once: each is refused while the first holds the run
        for second in seconds:
            _, stderr = second.communicate(timeout=120)
            assert second.returncode == 2, stderr
            err = stderr.strip().splitlines()
            assert err == [f"erft train: error: run directory {out} is in use by process {first.pid}; wait for it "
                           "to finish or stop it (a killed process releases the run at once)"]
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if first.poll() is None:
            first.kill()
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # one writer: no row twice


def test_sigterm_says_how_to_continue_and_records_stopped(micro_model, tmp_path):
    sets = micro_overrides(micro_model, **{"train.max_steps": 400, "train.checkpoint_every": 1000,
                                           "eval.every": 0})
    out = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(out, sets), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    _wait_rows(out / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 128 + signal.SIGINT
    err = proc.stderr.read().strip().splitlines()
    status = json.loads((out / "run.json").read_text())
    n = status["step"]
    assert status["status"] == "stopped" and n >= 3
    assert err == [f"stopped at step {n}, checkpoint saved; continue with "
                   f"`erft train --resume {out} --task micro:DigitTask`"]
    # Asking a resume for fewer steps than the checkpoint holds is refused, and changes nothing.
    low = subprocess.run([sys.executable, "-m", "entropy_rft.cli", "train", "--resume", str(out), *again(out),
                          "--max-steps", str(n - 1)], env=ENV, capture_output=True, text=True, timeout=120)
    assert low.returncode == 2
    assert low.stderr.strip().splitlines() == [
        f"erft train: error: --max-steps {n - 1} is below the {n} steps run {out} already holds; "
        f"pass --max-steps {n} or more"]
    assert json.loads((out / "run.json").read_text()) == status


def test_prompt_longer_than_the_context_is_refused_and_writes_nothing(micro_model, tmp_path, capsys):
    out = tmp_path / "run"
    # The micro policy has 64 positions; its prompts are 8 characters, one token each: 8 + 60 > 64.
    sets = micro_overrides(micro_model, **{"train.max_steps": 1, "rollout.max_new_tokens": 60})
    assert main(["train", "--out", str(out), *sum((["--set", s] for s in sets), [])]) == 2
    line = last_stderr_line(capsys)
    assert "rollout.max_new_tokens 60" in line and "> 64 positions" in line and "at most 56" in line
    assert not out.exists()
    sets = micro_overrides(micro_model, **{"train.max_steps": 1, "rollout.max_new_tokens": 56})
    assert main(["train", "--out", str(out), *sum((["--set", s] for s in sets), [])]) == 0


def test_a_full_disk_mid_run_is_one_line_naming_the_file(micro_model, tmp_path, capsys, monkeypatch):
    import errno

    from entropy_rft.rundir import files as rundir

    out = tmp_path / "run"
    real_write_many = rundir.JsonlWriter.write_many

    def full_after_step_2(self, records):
        records = list(records)
        if self.path.name == "metrics.jsonl" and any(r.get("step", 0) >= 3 for r in records):
            # What the kernel says to a flush on a full disk; the writer must name its file.
            self._f = type("Full", (), {"write": lambda _s, _t: 0, "flush": lambda _s: (_ for _ in ()).throw(
                OSError(errno.ENOSPC, "No space left on device")), "fileno": lambda _s: -1,
                "close": lambda _s: None, "closed": False})()
        return real_write_many(self, records)

    monkeypatch.setattr(rundir.JsonlWriter, "write_many", full_after_step_2)
    sets = micro_overrides(micro_model, **{"train.max_steps": 6})
    assert main(["train", "--out", str(out), *sum((["--set", s] for s in sets), [])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out / "metrics.jsonl") in err[0] and "disk is full" in err[0], err
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert steps(out / "metrics.jsonl") == [0, 1, 2]
