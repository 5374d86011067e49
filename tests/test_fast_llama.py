"""The static-cache Llama decoder against transformers' own full forward (an independent implementation)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from entropy_rft.models.loading import load_policy
from entropy_rft.policy.fast_llama import StaticDecoder, unsupported_reason
from entropy_rft.policy.rollout import position_ids, sample, sample_kv, sample_static, tokenize_prompts
from micro import make_micro_policy

V = 40


def _llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kw.pop("kv", 4), max_position_embeddings=64, **kw)
    return LlamaForCausalLM(cfg).eval()


def _smollm2_like() -> LlamaForCausalLM:
    """SmolLM2-135M's shape in miniature: tied input/output embeddings, GQA with 9 query and 3 K/V heads,
    RoPE theta 100000, a padding id."""
    torch.manual_seed(2)
    cfg = LlamaConfig(vocab_size=V, hidden_size=36, intermediate_size=48, num_hidden_layers=2, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=64, rope_theta=100000.0,
                      tie_word_embeddings=True, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # Qwen2 has q/k/v biases; make them non-zero so they matter
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.bias.normal_(0, 0.5)
    return model


def _batch():
    """Three prompts of different lengths, left-padded (pad id 0), and 5 continuation tokens each."""
    g = torch.Generator().manual_seed(3)
    lens = [5, 2, 4]
    ids = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    for i, n in enumerate(lens):
        ids[i, 5 - n:] = torch.randint(1, V, (n,), generator=g)
        mask[i, 5 - n:] = True
    cont = torch.randint(1, V, (3, 5), generator=g)
    return ids, mask, cont


@pytest.mark.parametrize("make", [_llama, lambda: _llama(kv=2), lambda: _llama(rope_theta=500.0), _qwen2,
                                  _smollm2_like],
                         ids=["llama", "llama-gqa", "llama-theta", "qwen2-bias-gqa", "smollm2-like"])
def test_decoder_logits_equal_full_forward(make):
    model = make()
    assert unsupported_reason(model) is None
    ids, mask, cont = _batch()
    full_ids = torch.cat([ids, cont], 1)
    full_mask = torch.cat([mask, torch.ones_like(cont, dtype=torch.bool)], 1)
    with torch.no_grad():
        ref = model(input_ids=full_ids, attention_mask=full_mask.long(), position_ids=position_ids(full_mask)).logits
    dec = StaticDecoder(model, ids, mask, max_new_tokens=cont.shape[1])
    got = [dec.prefill()] + [dec.step(cont[:, t]) for t in range(cont.shape[1] - 1)]
    for t, logits in enumerate(got):
        torch.testing.assert_close(logits, ref[:, ids.shape[1] - 1 + t], atol=2e-5, rtol=1e-5)


def test_decoder_under_bf16_autocast_stays_close_and_finite():
    model = _llama(kv=2)
    ids, mask, cont = _batch()
    dec32 = StaticDecoder(model, ids, mask, max_new_tokens=3)
    want = [dec32.prefill(), dec32.step(cont[:, 0])]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dec = StaticDecoder(model, ids, mask, max_new_tokens=3)
        got = [dec.prefill(), dec.step(cont[:, 0])]
    assert dec.cache[0][0].dtype == torch.bfloat16
    for g, w in zip(got, want):
        assert torch.isfinite(g.float()).all()
        torch.testing.assert_close(g.float(), w, atol=0.1, rtol=0.05)


def test_static_and_kv_samplers_draw_the_same_tokens(tmp_path):
    """Same generator seed, same policy: the two KV backends consume the RNG identically and agree token for
    token (the logits differ only by float rounding)."""
    model, tok = load_policy(str(make_micro_policy(tmp_path / "p")))
    ids, mask = tokenize_prompts(tok, ["12>3:", "4>5:", "987>65:"] * 20)
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    a = sample_kv(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    b = sample_static(model, ids, mask, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[1].sum() > 60  # responses actually vary in length and content
    assert len({tuple(r.tolist()) for r in a[0]}) > 20


def test_unsupported_models_fall_back_or_raise(tmp_path):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=32)).eval()
    assert "gpt2" in unsupported_reason(gpt2)
    ids, mask, _ = _batch()
    with pytest.raises(ValueError, match="fast decode: model_type 'gpt2'.*'kv' sampler backend"):
        StaticDecoder(gpt2, ids, mask, 4)
    llama = _llama()
    llama.model.layers[0].mlp.up_proj = torch.nn.Sequential(llama.model.layers[0].mlp.up_proj)  # an "adapter"
    assert "nn.Linear" in unsupported_reason(llama)
    windowed = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                            num_attention_heads=2))
    windowed.config.sliding_window = 8
    assert "sliding window" in unsupported_reason(windowed, total_len=9)
    assert unsupported_reason(windowed, total_len=8) is None


def test_auto_backend_uses_kv_for_unsupported_models(tmp_path):
    """'auto' silently samples with the HF loop when the fast path cannot run; 'static' says why it cannot."""
    model, tok = load_policy(str(make_micro_policy(tmp_path / "p")))
    model.model.layers[0].mlp.up_proj = torch.nn.Sequential(model.model.layers[0].mlp.up_proj)
    rb = sample(model, tok, ["12>3:"] * 4, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    assert rb.response_ids.shape[0] == 4
    with pytest.raises(ValueError, match="not a plain nn.Linear"):
        sample(model, tok, ["12>3:"], max_new_tokens=4, backend="static")


def test_cache_overflow_is_an_error():
    model = _llama()
    ids, mask, cont = _batch()
    dec = StaticDecoder(model, ids, mask, max_new_tokens=2)
    dec.prefill()
    dec.step(cont[:, 0])
    dec.step(cont[:, 1])  # positions 5 and 6 of 7
    with pytest.raises(ValueError, match="cache holds 7 positions"):
        dec.step(cont[:, 2])


@pytest.mark.parametrize("make", [lambda: _llama(kv=2, pad_token_id=0), _qwen2], ids=["llama-gqa-padidx", "qwen2"])
def test_training_forward_values_and_gradients_equal_hf(make):
    """decoder_hidden (the policy forward's fast path) against the HF decoder: hidden states and every
    parameter's gradient of a masked loss, including nn.Embedding's padding_idx row (no gradient from lookups)."""
    from entropy_rft.policy.fast_llama import decoder_hidden

    model = make().train()
    ids, mask, cont = _batch()
    full_ids = torch.cat([ids, cont], 1)
    full_mask = torch.cat([mask, torch.ones_like(cont, dtype=torch.bool)], 1)
    full_mask[1, -2:] = False  # a response that ended early: right padding too
    full_ids[1, -2:] = 0
    full_ids[0, 6] = 0  # the pad id sampled as a real token: nn.Embedding still gives its row no lookup gradient
    weights = torch.randn(full_ids.shape + (32,), generator=torch.Generator().manual_seed(9))
    grads, hiddens = [], []
    for fast in (True, False):
        model.zero_grad()
        if fast:
            h = decoder_hidden(model, full_ids, full_mask.long())
        else:
            h = model.model(input_ids=full_ids, attention_mask=full_mask.long(),
                            position_ids=position_ids(full_mask)).last_hidden_state
        ((h * weights).sum(-1) * full_mask).sum().backward()
        hiddens.append(h.detach()[full_mask])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(hiddens[0], hiddens[1], atol=2e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10  # all but the (untied) LM head
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=5e-5, rtol=1e-4, msg=n)
    if model.model.embed_tokens.padding_idx is not None:
        assert grads[0]["model.embed_tokens.weight"][0].abs().sum() == 0


def test_policy_forward_uses_hf_modules_under_gradient_checkpointing_and_dropout():
    """The raw-weights path would silently skip activation checkpointing and attention dropout, so
    fast_path_ok refuses it there; the HF path then runs and gives the same values."""
    from entropy_rft.policy.forward import fast_path_ok

    model = _llama(kv=2).train()
    assert fast_path_ok(model)
    model.gradient_checkpointing_enable()
    assert not fast_path_ok(model)
    model.gradient_checkpointing_disable()
    model.config.attention_dropout = 0.1
    assert not fast_path_ok(model) and fast_path_ok(model.eval())
    assert not fast_path_ok(GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2)))


def test_policy_forward_decides_its_path_once_per_model(monkeypatch):
    """The fused-head check and the module walk (supports_fused, unsupported_reason) run at a model's first
    forward only, the same numbers come out every call, the mode (gradient checkpointing) is still read on each
    call, every model gets its own plan, and the plan does not keep its model alive."""
    import gc
    import weakref

    from entropy_rft.policy import forward

    calls = []
    real_reason, real_fused = forward.unsupported_reason, forward.supports_fused
    monkeypatch.setattr(forward, "unsupported_reason", lambda m, *a: calls.append("walk") or real_reason(m, *a))
    monkeypatch.setattr(forward, "supports_fused", lambda m: calls.append("head") or real_fused(m))
    model, rb = _llama(kv=2).eval(), _grouped_rollout()
    with torch.no_grad():
        outs = [forward.policy_forward(model, rb, 0.7) for _ in range(3)]
        assert calls == ["head", "walk"]
        for out in outs[1:]:
            assert torch.equal(out.logp, outs[0].logp) and torch.equal(out.stats.s_star, outs[0].stats.s_star)
        assert forward.fast_path_ok(model)
        model.gradient_checkpointing_enable()
        assert not forward.fast_path_ok(model)
        model.gradient_checkpointing_disable()
        other = _llama(kv=1)
        forward.policy_forward(other, rb, 0.7)
    assert calls == ["head", "walk"] * 2
    assert forward.forward_plan(model) == forward.ForwardPlan(fused=True, fast_reason=None)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2))
    assert forward.forward_plan(gpt2).fast_reason == real_reason(gpt2)
    ref = weakref.ref(other)
    del other
    gc.collect()
    assert ref() is None


def _grouped_rollout():
    """Six rows over three distinct prompts of different lengths, interleaved (A B A C B A), with responses of
    lengths 5, 1, 3, 5, 2, 4 (right-padded with the pad id 0; one response samples the pad id as a real token)."""
    from entropy_rft.policy.rollout import RolloutBatch

    g = torch.Generator().manual_seed(4)
    prompts = {"A": [7, 3, 9, 1], "B": [5, 2], "C": [8, 8, 6, 4, 11]}
    order, lens = "ABACBA", [5, 1, 3, 5, 2, 4]
    p, r = 5, 5
    p_ids = torch.zeros(6, p, dtype=torch.long)
    p_mask = torch.zeros(6, p, dtype=torch.bool)
    for i, name in enumerate(order):
        toks = prompts[name]
        p_ids[i, p - len(toks):] = torch.tensor(toks)
        p_mask[i, p - len(toks):] = True
    r_ids = torch.randint(1, V, (6, r), generator=g)
    r_mask = torch.arange(r)[None] < torch.tensor(lens)[:, None]
    r_ids[~r_mask] = 0
    r_ids[3, 2] = 0  # the pad id as a real token: its embedding row gets no lookup gradient, as in nn.Embedding
    return RolloutBatch(p_ids, p_mask, r_ids, r_mask, [""] * 6)


@pytest.mark.parametrize("small_attention", [True, False], ids=["matmul-attention", "sdpa"])
@pytest.mark.parametrize("make", [lambda: _llama(kv=2, pad_token_id=0), _qwen2, _smollm2_like],
                         ids=["llama-gqa-padidx", "qwen2", "smollm2-like-tied-gqa3"])
def test_packed_policy_forward_equals_the_hf_decoder(make, small_attention, monkeypatch):
    """The packed training forward (each distinct prompt once, no padding computed) against transformers' own
    decoder on the full padded rows: log p, entropy, every TokenStats field, and every parameter's gradient;
    with short-sequence attention as plain matmuls (the CPU default) and through SDPA (long sequences, GPUs)."""
    from entropy_rft.policy import fast_llama
    from entropy_rft.policy.forward import policy_forward

    if not small_attention:
        monkeypatch.setattr(fast_llama, "SMALL_ATTENTION", 0)
    model = make().train()
    rb = _grouped_rollout()
    m = rb.response_mask
    wts = torch.randn(2, *m.shape, generator=torch.Generator().manual_seed(2))
    outs, grads = [], []
    for fast in (True, False):
        model.zero_grad()
        out = policy_forward(model, rb, 0.7, with_entropy=True, fast=fast)
        ((out.logp * wts[0] + out.entropy * wts[1]) * m).sum().backward()
        outs.append(out)
        grads.append({n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None})
    fast, ref = outs
    for name in ("logp", "entropy"):
        torch.testing.assert_close(getattr(fast, name)[m], getattr(ref, name)[m], atol=2e-5, rtol=1e-5)
    for f in ("entropy", "logp", "s_star", "s_expected", "s_centered"):
        torch.testing.assert_close(getattr(fast.stats, f)[m], getattr(ref.stats, f)[m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(fast.hidden[m], ref.hidden[m].float(), atol=2e-5, rtol=1e-5)
    assert (fast.logp[~m] == 0).all() and (fast.stats.entropy[~m] == 0).all()  # nothing computed there
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=5e-5, rtol=1e-4, msg=n)


def test_packed_forward_shares_each_prompt_and_skips_padding():
    """response_hidden returns exactly the valid tokens, row-major; the fallback covers non-prefix masks."""
    from entropy_rft.policy.fast_llama import is_prefix_mask, response_hidden

    rb = _grouped_rollout()
    ph = response_hidden(_llama(), rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask)
    assert ph.hidden.shape == (5 + 1 + 3 + 5 + 2 + 4, 32)
    assert ph.rows.tolist() == [0] * 5 + [1] + [2] * 3 + [3] * 5 + [4] * 2 + [5] * 4
    assert ph.cols.tolist()[:7] == [0, 1, 2, 3, 4, 0, 0]
    assert is_prefix_mask(torch.tensor([[True, True, False], [True, False, False], [False, False, False]]))
    gap = torch.tensor([[True, False, True]])
    assert not is_prefix_mask(gap)
    with pytest.raises(ValueError, match="response_mask must be True for a prefix"):
        response_hidden(_llama(), rb.prompt_ids[:1], rb.prompt_mask[:1], rb.response_ids[:1, :3], gap)


def test_decoder_shares_prompts_and_drops_finished_rows_without_changing_the_others():
    """Repeated prompts are prefilled once; rows marked done leave the cache (once at most 3/4 still go), and
    the rows still going get the logits of the full forward."""
    model = _llama(kv=2)
    ids, mask, cont = _batch()
    ids, mask, cont = ids.repeat(2, 1), mask.repeat(2, 1), cont.repeat(2, 1)  # 6 rows, 3 distinct prompts
    full_ids = torch.cat([ids, cont], 1)
    full_mask = torch.cat([mask, torch.ones_like(cont, dtype=torch.bool)], 1)
    with torch.no_grad():
        ref = model(input_ids=full_ids, attention_mask=full_mask.long(), position_ids=position_ids(full_mask)).logits
    dec = StaticDecoder(model, ids, mask, max_new_tokens=cont.shape[1])
    torch.testing.assert_close(dec.prefill(), ref[:, ids.shape[1] - 1], atol=2e-5, rtol=1e-5)
    assert dec.cache[0][0].shape[0] == 6
    done = torch.zeros(6, dtype=torch.bool)
    held = []
    for t, finished in enumerate([[], [4], [1, 5], [0]]):  # 1 of 6 done: kept; 3 of 6: 3/5 going -> compact
        done[finished] = True
        logits = dec.step(cont[:, t], done)
        held.append(dec.rows.tolist())
        torch.testing.assert_close(logits[~done], ref[~done, ids.shape[1] + t], atol=2e-5, rtol=1e-5)
    assert held == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [0, 2, 3], [2, 3]]
    assert (logits[done] == 0).all()
