"""Issue 48, class 1: code is named by the person who runs erft, never by data.

Each test crafts what a hostile sender would: a run directory whose ``config.yaml`` names ``os:system`` as its task
with a shell command as parameter, a verl parquet row (``erft export-verl``'s ``extra_info``) edited the same way, a
model folder whose ``config.json`` maps to its own code. The command writes a marker file; the marker must never
appear, and each refusal is one line.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError


def erft(capsys, *argv) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()]


def hostile_run(folder: Path, marker: Path, **task) -> Path:
    """A run directory as a stranger could send it: erft's own config, its task swapped for a shell command."""
    from entropy_rft.config.loading import load_config
    from entropy_rft.config.schema import config_to_dict

    data = config_to_dict(load_config(None, []))
    data["task"] = task or {"name": "os:system", "params": {"command": f"touch {shlex.quote(str(marker))}"}}
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (folder / "final").mkdir()
    return folder


def test_resume_refuses_a_recorded_import_path_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "marker"
    run = hostile_run(tmp_path / "run", marker)
    rc, err = erft(capsys, "train", "--resume", run)
    assert rc == 2 and len(err) == 1, err
    assert "os:system" in err[0] and "--task os:system" in err[0]
    assert not marker.exists()


def test_resume_with_the_path_given_again_checks_the_target_before_calling_it(tmp_path, capsys):
    marker = tmp_path / "marker"
    run = hostile_run(tmp_path / "run", marker)
    rc, err = erft(capsys, "train", "--resume", run, "--task", "os:system")
    assert rc == 2 and len(err) == 1, err
    assert "not an entropy_rft Task subclass" in err[0]
    assert not marker.exists()
    rc, err = erft(capsys, "train", "--resume", run, "--task", "micro:DigitTask")  # another path: a change
    assert rc == 2 and len(err) == 1 and "cannot change it" in err[0], err


def test_a_recorded_reward_function_is_refused_on_resume(tmp_path, capsys):
    run = hostile_run(tmp_path / "run", tmp_path / "m", name="math",
                      params={"dataset": "math500", "reward": "os:system"})
    rc, err = erft(capsys, "train", "--resume", run)
    assert rc == 2 and len(err) == 1, err
    assert "task.params.reward" in err[0] and "--set task.params.reward=os:system" in err[0]


def test_eval_run_refuses_a_recorded_import_path_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "marker"
    run = hostile_run(tmp_path / "run", marker)
    rc, err = erft(capsys, "eval", "--run", run, "--out", tmp_path / "eval")
    assert rc == 2 and len(err) == 1, err
    assert "--dataset os:system" in err[0]
    assert not marker.exists() and not (tmp_path / "eval").exists()


def test_command_line_import_path_is_checked_before_it_is_called(tmp_path):
    from entropy_rft.training import preflight

    marker = tmp_path / "marker"
    with pytest.raises(UserError, match="not an entropy_rft Task subclass"):
        preflight.build_task("os:system", {"command": f"touch {shlex.quote(str(marker))}"}, flag="--task")
    assert not marker.exists()
    assert type(preflight.build_task("micro:DigitTask", {})).__name__ == "DigitTask"  # a Task subclass still works


def verl_row(task: str, params: dict) -> dict:
    return {"split": "train", "index": 0, "task": task, "task_params": json.dumps(params), "seed": 0}


def test_verl_reward_builds_no_import_path_from_a_row(tmp_path):
    from entropy_rft.integrations.verl_reward import compute_score

    marker = tmp_path / "marker"
    row = verl_row("os:system", {"command": f"touch {shlex.quote(str(marker))}"})
    with pytest.raises(ValueError, match="import_paths") as e:
        compute_score("erft:os:system", "1", None, row)
    assert "\n" not in str(e.value)
    # named by the launcher: still refused, because it is no Task, before it is called
    with pytest.raises(ValueError, match="not an entropy_rft Task subclass"):
        compute_score("erft:os:system", "1", None, row, import_paths="os:system")
    assert not marker.exists()
    bad_reward = verl_row("math", {"dataset": "math500", "reward": "os:system"})
    with pytest.raises(ValueError, match="task.params.reward"):
        compute_score("x", "1", None, bad_reward, import_paths="micro:DigitTask")


def test_verl_reward_scores_registered_and_launcher_named_tasks():
    from entropy_rft.integrations.verl_reward import compute_score
    from micro import DigitTask

    first = DigitTask().split(0)[0][0]
    row = verl_row("micro:DigitTask", {})
    assert compute_score("x", first.answer, first.answer, row, import_paths="a:b, micro:DigitTask") == 1.0
    assert compute_score("x", "?", None, row, import_paths=["micro:DigitTask"]) == 0.0


def remote_code_model(folder: Path, marker: Path) -> Path:
    """The micro policy whose config.json maps its config class to a file of its own that writes a marker."""
    from micro import make_micro_policy

    make_micro_policy(folder)
    (folder / "evil_config.py").write_text(
        "import pathlib\nfrom transformers import LlamaConfig\n"
        f"pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evil_llama'\n")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "evil_llama"  # a type transformers does not know: only the folder's code can read it
    cfg["auto_map"] = {"AutoConfig": "evil_config.EvilConfig", "AutoModelForCausalLM": "evil_config.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_model_folder_with_its_own_code_is_refused_in_one_line(tmp_path, monkeypatch):
    from entropy_rft.models.loading import load_policy

    marker = tmp_path / "marker"
    folder = remote_code_model(tmp_path / "policy", marker)
    monkeypatch.delenv("ERFT_TRUST_REMOTE_CODE", raising=False)
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # a user who answers transformers' prompt with y
    with pytest.raises(UserError, match="ERFT_TRUST_REMOTE_CODE=1") as e:
        load_policy(str(folder))
    assert "\n" not in str(e.value)
    assert not marker.exists()
