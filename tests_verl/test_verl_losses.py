"""verl integration tests: run only in the verl virtualenv (`make test-verl`), on CPU, without Ray.

References are independent of the code under test where possible: verl's own ``vanilla`` loss (for the
aggregation and for ClipB/ClipV, whose dropped tokens simply leave the mask), covariances and entropies
computed by hand in the test, and verl's own ``entropy_from_logits``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import FSDPActorConfig, PolicyLossConfig

import entropy_rft.integrations.verl as ev
from entropy_rft import control
from entropy_rft.core.loss import policy_loss

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def actor_config(**kw):
    cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1, **kw)
    return cfg


def batch(seed=0, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logp = old + 0.4 * torch.randn(b, t, generator=g)  # ratios well outside [0.8, 1.2]: the clip matters
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    adv[1], logp[1, 0] = -0.7, old[1, 0] + 1.5  # A < 0 with r = e^1.5 > 3: verl's dual clip (c = 3) acts
    lens = torch.tensor([t, t - 2, 3, t - 1])[:b]
    mask = torch.arange(t)[None] < lens[:, None]
    return old, logp.requires_grad_(), adv, mask


def verl_vanilla(old, logp, adv, mask, agg, cfg):
    return get_policy_loss_fn("vanilla")(old, logp, adv, mask.float(), agg, cfg)[0]


@pytest.mark.parametrize("agg", AGGS)
def test_none_equals_verl_vanilla(agg):
    """Method 'none' through our loss = verl's own vanilla PPO loss (dual clip 3.0 included)."""
    cfg = actor_config()
    old, logp, adv, mask = batch()
    ours, met = get_policy_loss_fn("erft_none")(old, logp, adv, mask.float(), agg, cfg)
    ref = verl_vanilla(old, logp, adv, mask, agg, cfg)
    assert torch.allclose(ours, ref, atol=1e-6), (ours, ref)
    g1, = torch.autograd.grad(ours, logp)
    g2, = torch.autograd.grad(ref, logp)
    assert torch.allclose(g1, g2, atol=1e-6)
    assert met["tokens/counted"] == float(mask.sum())


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_with_global_info_sum_to_full_batch(agg):
    """Two micro-batches with verl's global_batch_info add up to the loss of the whole mini-batch, and each
    equals verl's vanilla under the same info (dp_size 2 doubles both)."""
    old, logp, adv, mask = batch(seed=1)
    full = get_policy_loss_fn("erft_none")(old, logp, adv, mask.float(), agg, actor_config())[0]
    for dp in (1, 2):
        cfg = actor_config(loss_scale_factor=9)
        cfg.global_batch_info.update(dp_size=dp, batch_num_tokens=int(mask.sum()), global_batch_size=4,
                                     loss_scale_factor=9)
        parts = []
        for rows in (slice(0, 1), slice(1, 4)):
            part = get_policy_loss_fn("erft_none")(old[rows], logp[rows], adv[rows], mask[rows].float(), agg, cfg)[0]
            assert torch.allclose(part, verl_vanilla(old[rows], logp[rows], adv[rows], mask[rows], agg, cfg), atol=1e-6)
            parts.append(part)
        if agg != "seq-mean-token-sum-norm":  # sum-norm: our default T vs loss_scale_factor 9
            assert torch.allclose(sum(parts), full * dp, atol=1e-6)


def stats_with_outlier(old, mask):
    """Hand-made old-policy statistics: S_c small everywhere except one strongly negative token at (0, 2)."""
    g = torch.Generator().manual_seed(5)
    s_c = 0.01 * torch.randn(mask.shape, generator=g)
    s_c[0, 2] = -5.0
    s_star = s_c + 0.1
    return s_star, s_c


