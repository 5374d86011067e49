"""bf16 weights against float32 master weights (issue 27, item 2): the resolution rule against torch's own
rounding, the warning, and the autocast option's mechanics (weights stay float32, forwards run in bf16)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from entropy_rft.config.loading import load_config
from entropy_rft.models.precision import lr_warning, smallest_kept_update
from entropy_rft.training import stages
from entropy_rft.training.state import build_run
from micro import make_micro_policy, micro_overrides


def test_smallest_kept_update_is_half_the_spacing():
    assert smallest_kept_update(torch.bfloat16, 1.0) == 2.0 ** -8  # 8 significant bits
    assert smallest_kept_update(torch.float16, 1.0) == 2.0 ** -11
    assert smallest_kept_update(torch.bfloat16, 0.03) == 2.0 ** -14  # 0.03 in [2^-6, 2^-5)
    for w in (0.03, 0.7, 3e-3, 12.0):  # against torch's own rounding
        x = torch.tensor(w, dtype=torch.bfloat16)
        floor = smallest_kept_update(torch.bfloat16, float(x))
        assert x + torch.tensor(0.9 * floor, dtype=torch.bfloat16) == x
        assert x + torch.tensor(1.1 * floor, dtype=torch.bfloat16) != x


def _adam_step(lin: torch.nn.Linear, lr: float, autocast: bool) -> float:
    """The fraction of weights one AdamW step moves."""
    before = lin.weight.detach().clone()
    opt = torch.optim.AdamW(lin.parameters(), lr=lr, weight_decay=0.0)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(lin.weight.dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = lin(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    return float((lin.weight.detach() != before).float().mean())


def _linear(dtype) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.03)
    return lin.to(dtype)


def test_bf16_weights_lose_small_updates_and_master_weights_keep_them():
    """lr 2e-5 on |w| ~ 0.03: pure bf16 keeps few of AdamW's updates; float32 weights under bf16 autocast keep
    all of them. The warning says so for the first and not for the second."""
    assert _adam_step(_linear(torch.bfloat16), 2e-5, autocast=False) < 0.5
    master = _linear(torch.float32)
    assert _adam_step(master, 2e-5, autocast=True) > 0.99 and master.weight.dtype == torch.float32
    line = lr_warning(_linear(torch.bfloat16), 2e-5)
    assert line is not None and "model.dtype=bfloat16" in line and "model.autocast_bf16=true" in line
    assert lr_warning(_linear(torch.bfloat16), 1e-3) is None
    assert lr_warning(_linear(torch.float32), 2e-5) is None


class _MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matrix product dispatched inside the block."""

    MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear")

    def __init__(self):
        super().__init__()
        self.dtypes: set = set()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.MATMULS:
            self.dtypes.add(args[0].dtype)
            self.calls.append((func.__name__, args[0].dtype, tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


def test_master_weights_stay_float32_and_forwards_run_bf16(micro, tmp_path, capsys):
    cfg = load_config(None, micro_overrides(micro, **{"model.autocast_bf16": True, "optim.lr": 2e-5}))
    run = build_run(cfg, tmp_path / "run")
    before = [p.detach().clone() for p in run.model.parameters()]
    rb = stages.rollout(run, [e.prompt for e in stages.sample_prompts(run)])
    with _MatmulDtypes() as seen, stages.autocast(run):
        loss = -stages.forward(run, rb).logp.sum()
    # Every matmul of the decoder runs in bf16; only the LM head's log-prob chunks (fused.fused_logp, the
    # statistics) stay float32.
    vocab = run.model.config.vocab_size
    assert sum(c[1] == torch.bfloat16 for c in seen.calls) >= 8
    assert all(c[1] == torch.bfloat16 or c[3][-1] == vocab for c in seen.calls), seen.calls
    loss.backward()
    run.optim.step()
    params = list(run.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before) if p.grad is not None and p.grad.any())
    assert "warning" not in capsys.readouterr().err


def test_bf16_weights_warn_once_at_a_small_lr(micro, tmp_path, capsys):
    sets = {"model.dtype": "bfloat16", "optim.lr": 1e-6}
    build_run(load_config(None, micro_overrides(micro, **sets)), tmp_path / "a")
    build_run(load_config(None, micro_overrides(micro, **sets)), tmp_path / "b")
    err = capsys.readouterr().err
    assert err.count("model.dtype=bfloat16 keeps the weights") == 1, err
