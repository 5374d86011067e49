"""The foreign-log readers on logs that verl's own code writes: ``verl.utils.tracking.Tracking`` with the
``console`` and ``file`` backends (``trainer.logger=['console','file']``), fed numpy scalars as verl's trainer
feeds them, the console text behind Ray's coloured worker prefix as ``ray`` prints a TaskRunner's stdout.
``erft fit-law`` on either file gives the plain least-squares fit of the same (H, R) pairs, and ``erft report``
draws them."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
from verl.utils.tracking import Tracking

from entropy_rft.cli.main import main

HS = [1.25, 1.05, 0.9, 0.8, 0.72, 0.66, 0.61, 0.58, 0.55, 0.53]
RAY = "\x1b[36m(TaskRunner pid=31337)\x1b[0m "


def score(h: float, i: int) -> float:
    """A validation score near the law -0.4*exp(H) + 1.1, with a deterministic wobble (so the fit is not exact)."""
    return -0.4 * math.exp(h) + 1.1 + 0.01 * ((i * 7) % 5 - 2)


def verl_logs(tmp_path, monkeypatch):
    jsonl = tmp_path / "file" / "exp.jsonl"
    jsonl.parent.mkdir()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(jsonl))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        tracker = Tracking(project_name="erft", experiment_name="exp", default_backend=["console", "file"])
        tracker.log({"val-core/openai/gsm8k/acc/mean@1": np.float64(0.02)}, step=0)  # val_before_train
        for i, h in enumerate(HS, 1):
            data = {"actor/entropy": np.float64(h), "actor/pg_loss": np.float64(-0.003 * i),
                    "critic/score/mean": np.float64(0.05 * i), "timing_s/step": 12.5, "training/global_step": i}
            if i % 2 == 0:
                data["val-core/openai/gsm8k/acc/mean@1"] = np.float64(score(h, i))
            tracker.log(data, step=i)
        tracker.finish()
    console = tmp_path / "console.log"
    console.write_text("".join(RAY + line + "\n" for line in buf.getvalue().splitlines()))
    return console, jsonl


def test_fit_law_on_verls_console_and_file_logs_is_the_plain_least_squares_fit(tmp_path, monkeypatch, capsys):
    console, jsonl = verl_logs(tmp_path, monkeypatch)
    assert "np.float64(" in console.read_text()  # as verl prints numpy scalars
    steps = [i for i in range(1, len(HS) + 1) if i % 2 == 0]
    hs = [HS[i - 1] for i in steps]
    rs = [score(HS[i - 1], i) for i in steps]
    x = np.stack([-np.exp(np.asarray(hs)), np.ones(len(hs))], 1)
    (a, b), *_ = np.linalg.lstsq(x, np.asarray(rs), rcond=None)
    fits = {}
    for name, path in (("console", console), ("file", jsonl)):
        assert main(["fit-law", str(path), "--json", str(tmp_path / f"{name}.json")]) == 0
        res = json.loads((tmp_path / f"{name}.json").read_text())
        assert res["source"] == f"verl-{name}" and res["entropy"] == "actor/entropy"
        assert res["metric"] == "val-core/openai/gsm8k/acc/mean@1" and res["skipped"] == 0
        assert res["points"] == {"step": steps, "entropy": hs, "accuracy": rs}
        assert res["fit"]["a"] == pytest.approx(a, rel=1e-9) and res["fit"]["b"] == pytest.approx(b, rel=1e-9)
        fits[name] = res["fit"]
    assert fits["console"] == fits["file"]
    capsys.readouterr()
    assert main(["report", str(console), str(jsonl), "--out", str(tmp_path / "rep")]) == 0
    nums = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert {"entropy", "accuracy", "law"} <= set(nums["figures"]) and len(nums["law"]) == 2
