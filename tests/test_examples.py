"""The shipped examples run: examples/trl_clipv.py trains one step on the micro policy in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from micro import make_micro_policy  # noqa: E402


def test_trl_clipv_example_trains_one_step(tmp_path):
    policy = make_micro_policy(tmp_path / "policy")
    out = tmp_path / "out"
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))  # micro:DigitTask
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "examples" / "trl_clipv.py"), "--model", str(policy), "--task",
           "micro:DigitTask", "--out", str(out), "--max-steps", "1", "--num-generations", "4", "--batch-size", "8",
           "--max-completion-length", "6"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = out / "final"
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    assert (final / "tokenizer.json").is_file()
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()  # TRL ran its one optimizer step
    assert "control/kept_frac" in proc.stdout + proc.stderr  # erft's metrics were logged, so ClipV ran


def load_example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_your_reward_example_scores_by_hand():
    ex = load_example("trl_your_reward")
    texts = ["3+4", " 2*(1+2)", "3+", "9", "__import__('os')", "8/0", "7.0"]
    assert ex.my_reward(texts, target=[7, 6, 7, 7, 7, 7, 7]) == [1.0, 1.0, 0.0, 0.1, 0.0, 0.0, 0.0]
    ds = ex.my_dataset()
    assert len(ds) == 64 and all(p.endswith(f">{t:02d}:") for p, t in zip(ds["prompt"], ds["target"]))


def test_your_reward_example_logs_trl_and_erft_keys_to_tensorboard(tmp_path, capsys):
    """The "ClipV in your TRL script" page's example (docs/trl_your_script.md): the user's own dataset and reward,
    ClipV through EntropyControlGRPOTrainer; TRL's keys and erft's in the log lines and in TensorBoard."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ex = load_example("trl_your_reward")
    policy = make_micro_policy(tmp_path / "policy")
    ex.main(["--model", str(policy), "--out", str(tmp_path / "out"), "--max-steps", "2",
             "--max-completion-length", "6", "--method-params", '{"mu": 0.5, "max_frac": 0.05}',
             "--report-to", "tensorboard"])
    rows = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines() if line.startswith("log ")]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("entropy", "clip_ratio/region_mean", "grad_norm", "dynamics/s_centered_std", "control/kept_frac",
                "control/rollout_kept_frac", "dynamics/cov_adv_s_centered"):
        assert all(key in r for r in rows), key
    runs = list((tmp_path / "out" / "runs").iterdir())
    acc = EventAccumulator(str(runs[0]), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/entropy", "train/dynamics/s_centered_std", "train/control/kept_frac"} <= tags


def test_your_reward_example_method_none_equals_stock_grad_norm(tmp_path, capsys):
    """Issue 25's acceptance on the user's script (here on the micro policy; bf16 autocast, GRPOConfig's
    default): with method none, grad_norm, loss and TRL's entropy equal stock GRPOTrainer's at every step."""
    import json

    import pytest

    ex = load_example("trl_your_reward")
    policy = make_micro_policy(tmp_path / "policy")
    runs = {}
    for trainer in ("stock", "erft"):
        ex.main(["--model", str(policy), "--out", str(tmp_path / trainer), "--trainer", trainer, "--method", "none",
                 "--max-steps", "3", "--max-completion-length", "6"])
        runs[trainer] = [json.loads(line[4:]) for line in capsys.readouterr().out.splitlines()
                         if line.startswith("log ")]
    assert len(runs["stock"]) == len(runs["erft"]) == 3
    assert any(r["grad_norm"] > 0 for r in runs["stock"])  # some step trained
    for a, b in zip(runs["erft"], runs["stock"]):
        for key in ("grad_norm", "reward", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-9), (a["step"], key)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