@pytest.mark.parametrize("name", ["clip_v", "clip_b", "clip_v_paper", "clip_b_paper"])
@pytest.mark.parametrize("agg", AGGS)
def test_rollout_methods_equal_verl_vanilla_on_kept_tokens(name, agg):
    """ClipB/ClipV: our loss with the keep mask = verl's vanilla loss with the dropped tokens removed from the
    mask, and = our policy_loss(keep=...). The outlier token with A < 0 is dropped."""
    cfg = actor_config()
    old, logp, adv, mask = batch(seed=2)
    adv[0] = -1.0  # the outlier's sample is negative: the one-sided rules may drop it
    s_star, s_c = stats_with_outlier(old, mask)
    ev.configure(name, **({"mu": 3.0, "max_frac": None} if name == "clip_v" else {"mu": 3.0} if name == "clip_b"
                          else {"mu_low": 3.0, "mu_high": 3.0}))
    method = ev.configured_method(name)
    st = type("S", (), {"s_star": s_star, "s_centered": s_c, "entropy": torch.ones_like(s_c)})
    keep = method.rollout_masks(st, adv, mask).keep
    assert not keep[0, 2] and int((mask & ~keep).sum()) >= 1
    with ev._use_extras(ev.MicroBatchExtras(keep=keep)):
        ours, met = get_policy_loss_fn(name)(old, logp, adv, mask.float(), agg, cfg)
    ref = verl_vanilla(old, logp, adv, mask & keep, agg, cfg)
    assert torch.allclose(ours, ref, atol=1e-6)
    lib, _ = policy_loss(logp, old, adv, mask, keep=keep, eps_low=0.2, eps_high=0.2, dual_clip=3.0, agg=agg)
    assert torch.allclose(ours, lib, atol=1e-6)
    assert met["loss/counted_frac"] == pytest.approx(float((mask & keep).sum()) / float(mask.sum()))


def test_clip_v_keeps_positive_outlier():
    old, logp, adv, mask = batch(seed=2)
    adv[0] = 1.0
    _, s_c = stats_with_outlier(old, mask)
    keep = ev.configure("clip_v", mu=3.0).rollout_masks(
        type("S", (), {"s_centered": s_c}), adv, mask).keep
    assert bool(keep[0, 2])


def test_rollout_method_without_worker_raises():
    old, logp, adv, mask = batch()
    with pytest.raises(RuntimeError, match="erft_sync"):
        get_policy_loss_fn("clip_v")(old, logp, adv, mask.float(), "token-mean", actor_config())


def test_rollout_is_weights_rejected():
    old, logp, adv, mask = batch()
    with pytest.raises(ValueError, match="rollout importance weights"):
        get_policy_loss_fn("erft_none")(old, logp, adv, mask.float(), "token-mean", actor_config(),
                                        torch.ones_like(old))


def hand_cov(logp, adv, mask):
    lp, a = logp.detach()[mask].double(), adv[mask].double()
    cov = torch.zeros(mask.shape, dtype=torch.float64)
    cov[mask] = (lp - lp.mean()) * (a - a.mean())
    return cov


def cov_config(**policy_loss):
    """An actor config whose ``policy_loss`` sets verl's own Clip-Cov / KL-Cov keys (which both losses read)."""
    return actor_config(policy_loss=PolicyLossConfig(**policy_loss))


def verl_and_ours(name, old, logp, adv, mask, agg, cfg):
    """(loss, d loss / d log p, metrics) of verl's own ``name`` and of ``erft_<name>`` on the same inputs."""
    out = []
    for fn in (get_policy_loss_fn(name), get_policy_loss_fn(f"erft_{name}")):
        lp = logp.detach().clone().requires_grad_()
        loss, met = fn(old, lp, adv, mask.float(), agg, cfg)
        out.append((loss, torch.autograd.grad(loss, lp)[0], met))
    return out


