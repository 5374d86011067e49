"""Sampler consistency, evaluation metrics against naive forms, config parsing and validation."""

from __future__ import annotations

import itertools
import math
from math import comb

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import apply_overrides, config_from_dict, load_config
from entropy_rft.config.schema import help_text
from entropy_rft.policy import evaluation
from entropy_rft.policy.forward import policy_forward
from entropy_rft.policy.rollout import sample
from micro import make_micro_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = make_micro_policy(tmp_path_factory.mktemp("m") / "p")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


# ----------------------------------------------------------------------------- sampler


def test_kv_sampler_logprobs_match_training_forward(policy):
    """The KV-cache sampler with left padding sees the same distribution as the training forward."""
    model, tok = policy
    prompts = ["1>2:", "123>45:", "98>7:"]  # different lengths -> left padding
    logs: list[torch.Tensor] = []

    class Spy(torch.nn.Module):  # records the sampler's per-step distributions
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, **kw):
            out = self.m(**kw)
            logs.append(torch.log_softmax(out.logits[:, -1].float(), -1))
            return out

        def parameters(self, recurse=True):
            return self.m.parameters(recurse)

    gen = torch.Generator().manual_seed(0)
    rb = sample(Spy(model), tok, prompts, max_new_tokens=5, temperature=1.0, generator=gen)
    assert rb.response_ids.shape[0] == 3
    fwd = policy_forward(model, rb, 1.0).logp
    for t in range(rb.response_ids.shape[1]):
        want = logs[t].gather(-1, rb.response_ids[:, t : t + 1])[:, 0]
        m = rb.response_mask[:, t]
        torch.testing.assert_close(fwd[:, t][m], want[m], atol=1e-5, rtol=1e-5)


def test_fused_and_materialised_forward_agree(policy):
    model, tok = policy
    rb = sample(model, tok, ["12>3:", "456>78:"], max_new_tokens=6, temperature=0.7,
                generator=torch.Generator().manual_seed(1))
    a = policy_forward(model, rb, 0.7, fused=True, with_entropy=True)
    b = policy_forward(model, rb, 0.7, fused=False, with_entropy=True)
    torch.testing.assert_close(a.logp, b.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.stats.s_centered, b.stats.s_centered, atol=1e-6, rtol=1e-5)


def test_sampler_is_seeded_and_masks_after_eos(policy):
    model, tok = policy
    kw = dict(max_new_tokens=8, temperature=1.0)
    a = sample(model, tok, ["12>3:"] * 16, generator=torch.Generator().manual_seed(3), **kw)
    b = sample(model, tok, ["12>3:"] * 16, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a.response_ids, b.response_ids)
    eos = tok.eos_token_id
    for ids, m in zip(a.response_ids, a.response_mask):
        hits = (ids == eos).nonzero()
        if hits.numel():
            first = int(hits[0])
            assert m[: first + 1].all() and not m[first + 1 :].any()
        else:
            assert m.all()


def test_hf_backend_runs(policy):
    model, tok = policy
    torch.manual_seed(0)
    rb = sample(model, tok, ["12>3:", "4>5:"], max_new_tokens=4, backend="hf")
    assert rb.response_ids.shape == rb.response_mask.shape and len(rb.responses) == 2


# ----------------------------------------------------------------------------- evaluation


def naive_pass_at_k(n: int, c: int, k: int) -> float:
    """Pass@K by enumerating every k-subset of n samples (c correct)."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
@settings(max_examples=60, deadline=None)
def test_pass_at_k_matches_enumeration(nck):
    n, c, k = nck
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(naive_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_closed_form_and_errors():
    assert evaluation.pass_at_k(32, 4, 8) == pytest.approx(1 - comb(28, 8) / comb(32, 8))
    for bad in [(4, 5, 1), (4, 1, 5), (0, 0, 1), (4, -1, 1)]:
        with pytest.raises(ValueError):
            evaluation.pass_at_k(*bad)


def test_avg_maj_distinct_histogram_by_hand():
    correct = [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    answers = [["a", "b", "c", "b"], [None, "x", "x", "y"], ["p", "p", "q", "p"]]
    assert evaluation.avg_at_k(correct) == pytest.approx(6 / 12)
    # Problem 0: majority 'b' is wrong; problem 1: 'x' wrong; problem 2: 'p' right.
    assert evaluation.maj_at_k(answers, correct) == pytest.approx(1 / 3)
    # Distinct correct: {a, c}, {}, {p, q}.
    assert evaluation.distinct_correct(answers, correct) == pytest.approx(4 / 3)
    assert evaluation.pass_rate_histogram(correct) == [1, 0, 1, 0, 1]
    s = evaluation.summarize(correct, answers)
    assert s["eval/pass@4"] == pytest.approx(2 / 3) and s["eval/pass@1"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- config


def test_default_config_loads_and_every_field_has_help():
    cfg = load_config()
    assert cfg.method.name == "none" and cfg.rollout.group_size >= 2
    lines = help_text()
    assert len(lines) > 40
    assert all(line.split(": ", 1)[1].strip() for line in lines), "a field has no help text"


def test_help_config_shows_each_fields_rule_as_erft_methods_does():
    lines = help_text()
    line = {ln.split(" = ", 1)[0]: ln for ln in lines}
    assert line["rollout.top_p"].startswith("rollout.top_p = 1.0 (in (0, 1]): ")  # 0 < top_p <= 1
    assert line["algo.dual_clip"].startswith("algo.dual_clip = None (> 1 or null): ")  # c > 1, or off
    assert line["eval.batch_size"].startswith("eval.batch_size = 512 (>= 1): ")
    assert line["algo.ref_kl_estimator"].startswith("algo.ref_kl_estimator = 'k3' (k1, k2 or k3): ")
    assert line["task.name"].startswith("task.name = 'countdown': ")  # no declared rule: nothing shown


def test_overrides_parse_yaml_values_and_flags_win():
    cfg = load_config(None, ["optim.lr=1e-3", "algo.eps_high=null", "method.name=clip_b"],
                      extra={"method": {"name": "clip_v"}})
    assert cfg.optim.lr == 1e-3 and cfg.algo.eps_high is None and cfg.method.name == "clip_v"
    assert cfg.method_params() == {"mu": 2.0, "max_frac": None}  # the default config's preset for clip_v
    assert apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]"]) == {"a": {"b": 1, "c": [1, 2]}}


@pytest.mark.parametrize("data, field", [
    ({"optim": {"lr": 0}}, "optim.lr"),
    ({"rollout": {"temperature": -1}}, "rollout.temperature"),
    ({"rollout": {"group_size": 1}}, "rollout.group_size"),
    ({"algo": {"agg": "mean"}}, "algo.agg"),
    ({"algo": {"minibatches": 10_000}}, "algo.minibatches"),
    ({"optim": {"lr": "fast"}}, "optim.lr"),
    ({"nonsense": 1}, "nonsense"),
    ({"method": {"name": "clip_v", "params": {"mu": -1}}}, "mu"),
    ({"method": {"name": "clip_cov", "params": {"lb": 5, "ub": 1}}}, "lb"),
])
def test_invalid_config_names_the_field(data, field):
    with pytest.raises(UserError) as e:
        config_from_dict(data)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_bad_yaml_file_is_reported(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim: [unclosed")
    with pytest.raises(UserError, match="c.yaml"):
        load_config(p)
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    assert math.isfinite(load_config(None, ["optim.lr=2"]).optim.lr)
