"""Real verl jobs on the CPU: ``python -m verl.trainer.main_ppo`` in a subprocess, Ray, TransferQueue,
verl's FSDP2 engine and v1 trainer, the plug-in loaded through ``VERL_USE_EXTERNAL_MODULES``. What a CPU
machine lacks comes from the test-only harness in ``tests_verl/cpu_job/`` through verl's own hooks (a CPU
platform, gloo, the FSDP engines registered for ``cpu``, a transformers rollout server); no verl file is changed.

- ``none`` is stock verl: the same seeded job with verl's ``vanilla`` loss (trainer ``sync``) and with
  ``erft_none`` under ``erft_sync`` (the plug-in's worker) samples the same
  responses, scores the same rewards and logs the same per-step loss, gradient norm and entropy, to float32
  rounding (fp32 parameters; bit for bit only where the order of the batch's rows does not matter: maximum and
  minimum reward and advantage, response lengths);
- ClipV on 2 FSDP ranks under ``erft_sync``: the tokens it drops each step equal ``control.clip_v_mask`` on the
  batch gathered from both ranks (each rank's statistics, advantages, masks and keep mask recorded by
  ``erft_cpu_dump``), and ``actor/loss/counted_frac`` < 1 in verl's log; the command is the kit's launch script's;
- Clip-Cov and KL-Cov under verl's own ``sync`` trainer, 2 PPO epochs a step (the second off-policy): on every
  micro-batch the job trains on, ``erft_clip_cov`` and ``erft_kl_cov`` equal verl's own ``clip_cov`` and ``kl_cov``
  (loss, gradient with respect to log p, share of tokens zeroed), read from the same ``policy_loss`` keys
  (recorded by ``erft_cpu_peer``);
- ``erft fit-law`` and ``erft report`` on the console and file logs of the ``erft_none`` job (validation after every
  step) give the plain least-squares fit of its (entropy, validation score) pairs.

Each job takes 2-3 minutes on 2 loaded cores (about a minute of start-up).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "cpu_job"))

import erft_cpu_job as job  # noqa: E402

from entropy_rft import control  # noqa: E402

STEPS = 3
VALIDATION = ("trainer.test_freq=1", "data.val_max_samples=8", "trainer.logger=[console,file]",
              "actor_rollout_ref.rollout.val_kwargs.do_sample=True",  # sampled: greedy scores 0 on every prompt
              "actor_rollout_ref.rollout.val_kwargs.temperature=1.0")
KIT = Path(__file__).resolve().parents[1] / "examples" / "verl" / "qwen2.5-7b_clipv.sh"
FP32 = ("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_cpu")
    return job.make_model(root / "model"), job.export_data(root / "data")


def run(assets, out: Path, loss_mode: str, trainer_mode: str, env: dict[str, str] | None = None,
        **kw) -> dict[int, dict[str, float]]:
    """One main_ppo job; its per-step metrics from verl's console log."""
    model, data = assets
    args = job.overrides(model, data, out, loss_mode=loss_mode, trainer_mode=trainer_mode, **kw)
    return job.metrics(job.run_job(args, out, env=env))


@pytest.fixture(scope="module")
def none_jobs(assets, tmp_path_factory):
    """The stock job (verl's vanilla, trainer sync) and ours (erft_none under erft_sync, with validation after
    every step and verl's console and file loggers): (stock metrics, our metrics, our console log, our file log).
    Validation samples other prompts, each request from its own seeded generator, so it leaves the training
    rollouts as they are."""
    root = tmp_path_factory.mktemp("none")
    stock = run(assets, root / "vanilla", "vanilla", "sync", steps=STEPS, extra=FP32)
    jsonl = root / "erft_none.jsonl"
    ours = run(assets, root / "erft_none", "erft_none", "erft_sync", steps=STEPS, extra=(*FP32, *VALIDATION),
               env={"VERL_FILE_LOGGER_PATH": str(jsonl)})
    return stock, ours, root / "erft_none" / "job.log", jsonl


