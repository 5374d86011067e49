"""The Triton kernels (issue 23) under Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1), against
float64 references: the statistics kernel behind token_stats(backend="triton") and the fused LM head behind
fused_logp(backend="triton"). Shapes are small: the interpreter runs each program in numpy."""

from __future__ import annotations

import os

import pytest
import torch

from entropy_rft.core import dynamics
from entropy_rft.core.dynamics import NonFiniteLogits, token_stats
from entropy_rft.core.fused import fused_logp
from entropy_rft.core.kernels.head import FusedHead
from entropy_rft.core.kernels.stats import row_stats

V = 333  # not a multiple of any block: the last block is partly masked


def ref_stats(z: torch.Tensor, ids: torch.Tensor, temperature) -> dict[str, torch.Tensor]:
    """The five statistics in float64, straight from their definitions (Lemma 3.1, Thm 3.3)."""
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else float(temperature)
    y = z.double() / t
    lp = torch.log_softmax(y, -1)
    p = lp.exp()
    h = -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)
    s = torch.where(p > 0, p * (h.unsqueeze(-1) + lp), torch.zeros_like(p))
    k = ids.long().unsqueeze(-1)
    return {"entropy": h, "logp": lp.gather(-1, k).squeeze(-1), "s_star": s.gather(-1, k).squeeze(-1),
            "s_expected": (p * s).sum(-1)}


def rows(kind: str, n: int = 6, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g) * 3
    if kind == "peaked":  # logits of +-1e4: p is one-hot to float precision
        z = torch.sign(z) * 1e4
        z[:, 7] = 2e4
    elif kind == "masked":  # -inf entries (masked tokens), one row with a single finite entry
        z[z < -2] = float("-inf")
        z[0] = float("-inf")
        z[0, 5] = 1.0
    return z


def assert_close_to_reference(got, ref: dict[str, torch.Tensor]) -> None:
    for f in ("entropy", "logp", "s_star", "s_expected"):
        g = getattr(got, f).double()
        r = ref[f]
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), fin), f
        err = (g[fin] - r[fin]).abs()
        bound = 1e-5 * (1 + r[fin].abs()) if f in ("entropy", "logp") else 1e-6 + 1e-4 * r[fin].abs()
        assert (err <= bound).all(), (f, float(err.max()))


@pytest.mark.parametrize("kind", ["random", "peaked", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "per_row"])
def test_token_stats_triton_matches_float64(kind, dtype, temperature):
    z = rows(kind).to(dtype)
    ids = torch.randint(0, V, (z.shape[0],), generator=torch.Generator().manual_seed(1))
    if kind == "masked":
        ids[0] = 5  # the one finite entry
        ids = torch.where(torch.isfinite(z.float().gather(-1, ids[:, None]))[:, 0], ids, torch.full_like(ids, 7))
        z[:, 7] = 0.5
    t = torch.linspace(0.5, 1.5, z.shape[0]) if temperature == "per_row" else temperature
    ref = ref_stats(z.float(), ids, t)  # the float64 result on the dtype-rounded logits
    for splits in (1, 3):  # one program per row, and the vocabulary split over programs then merged
        got = row_stats(z, ids, t, block=64, splits=splits)
        assert got.flags.tolist() == [0, 0, 0, 0]
        assert_close_to_reference(got, ref)
    st = token_stats(z, ids, t, backend="triton")
    assert_close_to_reference(st, ref)
    assert torch.equal(st.s_centered, st.s_star - st.s_expected)


def test_triton_results_are_bitwise_reproducible_and_take_strided_views():
    z = rows("random", n=4 * 5).view(4, 5, V)
    ids = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(2))
    for splits in (1, 4):
        a = row_stats(z, ids, 0.7, block=64, splits=splits)
        b = row_stats(z, ids, 0.7, block=64, splits=splits)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # a [B, L, V] view with a row gap (positions 1..3 of each sequence) is read in place, not copied
    view, vids = z[:, 1:4], ids[:, 1:4]
    assert not view.is_contiguous()
    got = row_stats(view, vids, 0.7, block=64, splits=1)
    want = row_stats(view.contiguous(), vids.contiguous(), 0.7, block=64, splits=1)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_triton_bad_inputs_raise_as_the_torch_path_does():
    z = rows("random")
    ids = torch.arange(z.shape[0])
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 332\] \(V=333\), got values in \[0, 333\]"):
        token_stats(z, torch.tensor([0, 1, 2, 3, 4, 333]), backend="triton")
    bad = z.clone()
    bad[1, 4] = float("nan")
    bad[3] = float("-inf")
    bad[5, 0] = float("inf")
    with pytest.raises(NonFiniteLogits, match="3 row"):
        token_stats(bad, ids, backend="triton")
    with pytest.raises(NonFiniteLogits, match="3 row"):
        token_stats(bad, ids, backend="torch")
    t = torch.ones(z.shape[0])
    t[2] = 0.0
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="temperature must be finite and > 0 on every row; 1 row"):
            token_stats(z, ids, t, backend=backend)
    with pytest.raises(ValueError, match="per-row temperature must be a float tensor of shape"):
        token_stats(z, ids, torch.ones(3), backend="triton")
    with pytest.raises(ValueError, match="backend must be one of auto, torch, triton, got 'cuda'"):
        token_stats(z, ids, backend="cuda")


