"""The trainer: metrics, exact resume (SIGKILL included), run-directory rules, vanilla PPO equivalence."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from entropy_rft.cli.main import main
from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from entropy_rft.rundir.files import read_jsonl, truncate_jsonl
from entropy_rft.training import stages
from entropy_rft.training.records import Scored
from entropy_rft.training.state import build_run
from micro import again, make_micro_policy, micro_overrides

TESTS = Path(__file__).parent
VOLATILE = ("time/", "perf/")


def _no_nan(s: str):
    raise ValueError(f"non-JSON constant {s} in metrics")


def strict_rows(path: Path) -> list[dict]:
    return [json.loads(line, parse_constant=_no_nan) for line in path.read_text().splitlines()]


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


def cfg_for(model: Path, **extra):
    return load_config(None, micro_overrides(model, **extra))


def test_metrics_present_and_finite_or_null(micro_model, tmp_path):
    start(cfg_for(micro_model, **{"method.name": "clip_v"}), tmp_path / "run")
    rows = strict_rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    required = ["reward/mean", "reward/accuracy", "entropy/mean", "dynamics/s_star_mean", "dynamics/s_star_std",
                "dynamics/s_centered_mean", "dynamics/s_centered_std", "dynamics/cov_logp_adv",
                "dynamics/cov_adv_s_centered", "control/kept_frac", "lens/drop_frac/neg_sneg",
                "clip/ratio_frac", "policy/approx_kl", "optim/grad_norm", "response/length",
                "probe/sign_agreement", "probe/sign_agreement_weighted", "probe/corr", "probe/batch_sign_agree",
                "probe/dH_actual", "probe/dH_pred", "time/generate", "time/forward", "time/backward",
                "perf/tokens_per_s", "perf/peak_memory_gb"]
    for row in rows[1:]:
        for key in required:
            assert key in row, key
        for key, v in row.items():
            assert v is None or isinstance(v, (int, float, list)), (key, v)
            if isinstance(v, float):
                assert math.isfinite(v), key
    assert "eval/pass@1" in rows[0] and "eval/pass@4" in rows[2] and "eval/pass@4" in rows[4]
    # The second minibatch sees r != 1, so the ratio left 1 (the clip machinery is live).
    assert any(r["ratio/max"] > 1.0 or r["ratio/min"] < 1.0 for r in rows[1:])
    run = tmp_path / "run"
    assert (run / "final" / "model.safetensors").exists() and (run / "final" / "tokenizer.json").exists()
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    recs = read_jsonl(run / "token_records.jsonl")
    assert recs and {"s_centered", "adv", "pred_dH", "actual_dH", "kept"} <= set(recs[0])
    assert read_jsonl(run / "samples.jsonl")
    assert list((run / "tb").iterdir())


def test_same_seed_same_metrics_and_loss_is_live(micro_model, tmp_path):
    start(cfg_for(micro_model), tmp_path / "a")
    start(cfg_for(micro_model), tmp_path / "b")
    a = stable(read_jsonl(tmp_path / "a" / "metrics.jsonl"))
    b = stable(read_jsonl(tmp_path / "b" / "metrics.jsonl"))
    assert a == b
    start(cfg_for(micro_model, **{"train.seed": 1}), tmp_path / "c")
    assert stable(read_jsonl(tmp_path / "c" / "metrics.jsonl")) != a


def test_refuses_to_overwrite_and_resume_refuses_other_flags(micro_model, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--out", str(out), *sum((["--set", s] for s in micro_overrides(micro_model)), [])]
    assert main(args + ["--max-steps", "2"]) == 0
    before = (out / "metrics.jsonl").read_text()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_text() == before
    assert main(["train", "--resume", str(out), *again(out), "--method", "clip_b"]) == 2
    assert "--method" in capsys.readouterr().err
    # A finished run resumed without more steps exits 0 and changes nothing.
    assert main(["train", "--resume", str(out), *again(out)]) == 0
    assert (out / "metrics.jsonl").read_text() == before
    # --overwrite replaces it.
    assert main(args + ["--max-steps", "1", "--overwrite"]) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]


def test_bad_config_is_one_line_exit_2(micro_model, tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "x"), "--set", "optim.lr=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "optim.lr" in err and len(err.splitlines()) == 1
    assert main(["train", "--out", str(tmp_path / "x"), "--method", "clip_zzz"]) == 2
    err = capsys.readouterr().err
    assert "clip_zzz" in err and "clip_v" in err  # lists the valid names
    assert main(["train", "--out", str(tmp_path / "x"), "--set", "rollout.tempreature=1"]) == 2
    assert "rollout.tempreature" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_resume_after_clean_stop_equals_uninterrupted(micro_model, tmp_path):
    ref = tmp_path / "ref"
    start(cfg_for(micro_model, **{"train.max_steps": 6}), ref)
    part = tmp_path / "part"
    # Stop at 4 (an evaluation step: a run always evaluates at its last step, which adds eval/* keys).
    start(cfg_for(micro_model, **{"train.max_steps": 4, "train.checkpoint_every": 3}), part)
    assert main(["train", "--resume", str(part), *again(part), "--max-steps", "6"]) == 0
    assert stable(read_jsonl(part / "metrics.jsonl")) == stable(read_jsonl(ref / "metrics.jsonl"))


def test_torn_line_truncation(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "x": 1')
    assert truncate_jsonl(p, 2) == 3
    assert p.read_text() == '{"step": 0}\n{"step": 1}\n{"step": 2}\n'
    p.write_text('{"step": 0}\n{"step": 1}\n{"ste')
    assert truncate_jsonl(p, 5) == 2
    assert read_jsonl(p) == [{"step": 0}, {"step": 1}]


def _train_cmd(out: Path, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "entropy_rft.cli", "train", "--out", str(out),
            *sum((["--set", s] for s in sets), [])]


def test_sigkill_at_random_points_then_resume_is_exact(micro_model, tmp_path):
    sets = micro_overrides(micro_model, **{"train.max_steps": 8, "train.checkpoint_every": 2})
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ref = tmp_path / "ref"
    start(load_config(None, sets), ref)
    expected = stable(read_jsonl(ref / "metrics.jsonl"))

    out = tmp_path / "killed"
    rng = random.Random(1234)
    cmd = _train_cmd(out, sets)
    kills = 0
    for _attempt in range(6):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # Kill once the run has written a random number of steps (or a random time has passed).
        target = rng.randint(1, 7)
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            rows = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
            if rows and rows[-1].get("step", 0) >= target:
                time.sleep(rng.random() * 0.2)
                break
            time.sleep(0.01)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
        err = proc.stderr.read().decode()
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, err
        cmd = [sys.executable, "-m", "entropy_rft.cli", "train", "--resume", str(out), *again(out)]
    else:
        # Finish the run after the last kill.
        assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    assert kills >= 1
    assert stable(strict_rows(out / "metrics.jsonl")) == expected


def test_sigterm_saves_a_checkpoint_and_exits(micro_model, tmp_path):
    sets = micro_overrides(micro_model, **{"train.max_steps": 200, "train.checkpoint_every": 1000,
                                           "eval.every": 0})
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(out, sets), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and len(read_jsonl(out / "metrics.jsonl")) < 3:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert ckpts, "no checkpoint written on SIGTERM"
    step = int(ckpts[-1].name.split("_")[1])
    assert step == read_jsonl(out / "metrics.jsonl")[-1]["step"]


def test_loop_stops_when_asked_after_a_step_with_its_checkpoint(micro_model, tmp_path):
    """``trainer.train``'s ``stop`` (launch's SIGTERM/SIGINT flag) is read after each step: that step's
    checkpoint is saved (off the checkpoint_every grid), no final policy is written, and the loop says it did
    not finish; asked never, it runs to max_steps and exports final/."""
    from entropy_rft.rundir.logger import Logger
    from entropy_rft.training.trainer import train

    cfg = cfg_for(micro_model, **{"train.max_steps": 3, "train.checkpoint_every": 100, "eval.every": 0})
    out = tmp_path / "run"
    out.mkdir()
    run = build_run(cfg, out)
    logger = Logger(out, cfg, purge_step=None)
    last, finished = train(run, logger, stop=lambda: run.step == 2)
    logger.close(quiet=True)
    assert (last["step"], finished, run.step) == (2, False, 2)
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_000002"]
    assert not (out / "final").exists()
    run = build_run(cfg, tmp_path / "b")
    (tmp_path / "b").mkdir()
    logger = Logger(tmp_path / "b", cfg, purge_step=None)
    last, finished = train(run, logger)
    logger.close(quiet=True)
    assert (last["step"], finished) == (3, True) and (tmp_path / "b" / "final").is_dir()


def test_resume_without_checkpoint_restarts_from_step_1(micro_model, tmp_path):
    # A run killed before its first checkpoint (every 10 steps; the final one at step 2 removed as if never
    # written) starts again from step 1 and writes the same rows. With a deleted checkpoint that must have
    # existed, resume refuses instead (test_run_faults).
    out = tmp_path / "run"
    start(cfg_for(micro_model, **{"train.max_steps": 2, "train.checkpoint_every": 10}), out)
    ref = stable(read_jsonl(out / "metrics.jsonl"))
    import shutil

    shutil.rmtree(out / "checkpoints")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "torn')
    (out / "run.json").write_text('{"status": "running"}')
    assert main(["train", "--resume", str(out), *again(out)]) == 0
    assert stable(read_jsonl(out / "metrics.jsonl")) == ref


def _naive_ppo_step(model, opt, rb, old_logp, adv, mask, eps, temperature):
    """Independent vanilla PPO clipped surrogate, token-mean, from the model's full logits."""
    ids = torch.cat([rb.prompt_ids, rb.response_ids], 1)
    am = torch.cat([rb.prompt_mask, rb.response_mask], 1).long()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits
    p, r = rb.prompt_ids.shape[1], rb.response_ids.shape[1]
    lp = torch.log_softmax(logits[:, p - 1 : p + r - 1].double() / temperature, -1)
    logp = lp.gather(-1, rb.response_ids[..., None])[..., 0]
    ratio = torch.exp(logp - old_logp.double())
    a = adv.double()
    per_tok = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps))
    loss = (per_tok * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


# AdamW's eps for the tests that compare weights after updates by two computations of one gradient. Adam's first
# step moves an element by lr * g / (|g| + eps), whose slope at g = 0 is lr / eps: with torch's eps 1e-8 and lr 1e-2
# a 1e-11 difference in the last bits of a ~1e-8 gradient becomes a ~1e-6 one of the weight (seen when MKL's
# COMPATIBLE branch, issue 62, rounded the two paths' GEMMs apart in the last bit: gradients equal to 2e-8 on 0.15).
# With 1e-3 the slope is 10: the weights then compare the paths, not the optimiser's gain on near-zero gradients.
ADAM_EPS = 1e-3


def with_adam_eps(run, eps: float = ADAM_EPS):
    for group in run.optim.param_groups:
        group["eps"] = eps
    return run


def test_method_none_reproduces_vanilla_ppo(micro_model, tmp_path):
    cfg = cfg_for(micro_model, **{"algo.minibatches": 1, "optim.lr": 1e-2})
    torch.manual_seed(0)
    run = with_adam_eps(build_run(cfg, tmp_path))
    naive = copy.deepcopy(run.model)
    naive_opt = torch.optim.AdamW(naive.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0, eps=ADAM_EPS)
    exs = stages.sample_prompts(run)
    group = [e for e in exs for _ in range(cfg.rollout.group_size)]
    rb = stages.rollout(run, [e.prompt for e in group])
    rewards = torch.tensor([run.task.reward(r, e) for r, e in zip(rb.responses, group)])
    rewards[0], rewards[1] = 1.0, 0.0  # make sure the first group has signal
    s = Scored(group, rb, rewards, rb.response_mask.clone())
    old = stages.old_policy(run, s)
    sel = stages.select(run, s, old)
    for _ in range(3):  # three updates on the same batch: the ratio leaves 1 after the first
        stages.update(run, s, old, sel)
        _naive_ppo_step(naive, naive_opt, rb, old.logp, old.adv, s.mask.double(), 0.2, cfg.rollout.temperature)
    for (n, p1), p2 in zip(run.model.named_parameters(), naive.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-5, msg=n)


def test_loss_decreases_on_a_fixed_batch(micro_model, tmp_path):
    cfg = cfg_for(micro_model, **{"algo.minibatches": 1, "optim.lr": 3e-3, "algo.eps_low": "null",
                                  "algo.eps_high": "null"})
    run = build_run(cfg, tmp_path)
    exs = stages.sample_prompts(run)
    group = [e for e in exs for _ in range(cfg.rollout.group_size)]
    rb = stages.rollout(run, [e.prompt for e in group])
    rewards = torch.arange(len(group)).remainder(2).float()
    s = Scored(group, rb, rewards, rb.response_mask.clone())
    old = stages.old_policy(run, s)
    losses = [stages.update(run, s, old).metrics["loss/pg"] for _ in range(8)]
    assert losses[-1] < losses[0] - 1e-3, losses


@pytest.mark.parametrize("sets", [
    {"method.name": "clip_cov", "algo.minibatches": 2, "algo.grad_accum": 2},  # 2 updates x 2 micro-batches
    {"method.name": "entropy_adv", "algo.algorithm": "ppo", "algo.ppo_epochs": 2},  # a critic, adv_shift
])
def test_an_update_reads_its_metrics_in_one_transfer(micro_model, tmp_path, monkeypatch, sets):
    """Stages 7-8 keep every micro-batch's loss metrics, gradient norm and critic loss on the device and read them
    once, after the last optimizer update: one ``.tolist()`` in the loss's and the stages' code, no per-tensor
    read. The numbers are those of reading each tensor on its own (issue 66)."""
    from host_reads import Reads, per_tensor_metrics

    run = build_run(cfg_for(micro_model, **{"task.name": "micro:OverlapTask", **sets}), tmp_path)
    exs = stages.sample_prompts(run)
    group = [e for e in exs for _ in range(run.cfg.rollout.group_size)]
    s = stages.score(run, group, stages.rollout(run, [e.prompt for e in group]))
    old = stages.old_policy(run, s)
    sel = stages.select(run, s, old)
    pending = []
    read_updates = stages.read_updates
    monkeypatch.setattr(stages, "read_updates", lambda updates: pending.extend(updates) or read_updates(updates))
    reads = Reads(monkeypatch)
    reads.on = True
    upd = stages.update(run, s, old, sel)
    reads.on = False
    assert reads.made_in("loss_types.py", "stages.py") == ["tolist"]
    assert len(pending) == run.cfg.algo.minibatches * run.cfg.algo.ppo_epochs

    rows = []
    for u in pending:  # the same numbers, each tensor read on its own
        row = stages.mean_rows([per_tensor_metrics(o) for o in u.outs])
        row["optim/grad_norm"] = float(u.grad_norm)
        row["optim/lr"] = u.lr
        if u.value_losses is not None:
            row["loss/value"] = stages.weighted_sum([(float(v), n, of) for v, n, of in u.value_losses])
        rows.append(row)
    want = stages.mean_rows(rows)
    assert upd.metrics == want and list(upd.metrics) == list(want)
    assert upd.metrics["tokens/counted"] > 0 and ("loss/value" in want) == (sets.get("algo.algorithm") == "ppo")


def test_ppo_with_critic_runs(micro_model, tmp_path):
    start(cfg_for(micro_model, **{"algo.algorithm": "ppo", "train.max_steps": 3}), tmp_path / "ppo")
    rows = strict_rows(tmp_path / "ppo" / "metrics.jsonl")
    vals = [r["loss/value"] for r in rows if "loss/value" in r]
    assert len(vals) == 3 and all(math.isfinite(v) and v >= 0 for v in vals)


@pytest.mark.parametrize("method", ["clip_b", "clip_cov", "kl_cov", "clip_higher", "entropy_bonus",
                                    "high_entropy", "grad_mask", "clip_v_paper"])
def test_every_method_trains(micro_model, tmp_path, method):
    extra = {"method.name": method, "train.max_steps": 2, "eval.every": 0}
    if method in ("clip_cov", "kl_cov"):
        extra["method.params"] = "{ratio: 0.2, lb: -100.0, ub: 100.0}" if method == "clip_cov" else "{ratio: 0.2}"
    start(cfg_for(micro_model, **extra), tmp_path / method)
    rows = strict_rows(tmp_path / method / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    if method == "high_entropy":
        assert all(r["control/kept_frac"] < 0.5 for r in rows)
    if method == "clip_cov":
        assert max(r["control/zeroed_frac"] for r in rows) > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_equals_one_big_minibatch(micro_model, tmp_path, agg):
    """grad_accum=3 must give the same update as grad_accum=1 (uneven micro-batches, every aggregation)."""
    params = {}
    for accum in (1, 3):
        cfg = cfg_for(micro_model, **{"algo.minibatches": 1, "algo.grad_accum": accum, "algo.agg": agg,
                                      "optim.lr": 1e-2, "optim.max_grad_norm": "null", "method.name": "clip_v",
                                      "method.params": "{mu: 0.5}"})
        run = build_run(cfg, tmp_path / f"a{accum}")
        # Plain SGD: the update is -lr * grad (Adam's first step is sign-like and would amplify float noise).
        run.optim = torch.optim.SGD(run.model.parameters(), lr=1.0)
        exs = stages.sample_prompts(run)
        group = [e for e in exs for _ in range(cfg.rollout.group_size)]
        rb = stages.rollout(run, [e.prompt for e in group])
        rewards = torch.arange(len(group)).remainder(3).eq(0).float()
        s = Scored(group, rb, rewards, rb.response_mask.clone())
        old = stages.old_policy(run, s)
        sel = stages.select(run, s, old)
        assert sel.keep is not None and not bool(sel.keep[s.mask].all())  # ClipV drops something
        stages.update(run, s, old, sel)
        params[accum] = [p.detach().clone() for p in run.model.parameters()]
    for p1, p3 in zip(params[1], params[3]):
        torch.testing.assert_close(p1, p3, rtol=1e-5, atol=1e-7)


def test_reference_kl_is_zero_until_the_policy_moves(micro_model, tmp_path):
    """algo.ref_kl_coef > 0 loads a frozen copy of the base policy: the KL to it (measured before each step's
    update) is 0 until the first non-zero update, then positive, and its loss term is coef * KL."""
    start(cfg_for(micro_model, **{"algo.ref_kl_coef": 0.1, "train.max_steps": 8, "eval.every": 0,
                                  "algo.minibatches": 1}), tmp_path / "ref")
    rows = strict_rows(tmp_path / "ref" / "metrics.jsonl")
    first = next(i for i, r in enumerate(rows) if r["optim/grad_norm"] > 0)
    assert first < len(rows) - 1, "the policy never moved: no signal in this run"
    assert all(abs(r["kl/ref"]) < 1e-7 for r in rows[: first + 1])
    assert all(r["kl/ref"] > 1e-7 for r in rows[first + 1 :])
    last = rows[-1]
    assert last["loss/kl_ref"] == pytest.approx(0.1 * last["kl/ref"], rel=1e-4)


@pytest.mark.parametrize("method", ["none", "clip_v", "entropy_bonus"])
def test_single_update_reuses_the_old_policy_forward_exactly(micro_model, tmp_path, method):
    """With one update per batch the old-policy forward doubles as the update's forward (graph kept): the
    old log-probs, TokenStats and the parameters after the update equal those of a separate recompute."""
    cfg = cfg_for(micro_model, **{"algo.minibatches": 1, "method.name": method, "optim.lr": 1e-2})
    results = []
    for live in (True, False):
        torch.manual_seed(0)
        run = with_adam_eps(build_run(cfg, tmp_path / str(live)))
        assert stages.single_update(run)
        group = [e for e in stages.sample_prompts(run) for _ in range(cfg.rollout.group_size)]
        rb = stages.rollout(run, [e.prompt for e in group])
        rewards = torch.tensor([float(i % 3 == 0) for i in range(len(rb.responses))])
        s = Scored(group, rb, rewards, rb.response_mask.clone())
        fwd = stages.live_forward(run, s) if live else None
        assert fwd is None or fwd.logp.grad_fn is not None
        old = stages.old_policy(run, s, fwd)
        # the frozen record holds no autograd graph, live or not
        assert all(t.grad_fn is None and not t.requires_grad for t in (old.logp, old.adv, *vars(old.stats).values()))
        stages.update(run, s, old, stages.select(run, s, old), live=fwd)
        results.append((old.logp, old.stats.s_centered, [p.detach().clone() for p in run.model.parameters()]))
    (lp1, sc1, p1), (lp2, sc2, p2) = results
    torch.testing.assert_close(lp1, lp2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sc1, sc2, atol=1e-6, rtol=1e-6)
    start_params = list(build_run(cfg, tmp_path / "x").model.parameters())
    moved = sum(float((a - b).abs().sum()) for a, b in zip(p1, start_params))
    assert moved > 1e-3  # the update did change the policy
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_single_update_config_is_detected(micro_model, tmp_path):
    two = build_run(cfg_for(micro_model, **{"algo.minibatches": 2}), tmp_path / "a")
    accum = build_run(cfg_for(micro_model, **{"algo.minibatches": 1, "algo.grad_accum": 2}), tmp_path / "b")
    ppo = build_run(cfg_for(micro_model, **{"algo.minibatches": 1, "algo.algorithm": "ppo"}), tmp_path / "c")
    assert not any(stages.single_update(r) for r in (two, accum, ppo))


@pytest.mark.parametrize("sets", [{"model.autocast_bf16": "true"}, {"model.dtype": "bfloat16"}],
                         ids=["autocast-bf16", "bf16-weights"])
def test_bf16_training_runs_with_finite_float32_statistics(micro_model, tmp_path, sets):
    """The bf16 flags meant for a GPU also run on CPU: every step's metrics are finite (or null), the
    statistics (and the probe built on them) stay float32."""
    cfg = cfg_for(micro_model, **{"train.max_steps": 2, "eval.every": 0, "method.name": "clip_v", **sets})
    start(cfg, tmp_path / "run")
    rows = strict_rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("entropy/mean", "dynamics/s_centered_std", "probe/dH_actual", "optim/grad_norm"):
            assert r[k] is not None and math.isfinite(r[k]), (k, r[k])
    run = build_run(cfg, tmp_path / "probe")
    rb = stages.rollout(run, [e.prompt for e in stages.sample_prompts(run)])
    with stages.autocast(run):
        out = stages.forward(run, rb)
    assert out.stats.entropy.dtype == torch.float32 and torch.isfinite(out.stats.entropy).all()
