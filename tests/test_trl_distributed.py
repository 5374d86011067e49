"""Two CPU processes (gloo): the TRL integration's selections are global, equal to the single-process ones.

Spawns two processes with torch.multiprocessing (cheaper than ``accelerate launch`` on a shared 2-core
machine; the process group is the same one ``accelerate launch`` sets up: env:// with gloo). Each process:

1. holds an uneven slice of one synthetic batch (different row counts and padded widths) and checks that
   ClipB/ClipV (with cap)/80-20 keep-masks, Clip-Cov's random pick and KL-Cov's top-k from
   ``integrations.window`` equal the single-process masks on the whole batch, that the per-rank computation
   would differ (so the check can fail), and that the re-weighted micro-batch losses, summed over micro-
   batches and averaged over ranks as DDP does, equal the whole-batch loss;
2. runs EntropyControlGRPOTrainer for two steps under the same process group and checks that the keep-mask
   chosen at generation equals ``rollout_masks`` on the concatenation of both ranks' old-policy statistics.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

from micro import make_micro_policy  # noqa: E402

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pad(x: torch.Tensor, width: int, value) -> torch.Tensor:
    out = torch.full((x.shape[0], width), value, dtype=x.dtype)
    out[:, : x.shape[1]] = x
    return out


def synthetic(seed: int = 11):
    """A 12-row batch: rank 0 owns rows 0-4 (width 6), rank 1 rows 5-11 (width 9)."""
    from entropy_rft.core.dynamics import TokenStats

    g = torch.Generator().manual_seed(seed)
    n, w = 12, 9
    mask = torch.rand(n, w, generator=g) < 0.8
    mask[:5, 6:] = False
    fields = {f: torch.randn(n, w, generator=g) for f in ("entropy", "logp", "s_star", "s_expected")}
    fields["s_star"][5:] *= 4.0  # the ranks' statistics differ, so per-rank thresholds differ from global
    fields["s_centered"] = fields["s_star"] - fields["s_expected"]
    adv = torch.randn(n, generator=g)
    old = fields["logp"] + 0.05 * torch.randn(n, w, generator=g)
    return TokenStats(**fields), adv, mask, old, [slice(0, 5), slice(5, 12)], [6, 9]


def check_synthetic(rank: int) -> None:
    from entropy_rft import control
    from entropy_rft.core.dynamics import TokenStats
    from entropy_rft.core.loss import policy_loss, ppo_clipped_mask
    from entropy_rft.integrations import window
    from entropy_rft.integrations.dist import all_reduce_sum

    st, adv, mask, old, rows, widths = synthetic()
    sl, w = rows[rank], widths[rank]
    local = TokenStats(**{f: getattr(st, f)[sl, :w] for f in ("entropy", "logp", "s_star", "s_expected",
                                                              "s_centered")})
    differs = []
    for name, params in (("clip_b_paper", {"mu_low": 0.8, "mu_high": 0.8}),
                         ("clip_v", {"mu": 0.3, "max_frac": 0.1, "advantage_sign": "any"}),
                         ("high_entropy", {"top_q": 0.3})):
        m = control.build_method(name, **params)
        gb = window.global_rollout_batch(m, local, adv[sl], mask[sl, :w])
        got = gb.local_keep(mask[sl, :w])
        want = m.rollout_masks(st, adv, mask).keep[sl, :w] & mask[sl, :w]
        assert torch.equal(got, want), (rank, name)
        per_rank = m.rollout_masks(local, adv[sl], mask[sl, :w]).keep & mask[sl, :w]
        differs.append(not torch.equal(per_rank, want))
    assert any(all_reduce_sum(torch.tensor(differs, dtype=torch.float64)) > 0), "per-rank masks never differ"

    # minibatch stage: two micro-batches per rank, concatenated in rank order = the single-process batch
    micro = [slice(sl.start, sl.start + 2), slice(sl.start + 2, sl.stop)]
    kw = {"eps_low": 0.2, "eps_high": 0.2}
    for name, params in (("clip_cov", {"ratio": 0.2, "lb": -5.0, "ub": 5.0}), ("kl_cov", {"ratio": 0.15})):
        m = control.build_method(name, **params)
        got = window.global_minibatch_masks(m, [st.logp[r, :w] for r in micro], [old[r, :w] for r in micro],
                                            [adv[r] for r in micro], [mask[r, :w] for r in micro], kw,
                                            torch.Generator().manual_seed(5))
        clipped = ppo_clipped_mask(st.logp, old, adv, mask, 0.2, 0.2)
        want = m.minibatch_masks(st.logp, old, adv, mask, clipped=clipped, generator=torch.Generator().manual_seed(5))
        field = "zeroed" if name == "clip_cov" else "kl_cov_select"
        for r, g_masks in zip(micro, got):
            assert torch.equal(getattr(g_masks, field), getattr(want, field)[r, :w]), (rank, name)

    # loss re-weighting: mean over ranks of sum_j c_j L_j == whole-batch loss
    keep = torch.rand(12, 9, generator=torch.Generator().manual_seed(3)) < 0.85
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        counted = [mask[r, :w] & keep[r, :w] for r in micro]
        scales = window.global_loss_scales(counted, agg, 9)
        mine = sum(c * policy_loss(st.logp[r, :w], old[r, :w], adv[r], mask[r, :w], keep=keep[r, :w], agg=agg)[0]
                   for c, r in zip(scales, micro))
        total = all_reduce_sum(mine.detach().double().reshape(1)) / WORLD
        whole, _ = policy_loss(st.logp, old, adv, mask, keep=keep, agg=agg)
        torch.testing.assert_close(float(total), float(whole), atol=1e-6, rtol=1e-5)


def check_trainer(rank: int, policy_dir: str, tmp: str) -> None:
    import torch.distributed as dist
    from datasets import Dataset
    from trl import GRPOConfig

    from entropy_rft import control
    from entropy_rft.core.dynamics import TokenStats
    from entropy_rft.integrations import trl as erft_trl
    from entropy_rft.integrations import window
    from entropy_rft.integrations.dist import all_gather_rows
    from entropy_rft.models.loading import load_policy

    record = []
    original = window.global_rollout_batch

    def recording(method, stats, adv, mask):
        gb = original(method, stats, adv, mask)
        record.append((stats, adv, mask, gb))
        return gb

    window.global_rollout_batch = recording
    model, tok = load_policy(policy_dir)
    args = GRPOConfig(output_dir=os.path.join(tmp, "trl"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=5, max_steps=2, report_to=[], save_strategy="no",
                      disable_tqdm=True, seed=0, logging_steps=1)
    ds = Dataset.from_dict({"prompt": ["123>7:", "456>7:", "789>7:", "321>7:"] * 4})
    params = {"mu_low": 0.5, "mu_high": 0.5}
    trainer = erft_trl.EntropyControlGRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [float(c[:1] == "1") for c in completions], args=args,
        train_dataset=ds, processing_class=tok, method="clip_v_paper", method_params=params)
    trainer.train()
    assert len(record) == 2
    method = control.build_method("clip_v_paper", **params)
    for stats, adv, mask, gb in record:
        parts = [None] * WORLD
        dist.all_gather_object(parts, (stats, adv, mask))
        width = max(p[2].shape[1] for p in parts)
        cat = TokenStats(**{f: torch.cat([_pad(getattr(p[0], f), width, 0.0) for p in parts])
                            for f in ("entropy", "logp", "s_star", "s_expected", "s_centered")})
        g_mask = torch.cat([_pad(p[2], width, False) for p in parts])
        g_adv = torch.cat([p[1] for p in parts])
        assert g_mask.shape[0] == WORLD * mask.shape[0]
        want = method.rollout_masks(cat, g_adv, g_mask).keep & g_mask
        keep = all_gather_rows(gb.local_keep(mask), False)[0]  # every rank's own rows, in rank order
        assert torch.equal(keep, want)
        assert int(want.sum()) < int(g_mask.sum())  # the method dropped tokens


def worker(rank: int, port: int, policy_dir: str, tmp: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "HF_HUB_OFFLINE": "1"})
    torch.set_num_threads(1)
    from accelerate import PartialState

    state = PartialState(cpu=True)
    assert state.num_processes == WORLD and torch.distributed.get_backend() == "gloo"
    check_synthetic(rank)
    check_trainer(rank, policy_dir, tmp)
    state.wait_for_everyone()


def test_two_process_global_selections(tmp_path):
    policy = make_micro_policy(tmp_path / "policy")
    mp.spawn(worker, args=(_free_port(), str(policy), str(tmp_path)), nprocs=WORLD, join=True)


def test_torchrun_two_cpu_processes(tmp_path):
    """`torchrun --nproc_per_node 2` (2 CPU processes, gloo) drives `erft train --engine trl` end to end, and the
    run records that it ran on two processes (accelerate 1.15 runs a MULTI_CPU config in one process unless
    mpirun starts it: examples/accelerate/cpu_2proc.yaml says so)."""
    import json
    import os
    import subprocess
    import sys

    from micro import make_micro_policy

    policy = make_micro_policy(tmp_path / "policy")
    out = tmp_path / "run"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sets = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "eval.every=0",
            "train.threads=1", "train.tensorboard=false", "method.params={mu: 0.5}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "entropy_rft.cli", "train",
           "--engine", "trl", "--method", "clip_v", "--model", str(policy), "--task", "micro:DigitTask",
           "--max-steps", "2", "--out", str(out), *sum((["--set", s] for s in sets), [])]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "of type <class 'NoneType'>" not in res.stderr  # undefined metrics never reach TRL's loggers
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one row per step, written by the main process only
    assert all(0 < r["entropy/mean"] < 4 for r in rows)
    status = json.loads((out / "run.json").read_text())
    assert status["status"] == "finished" and status["processes"] == 2
