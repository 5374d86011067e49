"""``erft export-verl`` and the verl reward function (``integrations.verl_reward``), in the main virtualenv.

verl's own reading of the files and its reward manager's call are tested in ``tests_verl/test_export.py``.
"""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from entropy_rft.cli.main import main
from entropy_rft.integrations.verl_reward import compute_score, example_for
from entropy_rft.tasks import build_task

COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]
RG = ["--task", "rg:products", "--task-param", "size=20", "--task-param", "val_size=4"]


def export(tmp_path, capsys, *argv):
    out = tmp_path / "data"
    code = main(["export-verl", *argv, "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert "reward.custom_reward_function.name=compute_score" in stdout
    return {s: pq.read_table(out / f"{s}.parquet") for s in ("train", "val")}


def test_rg_products_rows_match_the_task_split(tmp_path, capsys):
    tables = export(tmp_path, capsys, *RG, "--seed", "3")
    train, val = build_task("rg:products", size=20, val_size=4).split(3)
    for split, examples in (("train", train), ("val", val)):
        table = tables[split]
        assert table.column_names == COLUMNS
        rows = table.to_pylist()
        assert len(rows) == len(examples) and len(rows) == (4 if split == "val" else 20)
        for i, (row, ex) in enumerate(zip(rows, examples)):
            assert row["data_source"] == "erft:rg:products" and row["ability"] == "rg:products"
            assert row["prompt"] == [{"role": "user", "content": str(ex.prompt)}]
            assert row["reward_model"] == {"style": "rule", "ground_truth": ex.answer}
            assert row["extra_info"] == {"split": split, "index": i, "task": "rg:products",
                                         "task_params": json.dumps({"size": 20, "val_size": 4}), "seed": 3}
            # checked by hand: the question is "a * b", the instruction asks for <answer> tags, the answer is a*b
            text = row["prompt"][0]["content"]
            a, b = map(int, re.search(r"(\d+) \* (\d+)", text).groups())
            assert text.endswith("Give your final answer inside <answer></answer> tags.")
            assert row["reward_model"]["ground_truth"] == str(a * b)


def test_countdown_rows_match_the_task_split(tmp_path, capsys):
    tables = export(tmp_path, capsys, "--task", "countdown", "--task-param", "n_val=8")
    train, val = build_task("countdown", n_val=8).split(0)
    assert tables["val"].num_rows == 8 and tables["train"].num_rows == len(train)
    rows = tables["val"].to_pylist()
    for i, (row, ex) in enumerate(zip(rows, val)):
        text = row["prompt"][0]["content"]
        assert row["prompt"] == [{"role": "user", "content": ex.prompt}]
        assert re.fullmatch(r"[1-9]{3}>\d\d:", text)  # "abc>TT:" by hand: the target is the two digits
        assert row["reward_model"]["ground_truth"] == str(int(text[4:6])) == str(ex.answer)
        assert row["extra_info"]["task"] == "countdown" and row["extra_info"]["index"] == i
    first = tables["train"].to_pylist()[0]
    assert first["prompt"][0]["content"] == train[0].prompt and first["extra_info"]["split"] == "train"


def _score(row, response):
    return compute_score(data_source=row["data_source"], solution_str=response,
                         ground_truth=row["reward_model"]["ground_truth"], extra_info=dict(row["extra_info"]))


def test_compute_score_uses_the_task_reward(tmp_path, capsys):
    tables = export(tmp_path, capsys, *RG)
    for split in ("train", "val"):
        for row in tables[split].to_pylist()[:3]:
            gold = row["reward_model"]["ground_truth"]
            assert _score(row, f"Thinking. <answer>{gold}</answer>") == 1.0
            assert _score(row, f"<answer>{int(gold) + 1}</answer>") == 0.0
            assert _score(row, gold) == 0.0  # the task's answer format: no tags, no reward
            task, ex = example_for(row["extra_info"])
            assert "entry" in ex.meta and ex.answer == gold  # the generator entry rg's verifier needs

    cd = export(tmp_path / "cd", capsys, "--task", "countdown", "--task-param", "n_val=4")["val"].to_pylist()
    for row in cd:
        task, ex = example_for(row["extra_info"])
        good = task.solutions(ex)[0]
        assert _score(row, good) == 1.0
        assert _score(row, "1+1+1+1") == 0.0


def test_compute_score_refuses_rows_it_cannot_place(tmp_path, capsys):
    row = export(tmp_path, capsys, *RG)["val"].to_pylist()[0]
    with pytest.raises(ValueError, match="export-verl"):
        compute_score("erft:rg:products", "x", "1", extra_info={})
    with pytest.raises(ValueError, match="export again"):
        compute_score("erft:rg:products", "x", "not the answer", extra_info=dict(row["extra_info"]))
    with pytest.raises(ValueError, match="outside"):
        compute_score("erft:rg:products", "x", "1", extra_info={**row["extra_info"], "index": 99})


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    code = main(["export-verl", "--task", "no_such_task", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "countdown" in err and "rg:<" in err
    assert not (tmp_path / "a").exists()
    code = main(["export-verl", "--task", "countdown", "--task-param", "nope=1", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "n_val" in err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    code = main(["export-verl", *RG, "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "notes.txt" in err
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["notes.txt"]


def test_offline_hint_names_this_commands_flag(tmp_path, capsys, monkeypatch):
    """The data hint names ``--task-param source=`` (what export-verl takes), not the config field
    ``task.params.source``: for a hub dataset that cannot be reached and for a missing local file."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for argv in (["--task", "dapo_math_17k"], ["--task", "math", "--task-param", f"source={tmp_path}/no.jsonl"]):
        code = main(["export-verl", *argv, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code != 0 and "--task-param source=" in err and "task.params" not in err, err
        assert not (tmp_path / "out").exists()
