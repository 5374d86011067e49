"""More bad command lines: one line on stderr naming the flag and the fix, exit 2, nothing written.

Through ``entropy_rft.cli.main.main`` in-process; every case is refused before a model is loaded or a file is written
(each test checks the folder or file it would have written is absent, or the working folder unchanged).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from entropy_rft.cli.main import main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def refused(capsys, argv: list[str]) -> str:
    """``erft ARGV`` exits 2 with one stderr line; returns it."""
    assert main(argv) == 2
    return _one_line(capsys)


def refused_by_parser(capsys, argv: list[str]) -> str:
    """``erft ARGV`` is refused by argparse (SystemExit 2) with one stderr line; returns it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return _one_line(capsys)


# ----------------------------------------------------------------------------- export-verl


@pytest.mark.parametrize("cwd_has_file", [False, True])
def test_export_verl_empty_out_is_refused(tmp_path, monkeypatch, capsys, cwd_has_file):
    monkeypatch.chdir(tmp_path)
    if cwd_has_file:
        (tmp_path / "notes.txt").write_text("x")
    before = sorted(os.listdir(tmp_path))
    line = refused(capsys, ["export-verl", "--task", "countdown", "--out", ""])
    assert line == "erft export-verl: error: --out is empty; pass a folder, e.g. --out runs/my-run"
    assert sorted(os.listdir(tmp_path)) == before


def test_export_verl_negative_seed_is_refused(tmp_path, capsys):
    out = tmp_path / "verl"
    line = refused(capsys, ["export-verl", "--task", "countdown", "--seed", "-1", "--out", str(out)])
    assert line == "erft export-verl: error: --seed must be >= 0, got -1"
    assert not out.exists()


# ----------------------------------------------------------------------------- comma lists


@pytest.mark.parametrize("value,needle", [
    ("50,,100", "--vocab-sizes '50,,100' has an empty item"),
    ("50,", "--vocab-sizes '50,' has an empty item"),
    ("50,100,50", "--vocab-sizes '50,100,50' gives 50 twice"),
    ("", "--vocab-sizes is empty; give e.g. 50,1000"),
])
def test_probe_vocab_sizes_list_is_checked(tmp_path, capsys, value, needle):
    js = tmp_path / "probe.json"
    line = refused(capsys, ["probe", "--positions", "4", "--vocab-sizes", value, "--json", str(js)])
    assert line.startswith("erft probe: error: ") and needle in line and "e.g. 50,1000" in line
    assert not js.exists()


@pytest.mark.parametrize("value,needle", [
    ("1,,2", "--pass-k '1,,2' has an empty item"),
    ("2,2", "--pass-k '2,2' gives 2 twice"),
    ("", "--pass-k is empty; give e.g. 1,4"),
    ("1,x", "--pass-k '1,x': 'x' is not an integer"),
])
def test_eval_pass_k_list_is_checked(tmp_path, capsys, value, needle):
    out = tmp_path / "eval"
    line = refused(capsys, ["eval", "--model", "default", "--samples", "4", "--limit", "1", "--max-new-tokens", "1",
                            "--pass-k", value, "--out", str(out)])
    assert line.startswith("erft eval: error: ") and needle in line and "e.g. 1,4" in line
    assert not out.exists()


# ----------------------------------------------------------------------------- probe --text, --device


def test_probe_empty_text_is_refused(tmp_path, capsys):
    js = tmp_path / "probe.json"
    line = refused(capsys, ["probe", "--positions", "4", "--text", "", "--json", str(js)])
    assert line.startswith("erft probe: error: --text is empty;")
    assert not js.exists()


def test_probe_bad_device_is_refused_for_synthetic_too(tmp_path, capsys):
    js = tmp_path / "probe.json"
    line = refused(capsys, ["probe", "--model", "synthetic", "--positions", "4", "--device", "tpu",
                            "--json", str(js)])
    assert line == "erft probe: error: --device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got 'tpu'"
    assert not js.exists()


# ----------------------------------------------------------------------------- eval --checkpoints


def test_eval_checkpoints_without_run_is_refused(tmp_path, capsys):
    out = tmp_path / "eval"
    line = refused(capsys, ["eval", "--model", "default", "--checkpoints", "--samples", "1", "--limit", "1",
                            "--max-new-tokens", "1", "--out", str(out)])
    assert line.startswith("erft eval: error: --checkpoints needs --run RUN_DIR")
    assert "drop --checkpoints" in line
    assert not out.exists()