def test_clip_cov_zeroes_every_candidate_when_ratio_is_one():
    """ratio 1 picks all candidates (no randomness): lb < cov < ub, valid and not PPO-clipped; they keep counting.
    No dual clip, as verl's own clip_cov (the batch has an A < 0 token at r = e^1.5 > 3)."""
    cfg = cov_config(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=10.0)
    old, logp, adv, mask = batch(seed=3)
    adv = adv * 4
    cov = hand_cov(logp, adv, mask)
    r = torch.exp(logp.detach() - old)
    clipped = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
    assert bool(((adv < 0) & (r > 3) & mask).any())
    cand = mask & (cov > 0.05) & (cov < 10.0) & ~clipped
    assert 0 < int(cand.sum()) < int(mask.sum())
    ours, met = get_policy_loss_fn("erft_clip_cov")(old, logp, adv, mask.float(), "token-mean", cfg)
    ref, _ = policy_loss(logp, old, adv, mask, zeroed=cand)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert met["loss/zeroed_frac"] == pytest.approx(float(cand.sum()) / float(mask.sum()))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", [3, 5])
def test_clip_cov_equals_verls_own(agg, seed):
    """erft_clip_cov = verl's clip_cov, loss and gradient, from the same keys (ratio 1: every candidate is picked,
    so verl's randperm does not matter); the same share of tokens zeroed."""
    cfg = cov_config(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=10.0)
    old, logp, adv, mask = batch(seed=seed)
    (theirs, g_t, met_t), (ours, g_o, met_o) = verl_and_ours("clip_cov", old, logp, adv * 4, mask, agg, cfg)
    assert 0 < met_t["actor/pg_clipfrac"] < 1
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), (ours, theirs)
    assert torch.allclose(g_o, g_t, rtol=1e-6, atol=1e-7)
    assert met_o["loss/zeroed_frac"] == pytest.approx(met_t["actor/pg_clipfrac"])


def test_kl_cov_selects_top_k_by_hand_covariance():
    old, logp, adv, mask = batch(seed=4)
    n = int(mask.sum())
    cfg = cov_config(kl_cov_ratio=3.5 / n, ppo_kl_coef=2.0)  # K = 3
    cov = hand_cov(logp, adv, mask).masked_fill(~mask, float("-inf"))
    top = torch.zeros_like(mask)
    top.view(-1)[cov.view(-1).topk(3).indices] = True
    ours, met = get_policy_loss_fn("erft_kl_cov")(old, logp, adv, mask.float(), "token-mean", cfg)
    r = torch.exp(logp - old)
    tok = -adv * r + torch.where(top, 2.0 * (logp - old).abs(), torch.zeros_like(r))
    ref = (tok * mask).sum() / n
    assert torch.allclose(ours, ref, atol=1e-6)
    assert met["control/kl_cov_selected_frac"] == pytest.approx(3 / n)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", [4, 6])
def test_kl_cov_equals_verls_own(agg, seed):
    """erft_kl_cov = verl's kl_cov, loss and gradient, from the same keys (verl's default coef 0.1 and a set one)."""
    old, logp, adv, mask = batch(seed=seed)
    for keys in ({"kl_cov_ratio": 0.2}, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}):
        (theirs, g_t, _), (ours, g_o, met) = verl_and_ours("kl_cov", old, logp, adv, mask, agg, cov_config(**keys))
        assert met["control/kl_cov_selected_frac"] == pytest.approx(int(0.2 * int(mask.sum())) / int(mask.sum()))
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7), (keys, ours, theirs)
        assert torch.allclose(g_o, g_t, rtol=1e-6, atol=1e-7), keys


def test_worker_refuses_erft_keys_that_verl_keys_set():
    """+actor_rollout_ref.erft.ratio with erft_clip_cov: one line naming verl's key (which the loss reads)."""
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.erft\.ratio: .*policy_loss\.clip_cov_ratio"):
        ev.check_worker_params("clip_cov", {"ratio": 2e-3})
    with pytest.raises(ValueError, match=r"policy_loss\.ppo_kl_coef"):
        ev.check_worker_params("kl_cov", {"coef": 1.0})
    ev.check_worker_params("clip_cov", {"exclude_clipped": False})  # ours alone: allowed
    ev.check_worker_params("clip_v", {"mu": 8.5})


