"""The graph-ready decode loop (issue 27) in eager mode on CPU: the tokens and RNG use of the HF-forward loop
(`sample_kv`, transformers' own decoder and `torch.multinomial`), whatever the check interval and batch buckets."""

from __future__ import annotations

import pytest
import torch

from entropy_rft.models.loading import load_policy
from entropy_rft.policy.fast_llama import StaticDecoder
from entropy_rft.policy.graph_decode import bucket_sizes, decode, draw_token
from entropy_rft.policy.rollout import sample_kv, sample_static, tokenize_prompts
from micro import make_micro_policy


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_draw_is_torch_multinomial_without_host_reads(temperature, top_p):
    """Same generator state, same tokens as torch.multinomial over the same probabilities, and the generator
    ends in the same state; extreme logits stay valid."""
    logits = torch.randn(50, 97, generator=torch.Generator().manual_seed(1)) * 4
    logits[0, 3] = 80.0  # a near-certain token
    logits[1] = -1e4  # all tiny: softmax is still a distribution
    ga, gb = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1:
        from entropy_rft.policy.graph_decode import top_p_filter
        probs = top_p_filter(probs, top_p)
    want = torch.multinomial(probs, 1, generator=ga).squeeze(-1)
    got = draw_token(logits, temperature, top_p, gb)
    assert torch.equal(got, want) and want[0] == 3
    assert torch.equal(ga.get_state(), gb.get_state())
    assert torch.equal(draw_token(logits, 0.0, 1.0, None), logits.argmax(-1))


def test_bucket_sizes():
    assert bucket_sizes(64) == [64, 32, 16, 8]
    assert bucket_sizes(48) == [48, 32, 16, 8]
    assert bucket_sizes(9) == [9, 8]
    assert bucket_sizes(8) == [8] and bucket_sizes(5) == [5] and bucket_sizes(1) == [1]


def _setup(tmp_path, n=20):
    model, tok = load_policy(str(make_micro_policy(tmp_path / "p")))
    ids, mask = tokenize_prompts(tok, ["12>3:", "4>5:", "987>65:"] * n)
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=1.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    return model, ids, mask, kw


def test_eager_loop_draws_what_the_hf_forward_loop_draws(tmp_path):
    """The static sampler (graph-ready loop, eager) against the HF-forward loop: every token, the mask, the
    output width, and the generator's state afterwards (so a run's later steps are unchanged too)."""
    model, ids, mask, kw = _setup(tmp_path)
    ga, gb = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = sample_kv(model, ids, mask, generator=ga, **kw)
    b = sample_static(model, ids, mask, generator=gb, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(ga.get_state(), gb.get_state())
    lengths = a[1].sum(-1)
    assert lengths.min() < lengths.max() and a[1].shape[1] < kw["max_new_tokens"] + 1


def test_gpu_loop_shape_on_cpu_draws_the_same_tokens_and_drops_rows_at_buckets(tmp_path, monkeypatch):
    """cuda_graphs=True on CPU runs the GPU loop eagerly: done read every 3 steps, rows dropped only at
    power-of-two sizes. Same tokens and mask; the generator may have drawn a few steps more."""
    model, ids, mask, kw = _setup(tmp_path)
    kw["max_new_tokens"] = 40
    held: list[int] = []
    keep = StaticDecoder.keep
    monkeypatch.setattr(StaticDecoder, "keep", lambda self, slots: (held.append(len(slots)), keep(self, slots)))
    ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = sample_kv(model, ids, mask, generator=ga, **kw)
    b = sample_static(model, ids, mask, generator=gb, cuda_graphs=True, check_every=3, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert held and set(held) <= {32, 16, 8}, held  # 60 rows: buckets 60, 32, 16, 8
    assert held == sorted(held, reverse=True)


def test_graph_capture_needs_cuda_and_a_valid_interval(tmp_path):
    model, ids, mask, kw = _setup(tmp_path, n=1)
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA device"):
        decode(StaticDecoder(model, ids, mask, 4), generator=None, cuda_graph=True, **{**kw, "max_new_tokens": 4})
    with pytest.raises(ValueError, match="check_every: must be >= 1"):
        decode(StaticDecoder(model, ids, mask, 4), generator=None, check_every=0, **{**kw, "max_new_tokens": 4})
