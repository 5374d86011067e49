"""Same seed, same numbers at 2 threads: the packed forward's gradients, two runs, and a run killed with
SIGKILL then resumed.

The tiny policy of ``micro.py`` is too small for the ops whose CPU kernels depend on thread scheduling to
run in parallel (PyTorch parallelises an op from 32768 elements on). The policy and batches here are large
enough: the packed forward (``fast_llama.response_hidden``) gathers a prompt's K/V once per row of its
GRPO group, and the gather's backward sums the group's gradients. With advanced indexing (``kp[inv]``)
that sum was ``index_put_(accumulate=True)``, which on CPU adds with atomics from two threads in whatever
order they arrive; these tests failed with it (gradients differ between repeats; two runs differ from
step 1 on). ``fast_llama._repeat_rows`` sums in a fixed order. A race shows only when both threads really
run at once, so on a heavily loaded machine the old code could pass by luck; never the other way round.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from entropy_rft.models.loading import build_char_tokenizer, llama_config, load_policy, save_policy
from entropy_rft.policy.forward import policy_forward
from entropy_rft.policy.rollout import RolloutBatch
from entropy_rft.rundir.files import read_jsonl
from micro import again, micro_overrides

TESTS = Path(__file__).parent
VOLATILE = ("time/", "perf/")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = LlamaForCausalLM(llama_config(tok, d_model=192, layers=1, heads=4, mlp=256))
    folder = tmp_path_factory.mktemp("wide") / "policy"
    save_policy(folder, model, tok)
    return folder


def overrides(model: Path, **extra) -> list[str]:
    # 12 prompts x 8 samples, two minibatches of 48 rows in random order: groups split across both halves
    # of a parallel kernel's range; 48 rows x 8 prompt positions x 192 features of K (and V) per gather.
    sets = {"task.name": "micro:OverlapTask", "train.threads": 2, "rollout.prompts_per_step": 12,
            "rollout.group_size": 8, "algo.minibatches": 2, "eval.every": 2, "eval.prompts": 8,
            "train.max_steps": 4, "train.checkpoint_every": 2, "train.tensorboard": False, **extra}
    return micro_overrides(model, **sets)


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    for x, y in zip(a, b):
        keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        if keys:
            return f"step {x.get('step')}: {keys[:6]}"
    return None if len(a) == len(b) else f"{len(a)} rows vs {len(b)}"


def test_packed_forward_gradients_repeat_exactly_at_two_threads(wide_model):
    """The op-level check: one batch's gradients, ten times over, bit for bit (a 48-token prompt per group
    of 8 rows, the groups interleaved as in a shuffled minibatch: 96 x 48 x 192 elements of K per gather)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, tok = load_policy(str(wide_model))
        model.train()
        vocab = len(tok)
        gen = torch.Generator().manual_seed(0)
        n_prompts, group, p, r = 12, 8, 48, 6
        prompts = torch.randint(3, vocab, (n_prompts, p), generator=gen)
        rows = torch.randperm(n_prompts * group, generator=gen) % n_prompts  # groups interleaved, as a minibatch
        lengths = torch.randint(1, r + 1, (len(rows),), generator=gen)
        batch = RolloutBatch(prompts[rows], torch.ones(len(rows), p, dtype=torch.bool),
                             torch.randint(3, vocab, (len(rows), r), generator=gen),
                             torch.arange(r) < lengths[:, None], [""] * len(rows))
        weights = torch.randn(len(rows), r, generator=gen)
        grads = []
        for _ in range(10):
            model.zero_grad(set_to_none=True)
            out = policy_forward(model, batch, 1.0, with_entropy=True)
            ((out.logp + out.entropy) * weights).sum().backward()
            grads.append([prm.grad.clone() for prm in model.parameters()])
        differ = [i for i, g in enumerate(grads[1:], 1) if any(not torch.equal(a, b) for a, b in zip(grads[0], g))]
        assert not differ, f"gradients of repeats {differ} differ from the first"
    finally:
        torch.set_num_threads(threads)


def test_same_seed_same_metrics_at_two_threads(wide_model, tmp_path):
    cfg = load_config(None, overrides(wide_model))
    start(cfg, tmp_path / "a")
    start(cfg, tmp_path / "b")
    a = stable(read_jsonl(tmp_path / "a" / "metrics.jsonl"))
    b = stable(read_jsonl(tmp_path / "b" / "metrics.jsonl"))
    assert [r["step"] for r in a] == list(range(5))
    assert all(r["optim/grad_norm"] > 0 for r in a[1:])  # the updates are live
    diff = first_difference(a, b)
    assert diff is None, diff


def test_sigkill_then_resume_at_two_threads_is_exact(wide_model, tmp_path):
    sets = overrides(wide_model)
    ref = tmp_path / "ref"
    start(load_config(None, sets), ref)
    expected = stable(read_jsonl(ref / "metrics.jsonl"))

    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "entropy_rft.cli", "train", "--out", str(out), *sum((["--set", s] for s in sets), [])]
    rng = random.Random(13)
    target, delay = rng.randint(1, 2), rng.random() * 0.2  # kill within the step after `target` is logged
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        rows = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
        if rows and rows[-1].get("step", 0) >= target:
            time.sleep(delay)
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before the kill: {proc.stderr.read().decode()}"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    proc.stderr.close()
    resumed = subprocess.run([sys.executable, "-m", "entropy_rft.cli", "train", "--resume", str(out), *again(out)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    got = stable(read_jsonl(out / "metrics.jsonl"))
    diff = first_difference(got, expected)
    assert diff is None, diff