def test_none_is_stock_verl(none_jobs):
    stock, ours, _, _ = none_jobs
    assert sorted(stock) == sorted(ours) == list(range(1, STEPS + 1))
    for step in stock:
        a, b = stock[step], ours[step]
        # the same rollouts: same rewards, advantages and lengths (the weights after each step agree closely
        # enough that the seeded sampler draws the same tokens); means to float32 rounding, as the rows' order
        # in the batch may differ
        for key in ("critic/score/max", "critic/score/min", "critic/advantages/max", "critic/advantages/min",
                    "response_length/mean", "response_length/min"):
            assert a[key] == b[key], (step, key, a[key], b[key])
        for key in ("critic/score/mean", "critic/advantages/mean"):  # means of O(1) terms that cancel: absolute
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), (step, key)
        assert b["actor/loss/counted_frac"] == 1.0
        # the entropy: a mean over the batch's tokens, whose rows come in another order from run to run (verl's
        # agent loop), and after an update the weights differ by float32 rounding (the loss below)
        assert b["actor/entropy"] == pytest.approx(a["actor/entropy"], rel=1e-6), step
        # the loss: the same value up to float32 rounding (ours sums over the same tokens in another order)
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], rel=2e-6, abs=1e-7), step
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=2e-6), step


def gathered(files: list[Path]) -> dict[str, torch.Tensor]:
    """The ranks' records of one ``update_actor`` call, rows concatenated in rank order (padded on the right)."""
    recs = [torch.load(f) for f in sorted(files, key=lambda p: int(p.stem.split("rank")[1]))]
    width = max(r["keep"].shape[1] for r in recs)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    return {k: torch.cat([pad(r[k]) for r in recs]) for k in recs[0]}