def test_backend_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert dynamics.resolve_backend("auto", cpu) == "torch"  # CPU keeps today's path
    assert dynamics.resolve_backend("triton", cpu) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        dynamics.resolve_backend("triton", cpu)


def test_per_row_temperature_equals_dividing_first():
    """verl's per-token temperature: token_stats(z, ids, T) is token_stats(z / T) (float32, bit for bit)."""
    z = rows("random", n=8)
    ids = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3))
    t = torch.linspace(0.6, 1.3, 8)
    want = token_stats(z / t.unsqueeze(-1), ids, backend="torch")
    for backend in ("torch", "triton"):
        got = token_stats(z, ids, t, backend=backend)
        if backend == "torch":
            assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("entropy", "logp", "s_star"))
        assert_close_to_reference(got, ref_stats(z, ids, t))


def _head_reference(h, w, b, ids, t, g_logp, g_ent):
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    lp = torch.log_softmax((h64 @ w64.T + b64) / t, -1)
    ent = -(lp.exp() * lp).sum(-1)
    logp = lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    grads = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h64, w64, b64))
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [(None, 100), (4, 100), (4, None)])  # (tokens per chunk, vocab per block)
def test_fused_head_triton_matches_float64(dtype, tiles):
    """One token chunk (each block's grad_W one GEMM) or several (float32 accumulation), one vocabulary block
    or several (moments merged across blocks, grad_h accumulated); last block partly filled (333 = 3 x 100 + 33)."""
    g = torch.Generator().manual_seed(4)
    n, d = 10, 16
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, d, generator=g) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, V, (n,), generator=g)
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    out = fused_logp(h, w, ids, 0.7, bias=b, with_entropy=True, backend="triton", chunk_size=tiles[0],
                     vocab_chunk=tiles[1])
    grads = torch.autograd.grad((out.logp * g_logp).sum() + (out.entropy * g_ent).sum(), (h, w, b))
    logp64, ent64, grads64 = _head_reference(h, w, b, ids, 0.7, g_logp.double(), g_ent.double())
    # the forward: float32 statistics of the input-dtype logits, as the torch path
    want = fused_logp(h.detach(), w.detach(), ids, 0.7, bias=b.detach(), backend="torch").stats
    assert_close_to_reference(out.stats, {f: getattr(want, f).double() for f in ("entropy", "logp", "s_star",
                                                                                 "s_expected")})
    if dtype == torch.float32:
        assert (out.logp.double() - logp64).abs().max() < 1e-5
        assert (out.entropy.double() - ent64).abs().max() < 1e-5
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: gradients are bf16 GEMMs, as in TRL and Liger
    for got, ref in zip(grads, grads64):
        assert got.dtype == dtype
        assert float((got.double() - ref).norm() / ref.norm()) < tol


def test_fused_head_per_row_temperature_and_logp_only_gradient():
    g = torch.Generator().manual_seed(5)
    n, d = 6, 8
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(V, d, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (n,), generator=g)
    t = torch.linspace(0.5, 1.5, n)
    logp, ent, s_star, s_exp, flags = FusedHead.apply(h, w, None, ids, t, 4, 100)
    assert flags.tolist() == [0, 0, 0, 0]
    z = (h @ w.T).detach()
    assert_close_to_reference(dynamics.TokenStats(ent, logp, s_star, s_exp, s_star - s_exp), ref_stats(z, ids, t))
    gh, gw = torch.autograd.grad(logp.sum(), (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.log_softmax((h64 @ w64.T) / t.double().unsqueeze(-1), -1).gather(-1, ids[:, None]).sum()
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    assert float((gh.double() - rh).abs().max()) < 1e-5 and float((gw.double() - rw).abs().max()) < 1e-5


def test_fused_head_triton_bad_ids_raise():
    h = torch.randn(3, 4)
    w = torch.randn(V, 4)
    with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 332\]"):
        fused_logp(h, w, torch.tensor([0, 1, V]), backend="triton")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fused_logp(h.double(), w.double(), torch.tensor([0, 1, 2]), backend="triton")


def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
