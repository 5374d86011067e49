"""Discoverable: ``erft tasks`` (names, parameters, defaults, help), defaults in every ``--help``, ``erft
methods`` at 80 columns (``--wide``: the table; ``--json`` unchanged)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from entropy_rft.cli.main import COMMANDS, main
from entropy_rft.tasks.introspect import parse_docstring


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def columns80(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")


# ----------------------------------------------------------------------------- erft tasks


def test_tasks_lists_every_task_and_the_rg_datasets(capsys, columns80):
    from entropy_rft.tasks import available_tasks
    from entropy_rft.tasks.rg import available_datasets

    code, out, _ = _run(capsys, "tasks")
    assert code == 0
    names = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert set(available_tasks()) | {"rg:<dataset>"} <= set(names)
    assert "n_val=256" in out and "canonical_mode='syntactic'" in out  # countdown's defaults
    assert all(d in out for d in available_datasets())
    assert max(len(line) for line in out.splitlines()) <= 80

    code, out, _ = _run(capsys, "tasks", "--json")
    got = {t["name"]: t for t in json.loads(out)}
    assert set(got) == set(available_tasks()) | {"rg:<dataset>"}
    assert got["rg:<dataset>"]["datasets"] == available_datasets()


def test_tasks_countdown_matches_its_signature_and_docstring(capsys):
    from entropy_rft.tasks.countdown import CountdownTask

    code, out, _ = _run(capsys, "tasks", "countdown", "--json")
    assert code == 0
    info = json.loads(out)
    sig = inspect.signature(CountdownTask).parameters
    assert [(p["name"], p["default"]) for p in info["params"]] == [(n, p.default) for n, p in sig.items()]
    assert all(p["help"] for p in info["params"])  # every one documented under Args:
    assert info["params"][0]["help"] == "validation prompts per split (drawn from the held-out pool)."
    code, out, _ = _run(capsys, "tasks", "countdown")
    assert "  max_target = 99\n      largest target" in out


def test_tasks_named_math_dataset_shows_what_its_name_sets(capsys):
    from entropy_rft.tasks.math import DATASETS

    code, out, _ = _run(capsys, "tasks", "dapo500", "--json")
    info = json.loads(out)
    params = {p["name"]: p for p in info["params"]}
    assert info["fixed"] == {"dataset": "dapo_math_17k"} and "dataset" not in params
    assert params["part"]["default"] == "val" and params["name"]["default"] == "dapo500"  # the factory's presets
    assert params["source"]["default"] == DATASETS["dapo_math_17k"].source  # the dataset spec's
    assert params["val_size"]["default"] == 500
    assert params["split"]["help"] == params["config"]["help"] == "hub split and config name."
    assert info["factory"] == "entropy_rft.tasks.math:dapo500"
    assert "dataset" in {p["name"] for p in json.loads(_run(capsys, "tasks", "math", "--json")[1])["params"]}


def test_tasks_rg_dataset_shows_its_own_config(capsys, columns80):
    from reasoning_gym.arithmetic.basic_arithmetic import BasicArithmeticDatasetConfig

    code, out, _ = _run(capsys, "tasks", "rg:basic_arithmetic", "--json")
    info = json.loads(out)
    own = {f["name"]: f["default"] for f in info["dataset_params"]}
    assert own["min_terms"] == BasicArithmeticDatasetConfig().min_terms
    assert own["operators"] == list(BasicArithmeticDatasetConfig().operators)
    assert "size" not in own and "seed" not in own  # the task sets them
    assert {p["name"] for p in info["params"]} >= {"size", "val_size", "answer_format", "params"}
    code, out, _ = _run(capsys, "tasks", "rg:basic_arithmetic")
    assert code == 0 and "  min_terms = 2  (int)" in out and max(map(len, out.splitlines())) <= 80


@pytest.mark.parametrize(("name", "names"), [("nosuch", "countdown, dapo500"), ("rg:basic_arithmetc",
                                                                                 "basic_arithmetic")])
def test_tasks_unknown_name_is_one_line_exit_2(capsys, name, names):
    code, out, err = _run(capsys, "tasks", name)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("erft tasks: error: unknown") and names in err


def test_parse_docstring_args_section():
    doc = """Summary line. More.

    Args:
        a: first
            continued.
        b, c: shared help.
        not a param line: ignored text
    Returns:
        x: not an arg
    """
    head, helps = parse_docstring(doc)
    assert head == "Summary line. More."
    assert helps == {"a": "first continued.", "b": "shared help. not a param line: ignored text",
                     "c": "shared help. not a param line: ignored text"}


def test_cli_import_stays_light():
    code = ("import sys, entropy_rft.cli.main as c; c.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'reasoning_gym', 'rich') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr


# ----------------------------------------------------------------------------- defaults in --help


def _help(capsys, monkeypatch, cmd: str) -> str:
    monkeypatch.setenv("COLUMNS", "300")  # no wrapping inside "(default: X)"
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_eval_and_filter_help_show_defaults(capsys, monkeypatch):
    out = _help(capsys, monkeypatch, "eval")
    for want in ("(default: 32)", "(default: 0.7)", "(default: 1024)", "(default: cpu)", "(default: float32)",
                 "(default: eval)"):
        assert want in out, want
    out = _help(capsys, monkeypatch, "filter")
    for want in ("(default: smollm2-135m)", "(default: dapo_math_17k)", "(default: 1/16)", "(default: 15/16)",
                 "(default: 16)", "(default: filtered)"):
        assert want in out, want


@pytest.mark.parametrize("cmd", [m.NAME for m in COMMANDS])
def test_every_help_shows_only_meaningful_defaults(capsys, monkeypatch, cmd):
    out = _help(capsys, monkeypatch, cmd)
    for bad in ("(default: None)", "(default: False)", "(default: [])", "(default: ==SUPPRESS==)"):
        assert bad not in out
    assert out.count("(default:") + out.count("(default ") <= out.count("\n  -")  # at most one per option


# ----------------------------------------------------------------------------- erft methods


def test_methods_fit_80_columns_and_json_unchanged(capsys, columns80):
    from entropy_rft import control

    code, out, _ = _run(capsys, "methods")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    for name in control.available_methods():
        assert f"\n{name}  (" in "\n" + out
    code, out, _ = _run(capsys, "methods", "--json")
    assert json.loads(out) == [control.method_info(n) for n in control.available_methods()]
    code, out, _ = _run(capsys, "methods", "--json", "clip_v")
    assert [m["name"] for m in json.loads(out)] == ["clip_v"]


def test_methods_wide_is_the_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = _run(capsys, "methods", "--wide", "clip_v")
    assert code == 0 and "entropy-control methods" in out and "knob ↑ ⇒ entropy" in out and "clip_v" in out