def test_the_kits_clip_v_command_on_two_ranks_drops_the_global_rule(assets, tmp_path):
    """The kit's launch script (examples/verl/qwen2.5-7b_clipv.sh) as the command: its own overrides, with the
    model, sizes, devices, rollout and reward swapped by the harness, and ClipV's mu and cap lowered so that a
    16-response batch drops tokens (the kit's mu 8.5 with max_frac 1e-4 drops at most one token of a batch)."""
    model, data = assets
    dump, out = tmp_path / "dump", tmp_path / "kit"
    mu, max_frac = 0.2, 0.05
    harness = job.overrides(model, data, out, loss_mode="clip_v", trainer_mode="erft_sync", ranks=2, steps=2, extra=(
        f"+actor_rollout_ref.erft.mu={mu}", f"+actor_rollout_ref.erft.max_frac={max_frac}",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{job.EXTERNAL},erft_cpu_dump'"))
    args = job.kit_overrides(KIT, model, data, harness)
    kept = [a for a in args if a not in harness]
    assert "actor_rollout_ref.actor.use_dynamic_bsz=True" in kept and "trainer.v1.trainer_mode=erft_sync" in args
    logged = job.metrics(job.run_job(args, out, env={"ERFT_CPU_DUMP": str(dump)}))
    calls: dict[str, list[Path]] = {}
    for f in dump.glob("call*_rank*.pt"):
        calls.setdefault(f.stem.split("_")[0], []).append(f)
    assert len(calls) == 2 and all(len(v) == 2 for v in calls.values()), sorted(calls)
    for name, files in calls.items():
        g = gathered(files)
        mask = g["response_mask"]
        want = control.clip_v_mask(g["s_centered"], g["advantages"], mask, mu, None, "released", max_frac)
        assert torch.equal(g["keep"] & mask, want & mask), name
        assert (mask & ~g["keep"]).any(), name  # it drops something
    for step in (1, 2):
        assert logged[step]["actor/loss/counted_frac"] < 1.0, step


COV_KEYS = ("actor_rollout_ref.actor.policy_loss.clip_cov_ratio=1.0",  # every candidate: no random pick
            "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.05",
            "actor_rollout_ref.actor.policy_loss.clip_cov_ub=20.0",
            "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.2",
            "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1.0")


def test_clip_cov_and_kl_cov_equal_verls_own_on_the_jobs_micro_batches(assets, tmp_path):
    """A real erft_clip_cov job under verl's plain ``sync`` trainer (no erft worker: the parameters come from
    verl's own keys), 2 steps of 2 PPO epochs; every micro-batch's loss call also evaluates verl's clip_cov and
    kl_cov and our erft_kl_cov on the same inputs (tests_verl/cpu_job/erft_cpu_peer.py). In fp32: with verl's
    default bf16 parameters the log-probs arrive in bf16, verl forms the covariance in bf16 and ours in float32,
    and a token at the edge of Clip-Cov's band can fall on either side (seen: 15 tokens zeroed against 14)."""
    peer, out = tmp_path / "peer", tmp_path / "clip_cov"
    args = job.overrides(*assets, out, loss_mode="erft_clip_cov", trainer_mode="sync", steps=2, extra=(
        *COV_KEYS, *FP32, "actor_rollout_ref.actor.ppo_epochs=2",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='{job.EXTERNAL},erft_cpu_peer'"))
    logged = job.metrics(job.run_job(args, out, env={"ERFT_CPU_PEER": str(peer)}))
    records = [torch.load(f) for f in sorted(peer.glob("call*_rank0.pt"), key=lambda f: int(f.stem[4:-6]))]
    assert len(records) == 2 * 2 * 2, len(records)  # steps x epochs x micro-batches (16 responses, 8 a micro-batch)
    zeroed, off_policy = 0.0, 0.0
    for i, rec in enumerate(records):
        mask = rec["response_mask"]
        for theirs, ours in (("clip_cov", "erft_clip_cov"), ("kl_cov", "erft_kl_cov")):
            t, o = rec[theirs], rec[ours]
            assert torch.allclose(o["loss"], t["loss"], rtol=1e-6, atol=1e-8), (i, ours, o["loss"], t["loss"])
            scale = float(t["grad"].abs().max())
            assert torch.allclose(o["grad"], t["grad"], rtol=1e-5, atol=1e-6 * scale), (i, ours)
        assert rec["erft_clip_cov"]["metrics"]["loss/zeroed_frac"] == pytest.approx(
            rec["clip_cov"]["metrics"]["actor/pg_clipfrac"]), i
        zeroed = max(zeroed, rec["clip_cov"]["metrics"]["actor/pg_clipfrac"])
        off_policy = max(off_policy, float((rec["ratio"] - 1).abs()[mask].max()))
    assert zeroed > 0  # Clip-Cov zeroes tokens
    assert off_policy > 1e-3  # the second epoch is off-policy: KL-Cov's penalty acts
    assert all(logged[s]["actor/loss/zeroed_frac"] > 0 for s in (1, 2)), logged


def test_fit_law_and_report_on_the_real_jobs_logs(none_jobs, tmp_path):
    """The foreign-log readers on a genuine verl log: ``erft fit-law`` on the console log and on the file log the real
    job wrote gives the plain least-squares fit of its (actor/entropy, validation score) pairs, read here from
    the console log by the harness's own parser; ``erft report`` draws both."""
    from entropy_rft.cli.main import main

    _, ours, console, jsonl = none_jobs
    key = "val-aux/erft:countdown/reward/mean@1"  # the harness's reward (verl's acc is 0 without a 0/1 score)
    steps = [s for s in sorted(ours) if key in ours[s]]
    assert steps == list(range(1, STEPS + 1))
    hs = [ours[s]["actor/entropy"] for s in steps]
    rs = [ours[s][key] for s in steps]
    assert len(set(rs)) > 1, rs  # a fit of something
    x = np.stack([-np.exp(np.asarray(hs)), np.ones(len(hs))], 1)
    (a, b), *_ = np.linalg.lstsq(x, np.asarray(rs), rcond=None)
    for name, path in (("console", console), ("file", jsonl)):
        out = tmp_path / f"{name}.json"
        assert main(["fit-law", str(path), "--metric", key, "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["source"] == f"verl-{name}" and res["entropy"] == "actor/entropy" and res["metric"] == key
        assert res["points"]["step"] == steps
        assert res["points"]["entropy"] == pytest.approx(hs, rel=1e-9)
        assert res["points"]["accuracy"] == pytest.approx(rs, rel=1e-9)
        assert res["fit"]["a"] == pytest.approx(a, rel=1e-6, abs=1e-9)
        assert res["fit"]["b"] == pytest.approx(b, rel=1e-6, abs=1e-9)
    assert main(["report", str(console), str(jsonl), "--metric", key, "--out", str(tmp_path / "rep")]) == 0
    nums = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert {"entropy", "accuracy", "law"} <= set(nums["figures"])
