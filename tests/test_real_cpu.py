"""Issue 63: the papers' comparison on SmolLM2 on the CPU (`make run-real-cpu`), a sweep that survives being stopped.

The config is checked against the GPU comparison's design (two updates per batch, the same presets, >= 8
evaluations a run). The sweep's driver (benchmarks/gpu/realm.py, as `make run-real-cpu` calls it) is run on the
micro policy: a run finished in an earlier sitting is kept from the committed results, a sweep killed half-way
(every process SIGKILLed at one step, as when the machine stops) resumes its unfinished run from its checkpoint and
ends with the rows of an uninterrupted run, and a later sitting on a bare checkout trains nothing again.
"""

from __future__ import annotations

import os
from pathlib import Path

from entropy_rft.config.loading import load_config
from entropy_rft.rundir.files import FAULT_ENV, read_jsonl
from entropy_rft.rundir.finished import SHIPPED
from micro import make_micro_policy, micro_overrides
from test_determinism import stable
from test_gpu_config import _driver

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = ROOT / "configs" / "smollm2-cpu.yaml"
GPU_CONFIG = ROOT / "configs" / "smollm2-gpu.yaml"
LONG_CONFIG = ROOT / "configs" / "smollm2-cpu-long.yaml"
TESTS = Path(__file__).resolve().parent


def test_the_cpu_config_is_the_gpu_comparison_at_cpu_sizes():
    cpu, gpu = load_config(str(CPU_CONFIG)), load_config(str(GPU_CONFIG))
    assert cpu.model.name == "smollm2-135m" and cpu.model.device == "cpu" and cpu.model.dtype == "float32"
    assert not cpu.model.autocast_bf16  # bf16 runs emulated on an AVX2 CPU (docs/performance.md)
    assert cpu.algo.minibatches == gpu.algo.minibatches == 2 and cpu.algo.ppo_epochs == gpu.algo.ppo_epochs
    for name in ("none", "clip_v", "clip_cov", "kl_cov"):
        assert cpu.method.presets.get(name) == gpu.method.presets.get(name), name
    # ClipB: mu 2 in the committed 20-step runs; the GPU design takes the long run's mu 1.0, where the gate can act
    assert cpu.method.presets["clip_b"] == {"mu": 2.0}
    assert gpu.method.presets["clip_b"] == load_config(str(LONG_CONFIG)).method.presets["clip_b"] == {"mu": 1.0}
    assert gpu.task.name == cpu.task.name and gpu.task.params["params"] == cpu.task.params["params"]  # arith1
    assert (cpu.algo.eps_low, cpu.algo.eps_high, cpu.algo.agg) == (gpu.algo.eps_low, gpu.algo.eps_high, gpu.algo.agg)
    evals = {0, cpu.train.max_steps} | set(range(0, cpu.train.max_steps + 1, cpu.eval.every))
    assert len(evals) >= 8, sorted(evals)  # the law's fit needs 8 points
    assert cpu.eval.samples >= 8 and cpu.task.params["val_size"] >= cpu.eval.prompts
    assert cpu.train.checkpoints and cpu.train.checkpoint_every < cpu.train.max_steps  # a stop loses little


def test_the_long_config_is_the_20_step_one_but_for_what_issue_74_names():
    """Issue 74: every setting of configs/smollm2-cpu.yaml except 100 steps, an evaluation every 5 steps on all 32
    held-out questions at T = 0.7 (T = 1 up to step 20, greedy too), and ClipB at mu 1.0."""
    from entropy_rft.config.schema import changed_fields

    short, long = load_config(str(CPU_CONFIG)), load_config(str(LONG_CONFIG))
    changed = {k: (a, b) for k, a, b in changed_fields(short, long)}
    assert changed == {"train.max_steps": (20, 100), "eval.every": (3, 5), "eval.prompts": (16, 32),
                       "eval.temperature": (1.0, 0.7), "eval.extra_temperature": (0.0, 1.0),
                       "eval.extra_until_step": (None, 20), "eval.greedy": (False, True),
                       "eval.batch_size": (128, 256),
                       "method.presets.clip_b.mu": (2.0, 1.0)}, changed
    assert long.eval.prompts == long.task.params["val_size"] == 32
    evals = [s for s in range(long.train.max_steps + 1) if s % long.eval.every == 0]
    assert len([s for s in evals if 70 <= s <= 100]) == 7 and len(evals) >= 20  # W holds 7 evaluations


def test_a_stopped_cpu_sweep_resumes_where_it_stopped(tmp_path, monkeypatch, capfd):
    drv = _driver()
    policy = make_micro_policy(tmp_path / "policy")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    sets = micro_overrides(policy, **{"task.params": "{}", "train.max_steps": 4, "train.checkpoint_every": 2,
                                      "eval.every": 2, "probe.jvp_every": 0, "probe.counterfactual_every": 0})
    results, runs = tmp_path / "results", tmp_path / "runs"

    def sweep(methods: str, out: Path = runs, keep: Path = results) -> int:
        return drv.main(["--config", str(CPU_CONFIG), "--results", str(keep), "--runs", str(out), "--methods", methods,
                         "--seeds", "1", "--jobs", "2", "--export-every-s", "1", "--no-report",
                         *sum((["--set", s] for s in sets), [])])

    # an earlier sitting finished GRPO and committed it; the machine was then stopped
    assert sweep("none") == 0 and sorted(p.name for p in (results / "none-s0").iterdir()) == sorted(SHIPPED)
    grpo = (results / "none-s0" / "metrics.jsonl").read_bytes()
    (tmp_path / "runs").rename(tmp_path / "sitting-1")

    # this sitting: GRPO is kept from the results; ClipV trains, and every process is killed at step 3
    monkeypatch.setenv(FAULT_ENV, "after_row:3")
    assert sweep("none,clip_v") != 0
    assert not (results / "clip_v-s0").exists()  # an unfinished run is never shipped
    assert [r["step"] for r in read_jsonl(runs / "clip_v-s0" / "metrics.jsonl")] == [0, 1, 2, 3]

    # called again: ClipV resumes from its step-2 checkpoint, GRPO does not train again
    monkeypatch.delenv(FAULT_ENV)
    capfd.readouterr()
    assert sweep("none,clip_v") == 0
    out = capfd.readouterr().out
    assert "none seed 0: already finished, kept" in out and "clip_v seed 0: started" in out, out
    assert (results / "none-s0" / "metrics.jsonl").read_bytes() == grpo
    assert (results / "summary.json").is_file()
    clean = tmp_path / "clean"
    assert sweep("clip_v", out=clean, keep=tmp_path / "clean-results") == 0  # the same run, never stopped
    assert stable(read_jsonl(results / "clip_v-s0" / "metrics.jsonl")) == stable(
        read_jsonl(clean / "clip_v-s0" / "metrics.jsonl"))

    # a later sitting on a bare checkout: the committed results only; nothing trains
    (tmp_path / "runs").rename(tmp_path / "sitting-2")
    capfd.readouterr()
    assert sweep("none,clip_v") == 0
    assert capfd.readouterr().out.count("already finished, kept") == 2