def test_verl_clip_cov_name_is_left_to_verl():
    assert get_policy_loss_fn("clip_cov").__module__.startswith("verl.")
    assert ev.loss_names()["clip_v"] == "clip_v" and ev.loss_names()["erft_clip_cov"] == "clip_cov"


def test_unknown_aggregation_rejected():
    old, logp, adv, mask = batch()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        get_policy_loss_fn("erft_none")(old, logp, adv, mask.float(), "token-sum", actor_config())


SNIPPET = ("from verl.trainer.ppo.core_algos import get_policy_loss_fn as g; "
           "f = g('clip_v'); print(f.__module__, g('erft_kl_cov').__name__)")


def run_py(code, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_external_module_env_registers_losses_in_a_fresh_process():
    off = run_py(SNIPPET, VERL_USE_EXTERNAL_PLUGINS="none")
    assert off.returncode != 0 and "Unsupported loss mode: clip_v" in off.stderr
    on = run_py(SNIPPET, VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="entropy_rft.integrations.verl")
    assert on.returncode == 0, on.stderr[-2000:]
    assert "entropy_rft.integrations.verl erft_policy_loss_kl_cov" in on.stdout


def test_model_external_lib_hook_registers_losses_and_trainer():
    """actor_rollout_ref.model.external_lib: HFModelConfig.__post_init__ calls import_external_libs."""
    code = ("from verl.utils.import_utils import import_external_libs as imp; imp('entropy_rft.integrations.verl'); "
            + SNIPPET + "; from verl.trainer.ppo.v1 import get_trainer_cls as t; "
            "print(t('erft_sync').__mro__[1].__name__)")
    out = run_py(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PPOTrainerSync" in out.stdout


def test_stats_model_output_matches_hand_formulas_and_verl_entropy():
    """The old-pass hook on a packed forward: entropy = verl's entropy_from_logits; S, E_p[S], S_c by hand."""
    from verl.utils.torch_functional import entropy_from_logits

    g = torch.Generator().manual_seed(7)
    lens = [5, 3]
    nnz, v = sum(lens), 11
    logits = torch.randn(1, nnz, v, generator=g) * 2
    labels = torch.randint(0, v, (nnz,), generator=g)
    temp = torch.full((nnz,), 0.7)
    ids = torch.nested.nested_tensor([torch.zeros(n, dtype=torch.long) for n in lens], layout=torch.jagged)
    out = ev.stats_model_output(type("O", (), {"logits": logits}),
                                {"input_ids_rmpad_rolled": labels[None], "temperature_rmpad": temp}, {"input_ids": ids})
    z = logits[0].double() / 0.7
    p = z.softmax(-1)
    h = -(p * p.log()).sum(-1)
    pk = p.gather(-1, labels[:, None])[:, 0]
    s = pk * (h + pk.log())
    es = (p * p * (h[:, None] + p.log())).sum(-1)
    got = {k: out["erft_" + k].values().double() for k in ("entropy", "s_star", "s_expected", "s_centered")}
    assert out["erft_entropy"].offsets().tolist() == [0, 5, 8]
    assert torch.allclose(got["entropy"], entropy_from_logits(logits[0] / 0.7).double(), atol=1e-5)
    assert torch.allclose(got["s_star"], s, atol=1e-5)
    assert torch.allclose(got["s_expected"], es, atol=1e-5)
    assert torch.allclose(got["s_centered"], s - es, atol=1e-5)


def test_rollout_keep_single_process_equals_control_and_ignores_padding():
    old, logp, adv, mask = batch(seed=2)
    adv[0] = -1.0
    s_star, s_c = stats_with_outlier(old, mask)
    stats = {"entropy": torch.ones_like(s_c), "s_star": s_star, "s_expected": s_star - s_c, "s_centered": s_c}
    m = ev.configure("clip_v", mu=3.0, max_frac=None)
    keep = ev.rollout_keep(m, stats, adv, mask)
    assert torch.equal(keep, control.clip_v_mask(s_c, adv, mask, 3.0, None, "negative") & mask)
    assert not keep[~mask].any() and not keep[0, 2]
    assert torch.equal(ev.rollout_keep(ev.configure("clip_cov"), stats, adv, mask), mask)


def test_trainer_swaps_only_the_actor_worker():
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1 import get_trainer_cls

    cls = get_trainer_cls("erft_sync")
    obj = cls.__new__(cls)
    obj.config = None
    base = cls.__mro__[1]
    sentinel = object()

    def fake_base(self):
        self.role_worker_mapping = {Role.ActorRolloutRef: sentinel, Role.Critic: sentinel}

    orig = base._init_resource_pool_mgr
    base._init_resource_pool_mgr = fake_base
    try:
        cls._init_resource_pool_mgr(obj)
    finally:
        base._init_resource_pool_mgr = orig
    assert obj.role_worker_mapping[Role.Critic] is sentinel
    actor = obj.role_worker_mapping[Role.ActorRolloutRef]
    assert actor is not sentinel and "ErftActorRolloutRefWorker" in repr(actor.__ray_metadata__.class_name)


def _fsdp_stats_engine():
    """verl 0.9.1's FSDP LM engine with erft's hook, built without a model: prepare_model_outputs reads only
    the packed logits, the sequence-parallel setting and the entropy settings."""
    from types import SimpleNamespace

    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    eng = object.__new__(ev._stats_engine_class(FSDPEngineWithLMHead))
    eng.use_ulysses_sp = False
    eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    return eng


def test_stats_hook_through_verls_prepare_model_outputs_at_temperature_0_7():
    """The hook inside verl's real FSDP prepare_model_outputs, per-token temperature 0.7: erft's statistics
    equal token_stats(z / T), and verl's own entropy (computed from its own z / T copy) agrees with ours."""
    from verl.utils import tensordict_utils as tu

    from entropy_rft.core.dynamics import token_stats

    g = torch.Generator().manual_seed(11)
    lens = [6, 4]
    nnz, v, pad = sum(lens), 37, 2
    logits = torch.randn(1, nnz + pad, v, generator=g) * 3
    labels = torch.randint(0, v, (nnz + pad,), generator=g)
    temp = torch.full((nnz + pad,), 0.7)
    ids = torch.nested.nested_tensor([torch.zeros(n, dtype=torch.long) for n in lens], layout=torch.jagged)
    micro = tu.get_tensordict({"input_ids": ids}, {"use_remove_padding": True, "calculate_entropy": True,
                                                   "erft_token_stats": True})
    out = _fsdp_stats_engine().prepare_model_outputs(
        type("O", (), {"logits": logits})(),
        {"input_ids_rmpad_rolled": labels, "temperature_rmpad": temp, "pad_size": pad, "temperature_is_one": False},
        micro, None)
    want = token_stats(logits[0] / temp[:, None], labels)
    for f in ("entropy", "s_star", "s_expected", "s_centered"):
        got = out["erft_" + f].values()
        assert torch.equal(got, getattr(want, f)[:nnz]), f  # float32 z / T on both sides: bit for bit
    assert out["erft_entropy"].offsets().tolist() == [0, 6, 10]
    assert torch.allclose(out["erft_entropy"].values(), out["entropy"].values(), atol=1e-5)  # verl's own
    assert torch.allclose(out["log_probs"].values(), want.logp[:nnz], atol=1e-5)


def test_stats_hook_refuses_an_engine_it_cannot_read():
    """Megatron's engine (not importable without megatron-core) derives from BaseEngine, not the FSDP one."""
    from verl.workers.engine.base import BaseEngine

    megatron_like = type("MegatronEngineWithLMHead", (BaseEngine,), {})
    with pytest.raises(ValueError, match="supports verl's FSDP language-model engine .* not MegatronEngineWithLMHead"):
        ev._stats_engine_class(megatron_like)
