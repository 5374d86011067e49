"""`make run-gpu` on CPU at tiny sizes (issue 27, item 6): configs/smollm2-gpu.yaml on SmolLM2 at 2 prompts x
2 samples x 8 tokens, two steps, one of its five methods, through benchmarks/gpu/realm.py: the shipped files only,
and a second call (a new lease: no run folder) trains nothing again. Also `erft compare --jobs`' CPU threads."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from entropy_rft.config.loading import load_config
from entropy_rft.launch.sweep import worker_threads
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.rundir.finished import SHIPPED

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2-gpu.yaml"
# One of the five methods (CI time: a SmolLM2 step takes ~15 s on 2 shared cores; two methods took 72 s
# beside the rest of the suite): the baseline; the five are the driver's default (checked below).
RUNS = ["none-s0"]
TINY = ["model.device=cpu", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "eval.every=2", "eval.prompts=2", "eval.samples=2", "eval.batch_size=4", "train.checkpoint_every=2",
        "probe.records_every=1", "train.threads=1", "train.tensorboard=false", "train.samples_every=1",
        # bf16 autocast off: a CPU without native bf16 (AVX2 alone) emulates it, and one step's backward took 58 s
        # against 8 s in float32 (what this test checks is the files, not the numbers)
        "model.autocast_bf16=false"]


def _driver():
    from benchmarks.gpu import realm

    return realm


def test_the_gpu_config_is_the_issue_s_comparison():
    """GRPO and the four methods from SmolLM2 with float32 master weights and bf16 compute, the graph sampler,
    >= 64 held-out prompts x 8 samples, >= 8 evaluations per run."""
    cfg = load_config(str(CONFIG))
    assert cfg.model.name == "smollm2-135m" and cfg.model.device == "cuda"
    assert cfg.model.dtype == "float32" and cfg.model.autocast_bf16
    assert cfg.rollout.cuda_graphs and cfg.rollout.backend == "static"
    # 64 of arith1's at most 200 distinct questions held out (issue 74), twice the CPU comparison's 32
    assert cfg.eval.prompts >= 64 and cfg.eval.samples >= 8 and cfg.task.params["val_size"] >= cfg.eval.prompts
    evals = {0, cfg.train.max_steps} | set(range(0, cfg.train.max_steps + 1, cfg.eval.every))
    assert len(evals) >= 8
    assert _driver().METHODS == "none,clip_b,clip_v,clip_cov,kl_cov"


def test_run_gpu_at_tiny_sizes_ships_small_files_and_resumes(smollm2_cache, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ERFT_CACHE", str(smollm2_cache))
    # The config's bf16 autocast on the CPU: under the AVX2 pin bf16 has no native instructions (a step took 47 s
    # against 8 s here); the runs this test starts compute on the CPU's own paths (what it checks is not numbers)
    from entropy_rft.common.numerics import PIN_ENV, PIN_VARIABLES

    monkeypatch.setenv(PIN_ENV, "0")
    for name in PIN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    drv = _driver()
    results, runs = tmp_path / "results", tmp_path / "runs"
    argv = ["--results", str(results), "--runs", str(runs), "--methods", "none", "--seeds", "1", "--jobs", "1",
            "--max-steps", "1",
            *sum((["--set", s] for s in TINY), [])]
    assert drv.main(argv) == 0
    for name in RUNS:
        assert sorted(p.name for p in (results / name).iterdir()) == sorted(SHIPPED)
        rows = read_jsonl(results / name / "metrics.jsonl")
        assert [r["step"] for r in rows if "entropy/mean" in r] == [1]
        assert sum("eval/pass@1" in r for r in rows) >= 2
        cfg = yaml.safe_load((results / name / "config.yaml").read_text())
        assert cfg["model"]["autocast_bf16"] is False and cfg["rollout"]["cuda_graphs"]  # the config, overrides in
        assert json.loads((results / name / "run.json").read_text())["device"] == "cpu"
    assert (runs / "none-s0" / "checkpoints").is_dir()  # left behind in the scratch folder
    summary = json.loads((results / "summary.json").read_text())
    assert sorted(r["method"] for r in summary["runs"]) == sorted(n[:-3] for n in RUNS)
    assert (results / "report" / "report.html").is_file()
    env = json.loads((results / "environment.json").read_text())
    assert env[-1]["complete"] and env[-1]["runs_finished"] == len(RUNS) and env[-1]["torch"]
    before = {n: (results / n / "metrics.jsonl").read_bytes() for n in RUNS}

    # A new lease: a bare machine, the committed results only. Nothing trains again.
    capfd.readouterr()
    (tmp_path / "runs").rename(tmp_path / "old-runs")
    argv[argv.index("--jobs") + 1] = "2"  # --jobs 2: a finished run starts no process
    assert drv.main(argv) == 0
    out = capfd.readouterr().out
    assert f"kept {len(RUNS)} run(s)" in out and out.count("already finished") == len(RUNS), out
    assert {n: (results / n / "metrics.jsonl").read_bytes() for n in RUNS} == before
    assert not (runs / "none-s0" / "checkpoints").exists()

    # A later wave with another setting (a lease kit wave keeps the committed runs): refused in one line, and
    # nothing trains or changes.
    capfd.readouterr()
    assert drv.main([*argv, "--set", "rollout.max_new_tokens=6"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert "rollout.max_new_tokens: 8 there, 6 now" in err[-1] and "none-s0 was trained with other settings" in err[-1]
    assert {n: (results / n / "metrics.jsonl").read_bytes() for n in RUNS} == before


def test_parallel_runs_on_one_accelerator_share_the_cores():
    assert worker_threads(4, 16, 0, "cuda") == 4
    assert worker_threads(5, 16, 0, "cuda:0") == 3
    assert worker_threads(32, 16, 0, "cuda") == 1
    assert worker_threads(4, 16, 2, "cuda") == 0  # train.threads set: the run's own
    assert worker_threads(2, 16, 0, "cpu") == 0  # CPU: entropy_rft.common.threads' rule
