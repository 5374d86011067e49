"""Issue 38: ``erft fit-law`` and ``erft report`` on runs made with other engines, as they lie on disk.

TRL's files come from TRL itself (stock ``GRPOTrainer`` and the plug-in, with evaluation each step, TensorBoard on);
verl's console and file logs from verl's own ``Tracking`` are tested in tests_verl/test_byo.py (verl's venv); here
verl's console format is transcribed for what Ray and colour codes add. Fits are checked against values made on
the law and against a plain least-squares fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from entropy_rft.analysis.engine_logs import detect, read_engine_log
from entropy_rft.cli.main import main
from test_damaged_runs import make_run

A, B = 0.5, 1.0
HS = [1.3, 1.1, 0.95, 0.8, 0.7, 0.6, 0.52, 0.45]


def on_law(h: float) -> float:
    return -A * math.exp(h) + B


def lstsq(hs, rs) -> tuple[float, float]:
    """The plain least-squares fit of R = -a*exp(H) + b (numpy, float64)."""
    x = np.stack([-np.exp(np.asarray(hs, dtype=np.float64)), np.ones(len(hs))], 1)
    (a, b), *_ = np.linalg.lstsq(x, np.asarray(rs, dtype=np.float64), rcond=None)
    return float(a), float(b)


def fit(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["fit-law", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- verl console (transcribed)

RAY = "\x1b[36m(TaskRunner pid=4242)\x1b[0m "


def console_line(step: int, data: dict) -> str:
    """A line as verl's console logger prints it (``concat_dict_to_str``: pprint of each number, numpy scalars
    as np.float64(x)), behind Ray's coloured prefix of a worker's stdout."""
    fields = [f"step:{step}"] + [f"{k}:{v}" for k, v in data.items()]
    return RAY + " - ".join(fields) + "\n"


def verl_console(path: Path, damaged: bool = False) -> Path:
    lines = ["\x1b[32mINFO\x1b[0m Ray started\n", RAY + "Training Progress:  10%|#  | 1/8\n",
             console_line(0, {"val-core/gsm8k/acc/mean@1": "np.float64(0.05)"})]  # before training: no H
    for i, h in enumerate(HS, 1):
        data = {"actor/entropy": f"np.float64({h!r})", "actor/pg_loss": "np.float64(-0.01)",
                "critic/score/mean": f"np.float64({0.1 * i!r})", "timing_s/gen": "1.25", "training/epoch": "0"}
        if i % 2 == 0 or i == 1:
            data["val-core/gsm8k/acc/mean@1"] = f"np.float64({on_law(h)!r})"
            data["val-core/math/acc/mean@1"] = f"np.float64({-0.25 * math.exp(h) + 0.8!r})"
            data["val-aux/gsm8k/reward/mean@1"] = "np.float64(0.3)"
        lines.append(console_line(i, data))
    if damaged:
        lines.insert(4, RAY + "step:3 - actor/entropy:np.float64(0.9\n")  # a line cut by a kill
        lines.insert(5, RAY + "step:3 - actor/entropy:oops - x\n")
    path.write_text("".join(lines))
    return path


def test_verl_console_log_reads_ray_prefixes_colour_codes_and_numpy_scalars(tmp_path):
    path = verl_console(tmp_path / "verl.log", damaged=True)
    assert detect(path) == "verl-console"
    log = read_engine_log(path)
    assert log.series("actor/entropy") == (list(range(1, 9)), HS)
    assert log.rows[0] == {"val-core/gsm8k/acc/mean@1": 0.05}
    assert log.rows[1]["timing_s/gen"] == 1.25
    assert log.skipped == 3  # "np.float64(0.9" and "oops" and the field "x"


def test_fit_law_on_a_verl_console_log_is_the_plain_least_squares_fit(tmp_path, capsys):
    path = verl_console(tmp_path / "verl.log")
    rc, out, _ = fit(capsys, path, "--json", tmp_path / "fit.json")
    assert rc == 0
    res = json.loads((tmp_path / "fit.json").read_text())
    assert res["source"] == "verl-console" and res["entropy"] == "actor/entropy"
    assert res["metric"] == "val-core/gsm8k/acc/mean@1" and res["other_metrics"] == ["val-core/math/acc/mean@1"]
    assert res["points"]["step"] == [1, 2, 4, 6, 8]  # step 0 (before training) has no entropy
    hs = [HS[s - 1] for s in res["points"]["step"]]
    assert res["points"]["entropy"] == hs
    a, b = lstsq(hs, [on_law(h) for h in hs])
    assert res["fit"]["a"] == pytest.approx(A, abs=1e-9) and res["fit"]["b"] == pytest.approx(B, abs=1e-9)
    assert res["fit"]["a"] == pytest.approx(a, abs=1e-9) and res["fit"]["b"] == pytest.approx(b, abs=1e-9)
    assert res["fit"]["ceiling"] == pytest.approx(B - A) and res["fit"]["r2"] == pytest.approx(1.0)
    assert "pick one with --metric KEY" in out and "val-core/math/acc/mean@1" in out
    for p in ("10%", "20%", "40%"):
        assert f"law/forecast_err@{p}" in res["final_forecast"]
    # another validation set, by name
    rc, _, _ = fit(capsys, path, "--metric", "val-core/math/acc/mean@1", "--json", tmp_path / "m.json")
    m = json.loads((tmp_path / "m.json").read_text())
    assert rc == 0 and m["metric"] == "val-core/math/acc/mean@1" and m["other_metrics"] == []
    assert m["fit"]["a"] == pytest.approx(0.25, abs=1e-9) and m["fit"]["b"] == pytest.approx(0.8, abs=1e-9)


def test_verl_file_logger_rows_and_tables_fit_the_same(tmp_path, capsys):
    rows = [{"step": 0, "data": {"val-core/gsm8k/reward/mean@4": 0.1}}]
    for i, h in enumerate(HS, 1):
        rows.append({"step": i, "data": {"actor/entropy_loss": h, "val-core/gsm8k/reward/mean@4": on_law(h),
                                         "perf/max_memory_allocated_gb": 12.5}})
    jsonl = tmp_path / "exp.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "data": \n')
    assert detect(jsonl) == "verl-file"
    rc, out, _ = fit(capsys, jsonl, "--json", tmp_path / "f.json")
    res = json.loads((tmp_path / "f.json").read_text())
    assert rc == 0 and res["entropy"] == "actor/entropy_loss" and res["skipped"] == 1  # early verl's key
    assert res["fit"]["n"] == len(HS) and res["fit"]["a"] == pytest.approx(A, abs=1e-9)
    assert "1 damaged line(s) or value(s) skipped" in out
    # the same numbers as a W&B export (CSV, "Step" column, own column names named by the flags)
    csv = tmp_path / "wandb.csv"
    csv.write_text("Step,my_entropy,my_val\n" + "".join(f"{i},{h!r},{on_law(h)!r}\n" for i, h in enumerate(HS, 1))
                   + "9,,\n")
    rc, _, _ = fit(capsys, csv, "--entropy-key", "my_entropy", "--metric", "my_val", "--json", tmp_path / "c.json")
    c = json.loads((tmp_path / "c.json").read_text())
    assert rc == 0 and c["source"] == "table" and c["fit"] == res["fit"]


@pytest.mark.parametrize("content,flag,must", [
    ("Step,loss,val\n1,0.5,0.1\n2,0.4,0.2\n3,0.3,0.3\n", "--entropy-key KEY", "no policy entropy series"),
    ("Step,actor/entropy,loss\n1,0.5,0.1\n2,0.4,0.2\n3,0.3,0.3\n", "--metric KEY", "no validation score"),
])
def test_missing_series_is_one_line_naming_the_file_the_keys_and_the_flag(tmp_path, capsys, content, flag, must):
    path = tmp_path / "run.csv"
    path.write_text(content)
    rc, out, err = fit(capsys, path, "--json", tmp_path / "x.json")
    line = one_line(err)
    assert rc == 2 and str(path) in line and must in line and flag in line and "loss" in line, line
    assert not (tmp_path / "x.json").exists()


def test_too_few_points_and_unknown_sources_are_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "run.csv"
    path.write_text("step,actor/entropy,val/test_score/gsm8k\n1,0.9,0.1\n")
    rc, _, err = fit(capsys, path)
    assert rc == 2 and str(path) in one_line(err)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    rc, _, err = fit(capsys, notes)
    assert rc == 2 and "--source" in one_line(err) and str(notes) in err
    rc, _, err = fit(capsys, tmp_path / "run.csv", "--entropy-key", "nope")
    assert rc == 2 and "--entropy-key 'nope' is not logged" in one_line(err)


# ----------------------------------------------------------------------------- TRL (its own files)


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory) -> dict[str, Path]:
    """Stock GRPOTrainer and the plug-in, 4 steps with evaluation and TensorBoard each step."""
    from trl import GRPOTrainer

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer
    from micro import make_micro_policy
    from test_trl_parity import PROMPTS, run

    tmp = tmp_path_factory.mktemp("byo-trl")
    policy = make_micro_policy(tmp / "policy")
    from datasets import Dataset

    kw = dict(steps=4, bf16=False, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8,
              report_to=["tensorboard"], save_strategy="steps", save_steps=4, temperature=1.5,
              trainer_kw={"eval_dataset": Dataset.from_dict({"prompt": PROMPTS})})
    out = {}
    for name, cls in (("stock", GRPOTrainer), ("plugin", EntropyControlGRPOTrainer)):
        run(cls, policy, tmp / name, **kw)
        out[name] = tmp / name
    return out


@pytest.mark.parametrize("which", ["stock", "plugin"])
def test_trl_output_dir_and_its_tensorboard_fit_the_same_pairs(trl_runs, tmp_path, capsys, which):
    folder = trl_runs[which]
    state = json.loads((folder / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    want_h = {r["step"]: r["entropy"] for r in state if "entropy" in r and "eval_reward" not in r}
    want_r = {r["step"]: r["eval_reward"] for r in state if "eval_reward" in r}
    steps = sorted(set(want_h) & set(want_r))
    assert len(steps) == 4
    rc, _, _ = fit(capsys, folder, "--json", tmp_path / "trl.json")
    res = json.loads((tmp_path / "trl.json").read_text())
    assert rc == 0 and res["source"] == "trl" and (res["entropy"], res["metric"]) == ("entropy", "eval_reward")
    assert res["points"] == {"step": steps, "entropy": [want_h[s] for s in steps],
                             "accuracy": [want_r[s] for s in steps]}
    a, b = lstsq(res["points"]["entropy"], res["points"]["accuracy"])
    assert res["fit"]["a"] == pytest.approx(a, rel=1e-6, abs=1e-9) and res["fit"]["b"] == pytest.approx(b, rel=1e-6,
                                                                                                         abs=1e-9)
    tb = folder / "runs"
    assert detect(tb) == "tensorboard"
    rc, _, _ = fit(capsys, tb, "--json", tmp_path / "tb.json")
    t = json.loads((tmp_path / "tb.json").read_text())
    assert rc == 0 and (t["entropy"], t["metric"]) == ("train/entropy", "eval/reward")
    assert t["points"]["step"] == steps
    np.testing.assert_allclose(t["points"]["entropy"], res["points"]["entropy"], rtol=1e-6)  # float32 in events
    np.testing.assert_allclose(t["points"]["accuracy"], res["points"]["accuracy"], rtol=1e-6)


def test_report_draws_foreign_runs_next_to_an_erft_run_and_names_what_it_leaves_out(trl_runs, tmp_path, capsys):
    erft_run = make_run(tmp_path / "erft-run")
    verl = verl_console(tmp_path / "verl.log")
    rc = main(["report", str(erft_run), str(trl_runs["stock"]), str(verl), "--out", str(tmp_path / "rep")])
    out = capsys.readouterr().out
    assert rc == 0
    nums = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert len(nums["runs"]) == 3 and {"entropy", "accuracy", "law"} <= set(nums["figures"])
    assert {f["run"] for f in nums["law"]} >= {"stock", "verl.log"}
    left_out = {o["figure"] for o in nums["omitted"]}
    assert "probe" in left_out and "probe" not in nums["figures"]
    assert "read verl-console log" in out and "read trl log" in out and "left out:" in out
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "verl.log" in html and "Figures left out" in html


def test_report_reads_every_source_kind(trl_runs, tmp_path, capsys):
    """``erft report`` on a verl file log, a CSV export and TensorBoard event files (with the keys named for the
    CSV by the flags): each run's law is drawn from its own pairs."""
    rows = [{"step": i, "data": {"actor/entropy": h, "val-core/gsm8k/acc/mean@1": on_law(h)}}
            for i, h in enumerate(HS, 1)]
    jsonl = tmp_path / "exp.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    csv = tmp_path / "export.csv"
    csv.write_text("step,actor/entropy,val/test_score/gsm8k\n"
                   + "".join(f"{i},{h!r},{on_law(h)!r}\n" for i, h in enumerate(HS, 1)))
    rc = main(["report", str(jsonl), str(csv), str(trl_runs["plugin"] / "runs"), "--out", str(tmp_path / "rep")])
    out = capsys.readouterr().out
    assert rc == 0
    nums = json.loads((tmp_path / "rep" / "report.json").read_text())
    fits = {f["run"]: f for f in nums["law"]}
    assert set(fits) == {"exp.jsonl", "export.csv", "runs"}
    for name in ("exp.jsonl", "export.csv"):
        assert fits[name]["fit"]["a"] == pytest.approx(A, abs=1e-9) and fits[name]["fit"]["n"] == len(HS)
    assert "read verl-file log" in out and "read table log" in out and "read tensorboard log" in out