# ----------------------------------------------------------------------------- task parameters of a wrong type


def test_export_verl_task_param_of_wrong_type_names_it(tmp_path, capsys):
    out = tmp_path / "verl"
    line = refused(capsys, ["export-verl", "--task", "countdown", "--task-param", "max_target=abc",
                            "--out", str(out)])
    assert line == "erft export-verl: error: task 'countdown': param 'max_target' must be an integer, got 'abc'"
    assert not out.exists()


def test_eval_task_param_of_wrong_type_names_it(tmp_path, capsys):
    out = tmp_path / "eval"
    line = refused(capsys, ["eval", "--model", "default", "--dataset", "countdown", "--task-param", "n_val=[1]",
                            "--samples", "1", "--limit", "1", "--max-new-tokens", "1", "--out", str(out)])
    assert line == "erft eval: error: task 'countdown': param 'n_val' must be an integer, got [1]"
    assert not out.exists()


def test_train_task_param_of_wrong_type_names_it(tmp_path, capsys):
    out = tmp_path / "run"
    line = refused(capsys, ["train", "--set", "task.params.max_target=abc", "--max-steps", "1", "--out", str(out)])
    assert line == "erft train: error: task 'countdown': param 'max_target' must be an integer, got 'abc'"
    assert "not supported" not in line
    assert not out.exists()


needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="needs reasoning-gym")


@needs_rg
@pytest.mark.parametrize("argv,expected", [
    (["--set", "task.params.params.min_terms=abc"], "param 'params.min_terms' must be an integer, got 'abc'"),
    (["--set", "task.params.size=abc"], "param 'size' must be an integer, got 'abc'"),
    (["--set", "task.params.params={min_terms: 9, max_terms: 2}"],
     "reasoning-gym rejected param 'params' (max_terms must be >= min_terms); given: "
     "{'min_terms': 9, 'max_terms': 2}"),
])
def test_train_rg_param_of_wrong_type_names_it(tmp_path, capsys, argv, expected):
    out = tmp_path / "run"
    line = refused(capsys, ["train", "--task", "rg:chain_sum", *argv, "--max-steps", "1", "--out", str(out)])
    assert line == f"erft train: error: task 'rg:chain_sum': {expected}"
    assert not out.exists()


@needs_rg
def test_rg_unknown_param_lists_the_valid_ones(tmp_path, capsys):
    out = tmp_path / "verl"
    line = refused(capsys, ["export-verl", "--task", "rg:chain_sum", "--task-param", "params={nope: 1}",
                            "--out", str(out)])
    assert "has no parameter 'nope'" in line and "valid: min_terms, max_terms" in line
    assert not out.exists()


# ----------------------------------------------------------------------------- argparse errors


def test_unknown_option_after_a_command_points_to_its_help(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = refused_by_parser(capsys, ["train", "--nope"])
    assert line == "erft train: error: unrecognized arguments: --nope (see 'erft train --help')"
    line = refused_by_parser(capsys, ["eval", "--model", "default", "stray"])
    assert line == "erft eval: error: unrecognized arguments: stray (see 'erft eval --help')"
    assert os.listdir(tmp_path) == []


def test_unknown_option_before_the_command_points_to_erft_help(capsys):
    line = refused_by_parser(capsys, ["--nope", "methods"])
    assert line == "erft: error: unrecognized arguments: --nope (see 'erft --help')"


@pytest.mark.parametrize("flag", ["--entropy-target", "--entropy-t"])
def test_value_starting_with_dash_says_how_to_pass_it(tmp_path, monkeypatch, capsys, flag):
    monkeypatch.chdir(tmp_path)
    line = refused_by_parser(capsys, ["train", flag, "-0.5x", "--max-steps", "1"])
    assert line.startswith("erft train: error: argument --entropy-target: expected one argument;")
    assert "--entropy-target=-0.5x" in line and line.endswith("(see 'erft train --help')")
    assert os.listdir(tmp_path) == []


def test_missing_value_before_another_option_gets_no_dash_hint(capsys):
    line = refused_by_parser(capsys, ["train", "--entropy-target", "--max-steps", "1"])
    assert line == "erft train: error: argument --entropy-target: expected one argument (see 'erft train --help')"


def test_dash_value_written_with_equals_reaches_the_target_check(tmp_path, capsys):
    out = tmp_path / "run"
    line = refused(capsys, ["train", "--entropy-target=-0.5x", "--max-steps", "1", "--out", str(out)])
    assert "entropy_target" in line and "-0.5x" in line
    assert not out.exists()
