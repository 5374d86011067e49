"""Issue 66: the new method of ``tests/new_method.py`` (one module, one registration) through verl's loss entry
point, in verl's virtualenv (``make test-verl``). It is registered after ``entropy_rft.integrations.verl`` was
imported (which registers the methods it finds at import): ``control.on_register`` makes it a verl loss all the
same, under ``erft_<name>`` and its plain name. The worker's rollout keep (``rollout_keep``) selects with it, and
the loss is verl's vanilla PPO loss on the kept tokens, as for ClipB and ClipV (``test_verl_losses.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.workers.config import FSDPActorConfig

import entropy_rft.integrations.verl as ev

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from new_method import LowEntropyNegatives, registered  # noqa: E402

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def batch(seed: int = 3, b: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logp = (old + 0.4 * torch.randn(b, t, generator=g)).requires_grad_()
    adv = torch.tensor([1.0, -0.5, -1.0, 0.7])[:, None].expand(b, t).clone()
    mask = torch.arange(t)[None] < torch.tensor([t, t - 2, 3, t - 1])[:b, None]
    entropy = torch.rand(b, t, generator=g) * 2  # half the A<0 tokens below h_min = 1
    s_star = torch.randn(b, t, generator=g)
    return old, logp, adv, mask, {"entropy": entropy, "s_star": s_star, "s_expected": torch.zeros(b, t),
                                  "s_centered": s_star}


@pytest.mark.parametrize("agg", AGGS)
def test_a_method_registered_after_the_plugin_is_a_verl_loss(agg):
    cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1)
    old, logp, adv, mask, stats = batch()
    name = LowEntropyNegatives.name
    try:
        with registered():
            assert ev.loss_names()[ev.PREFIX + name] == name and ev.loss_names()[name] == name
            ev.configure(name, h_min=1.0)
            keep = ev.rollout_keep(ev.configured_method(name), stats, adv, mask)  # the worker's selection
            assert torch.equal(keep, mask & ~((adv < 0) & (stats["entropy"] < 1.0)))
            assert 0 < int((mask & ~keep).sum()) < int(mask.sum())  # the method acts
            with ev._use_extras(ev.MicroBatchExtras(keep=keep)):
                ours, met = get_policy_loss_fn(ev.PREFIX + name)(old, logp, adv, mask.float(), agg, cfg)
            ref = get_policy_loss_fn("vanilla")(old, logp, adv, (mask & keep).float(), agg, cfg)[0]
            assert torch.allclose(ours, ref, atol=1e-6), (ours, ref)
            assert met["loss/counted_frac"] == pytest.approx(float(keep.sum()) / float(mask.sum()))
            with pytest.raises(RuntimeError, match="erft_sync"):  # no worker keep: refused, as ClipB and ClipV
                get_policy_loss_fn(name)(old, logp, adv, mask.float(), agg, cfg)
    finally:  # the suite's other files see verl's registry as the plug-in's import left it
        for n in (ev.PREFIX + name, name):
            POLICY_LOSS_REGISTRY.pop(n, None)
            ev._REGISTERED.pop(n, None)
        ev._METHODS.pop(name, None)
        ev._GENERATOR.pop(name, None)
