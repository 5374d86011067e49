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
