"""TRL integration (CPU): version pin, statistics against TRL's own fused head and our native forward, masks
and loss against the native trainer's components, the accumulation re-weighting, and short `erft train
--engine trl` runs for every method (run directory rules, metrics.jsonl, resume).

References are independent of the code under test: TRL's ``add_fused_lm_head`` (its own log-prob/entropy
kernel), ``entropy_rft.policy.forward.policy_forward`` (the native trainer's forward) and plain ``policy_loss``
on the concatenated batch.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from entropy_rft import control  # noqa: E402
from entropy_rft.common.errors import UserError  # noqa: E402
from entropy_rft.config.loading import load_config  # noqa: E402
from entropy_rft.core.loss import policy_loss, ppo_clipped_mask  # noqa: E402
from entropy_rft.integrations import trl as erft_trl  # noqa: E402
from entropy_rft.integrations import trl_task, window  # noqa: E402
from entropy_rft.integrations.stats_forward import fused_policy_out  # noqa: E402
from entropy_rft.launch import run as launch
from entropy_rft.models.loading import load_policy  # noqa: E402
from entropy_rft.policy.forward import policy_forward  # noqa: E402
from entropy_rft.policy.rollout import RolloutBatch  # noqa: E402
from micro import make_micro_policy, micro_overrides  # noqa: E402

# Parameters that make every method act on a few dozen tokens.
ACTING = {
    "none": {},
    "clip_b": {"mu": 0.5},
    "clip_b_paper": {"mu_low": 0.5, "mu_high": 0.5},
    "clip_v": {"mu": 0.5, "max_frac": 0.05},
    "clip_v_paper": {"mu_low": 0.5, "mu_high": 0.5},
    "clip_cov": {"ratio": 0.1, "lb": -5.0, "ub": 5.0},
    "kl_cov": {"ratio": 0.1},
    "clip_higher": {},
    "entropy_bonus": {"coef": 0.1},
    "high_entropy": {"top_q": 0.5},
    "grad_mask": {"sample_sign": "negative", "s_sign": "negative", "drop_other_samples": False},
}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("trl") / "policy")


def fixed_batch(seed: int = 0, b: int = 8, p: int = 5, c: int = 7, vocab: int = 21):
    """Equal-length prompts (no left padding, so TRL's and our position ids agree), right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (b, p), generator=g)
    comp = torch.randint(3, vocab, (b, c), generator=g)
    lengths = torch.randint(2, c + 1, (b,), generator=g)
    cmask = torch.arange(c)[None, :] < lengths[:, None]
    adv = torch.randn(b, generator=g)
    adv[0] = 0.0
    return prompt, comp, cmask, adv


def make_trainer(policy_dir: Path, method: str, params: dict, tmp: Path, **cfg_kw):
    from datasets import Dataset
    from trl import GRPOConfig

    model, tok = load_policy(str(policy_dir))
    args = GRPOConfig(output_dir=str(tmp / "trl"), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=7, max_steps=1, report_to=[],
                      save_strategy="no", disable_tqdm=True, seed=3, **cfg_kw)
    ds = Dataset.from_dict({"prompt": ["123>7:"] * 8})
    return erft_trl.EntropyControlGRPOTrainer(
        model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=ds, processing_class=tok, method=method, method_params=params)


# ----------------------------------------------------------------------------- version pin


def test_version_pin():
    erft_trl.check_trl_version("1.16.0")
    erft_trl.check_trl_version("1.16.3.dev0")
    for bad in ("1.15.9", "1.17.0", "2.0.0", "0.29.1"):
        with pytest.raises(ImportError, match=r"trl>=1\.16\.0,<1\.17\.0"):
            erft_trl.check_trl_version(bad)


# ----------------------------------------------------------------------------- statistics


def test_stats_match_trl_fused_head_and_native_forward(policy_dir):
    from trl.trainer.utils import add_fused_lm_head

    model, _ = load_policy(str(policy_dir))
    prompt, comp, cmask, _ = fixed_batch()
    ids = torch.cat([prompt, comp], 1)
    am = torch.cat([torch.ones_like(prompt), cmask.long()], 1)
    temp = 0.7
    with torch.no_grad():
        ours = fused_policy_out(model, ids, am, comp.shape[1], temp)
        rb = RolloutBatch(prompt, torch.ones_like(prompt, dtype=torch.bool), comp, cmask, [""] * len(comp))
        native = policy_forward(model, rb, temp)
        ref = copy.deepcopy(model)
        add_fused_lm_head(ref, temperature=temp, outputs=("log_probs", "entropy"))
        labels = ids.masked_fill(am == 0, -100)
        labels[:, : prompt.shape[1]] = -100
        trl_out = ref(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    trl_logp = trl_out.log_probs[:, -comp.shape[1]:]
    trl_ent = trl_out.entropy[:, -comp.shape[1]:]
    torch.testing.assert_close(ours.logp[cmask], trl_logp[cmask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.stats.entropy[cmask], trl_ent[cmask].float(), atol=1e-5, rtol=1e-5)
    for f in ("logp", "entropy", "s_star", "s_expected", "s_centered"):
        torch.testing.assert_close(getattr(ours.stats, f)[cmask], getattr(native.stats, f)[cmask],
                                   atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- masks and loss vs native


def m_stage(method: str) -> str:
    return control.build_method(method, **ACTING[method]).stage


@pytest.mark.parametrize("method", sorted(m for m in ACTING if m != "none"))  # none: TRL's own loss (below)
def test_masks_and_loss_equal_native(policy_dir, tmp_path, method):
    trainer = make_trainer(policy_dir, method, ACTING[method], tmp_path)
    model = trainer.model
    model.train()
    prompt, comp, cmask, adv = fixed_batch(seed=1)
    ids, am = torch.cat([prompt, comp], 1), torch.cat([torch.ones_like(prompt), cmask.long()], 1)
    # the integration's path: old-policy pass, global rollout masks, then _compute_loss (window of one)
    old_logp, _, old_stats = trainer._policy_stats(model, ids, am, comp.shape[1], None)
    gb = window.global_rollout_batch(trainer.method, old_stats, adv, cmask)
    keep = cmask.clone() if gb.masks.keep is None else gb.masks.keep & cmask
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": comp,
              "completion_mask": cmask.long(), "advantages": adv, "old_per_token_logps": old_logp,
              "erft_old_logps": old_logp, "erft_keep": keep}
    trainer._buffered_inputs, trainer._step = [inputs], 0
    if trainer.delegates:  # drops and clips composed into TRL's own loss: its loss mask and normaliser
        inputs["num_items_in_batch"] = cmask.sum()
        trainer._compose_keep(inputs) if m_stage(method) == "rollout" else None
        trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    grad = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad()

    # the native trainer's components on the same inputs
    m = control.build_method(method, **ACTING[method])
    rb = RolloutBatch(prompt, torch.ones_like(prompt, dtype=torch.bool), comp, cmask, [""] * len(comp))
    adv_tok = adv[:, None].expand_as(cmask).float() * cmask
    with torch.no_grad():
        nat_old = policy_forward(model, rb, 1.0)
    nat_keep = m.rollout_masks(nat_old.stats, adv_tok, cmask).keep
    assert torch.equal(keep, cmask if nat_keep is None else nat_keep & cmask)
    cur = policy_forward(model, rb, 1.0, with_entropy=m.needs_entropy_grad())
    kw = dict(eps_low=0.2, eps_high=0.2, agg="token-mean")
    kw.update(m.loss_kwargs())
    masks = control.Masks()
    if m.stage == "minibatch":
        clipped = ppo_clipped_mask(cur.logp.detach(), nat_old.logp, adv_tok, cmask, kw["eps_low"], kw["eps_high"])
        masks = m.minibatch_masks(cur.logp.detach(), nat_old.logp, adv_tok, cmask, clipped=clipped,
                                  generator=torch.Generator().manual_seed(3 + 2))
        win = trainer._generation.window.masks[0]
        for f in ("keep", "zeroed", "kl_cov_select"):
            a, b = getattr(win, f), getattr(masks, f)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f
    nat_loss, _ = policy_loss(cur.logp, nat_old.logp, adv_tok, cmask, keep=nat_keep, zeroed=masks.zeroed,
                              kl_cov_select=masks.kl_cov_select, entropy=cur.entropy, **kw)
    nat_loss.backward()
    torch.testing.assert_close(loss.detach(), nat_loss.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, model.get_output_embeddings().weight.grad, atol=1e-6, rtol=1e-4)
    if method in ("clip_b_paper", "clip_v_paper", "high_entropy", "clip_v"):
        assert int(keep.sum()) < int(cmask.sum())  # the method acted, so the equality above is not vacuous


@pytest.mark.parametrize("cfg", [{}, {"loss_type": "sapo"}, {"loss_type": "cispo"},
                                 {"loss_type": "grpo", "importance_sampling_level": "sequence"}],
                         ids=["dapo", "sapo", "cispo", "gspo"])
def test_method_none_is_trls_own_loss(policy_dir, tmp_path, cfg):
    """With ``none`` the plug-in's loss hook is TRL's ``_compute_loss``: the same loss and gradient on the same
    micro-batch, on loss types and a level the plug-in's own surrogate does not have."""
    from trl import GRPOTrainer

    trainer = make_trainer(policy_dir, "none", {}, tmp_path, **cfg)
    assert trainer.delegates
    model = trainer.model
    model.train()
    prompt, comp, cmask, adv = fixed_batch(seed=2)
    with torch.no_grad():
        old = trainer._policy_stats(model, torch.cat([prompt, comp], 1),
                                    torch.cat([torch.ones_like(prompt), cmask.long()], 1), comp.shape[1], None)[0]
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": comp,
              "completion_mask": cmask.long(), "advantages": adv, "old_per_token_logps": old - 0.05 * adv[:, None],
              "num_items_in_batch": cmask.sum()}
    trainer.current_gradient_accumulation_steps = 1
    grads = []
    for fn in (trainer._compute_loss, lambda m, x: GRPOTrainer._compute_loss(trainer, m, x)):
        loss = fn(model, dict(inputs))
        loss.backward()
        grads.append((loss.detach(), model.get_output_embeddings().weight.grad.clone()))
        model.zero_grad()
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert grads[0][1].abs().sum() > 0


def test_clip_higher_is_trls_own_clip_widened(policy_dir, tmp_path):
    """clip-higher composes as TRL's epsilon_high (0.28): its loss is TRL's with that clip, and differs from the
    0.2 clip on a batch whose ratios lie between 1.2 and 1.28."""
    from trl import GRPOTrainer

    trainer = make_trainer(policy_dir, "clip_higher", {}, tmp_path, loss_type="bnpo")
    model = trainer.model
    prompt, comp, cmask, adv = fixed_batch(seed=4)
    adv = adv.abs() + 0.1
    with torch.no_grad():
        logp = trainer._policy_stats(model, torch.cat([prompt, comp], 1),
                                     torch.cat([torch.ones_like(prompt), cmask.long()], 1), comp.shape[1], None)[0]
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": comp,
              "completion_mask": cmask.long(), "advantages": adv, "old_per_token_logps": logp - 0.22,
              "num_items_in_batch": cmask.sum()}  # every ratio e^0.22 = 1.246
    trainer.current_gradient_accumulation_steps = 1
    ours = trainer._compute_loss(model, dict(inputs)).item()
    assert trainer.epsilon_high == pytest.approx(0.28) and trainer.epsilon_low == pytest.approx(0.2)
    want = GRPOTrainer._compute_loss(trainer, model, dict(inputs)).item()
    trainer.epsilon_high = 0.2
    narrow = GRPOTrainer._compute_loss(trainer, model, dict(inputs)).item()
    assert ours == want and ours != narrow


def test_a_composing_methods_settings_reach_trl_through_its_config_and_follow_the_knob(policy_dir, tmp_path):
    """clip-higher's clip is in the GRPOConfig TRL received (a copy: the caller's stays as given), so TRL set its
    loss up from it; a knob moved afterwards (a resume, a controller) reaches TRL's loss at the next loss call.
    The entropy bonus owns TRL's entropy term even at coefficient 0."""
    trainer = make_trainer(policy_dir, "clip_higher", {"eps_high": 0.3}, tmp_path, loss_type="bnpo")
    assert (trainer.args.epsilon, trainer.args.epsilon_high, trainer.epsilon_high) == (0.2, 0.3, 0.3)
    inputs = delegated_inputs(trainer, seed=4)
    trainer.method.set_knob(0.35)
    trainer._compute_loss(trainer.model, dict(inputs))
    assert trainer.epsilon_high == 0.35 and trainer.epsilon_low == 0.2

    trainer = make_trainer(policy_dir, "entropy_bonus", {"coef": 0.0}, tmp_path)
    assert trainer.args.entropy_coef == 0.0 and not trainer._entropy_bonus_enabled  # TRL's rule for a 0 config
    trainer.method.set_knob(0.05)
    trainer._compute_loss(trainer.model, dict(delegated_inputs(trainer, seed=4)))
    assert trainer._entropy_bonus_enabled and trainer.entropy_coef == 0.05

    from datasets import Dataset
    from trl import GRPOConfig

    # GRPOTrainer's arguments by position: the config is found as ``args`` and the caller's is left as given
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], epsilon_high=None)
    model, tok = load_policy(str(policy_dir))
    trainer = erft_trl.EntropyControlGRPOTrainer(model, lambda completions, **kw: [0.0] * len(completions), args,
                                                 Dataset.from_dict({"prompt": ["123>7:"] * 8}), None, tok,
                                                 method="clip_low")
    assert args.epsilon_high is None and trainer.args is not args
    want = trainer.method.loss_kwargs()
    assert (trainer.epsilon_low, trainer.epsilon_high) == (want["eps_low"], want["eps_high"])


def test_our_loss_follows_a_knob_moved_after_init(policy_dir, tmp_path):
    """Issue 78: the loss's settings are TRL's (set once) with the method's own on top at every loss call, so a
    knob moved after __init__ (set_knob: a resume, a controller) reaches our loss too, not only TRL's; erft train's
    own fields (loss_base: a side left unclipped) sit under the method's, which keeps the side it sets."""
    trainer = make_trainer(policy_dir, "ce_gppo", {}, tmp_path, loss_type="bnpo")
    assert not trainer.delegates and trainer.loss_settings.ce_beta_high == 1.0
    trainer.method.set_knob(0.4)
    assert trainer.loss_settings.ce_beta_high == 0.4 and trainer.loss_kwargs["ce_beta_high"] == 0.4
    inputs = delegated_inputs(trainer, seed=5, shift=0.4)

    def grad(beta):  # CE-GPPO's term has value 0 and gradient −β·(1 + ε)·A·∇log π past the clip
        trainer.method.set_knob(beta)
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, dict(inputs)).backward()
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    assert not torch.equal(grad(0.4), grad(1.0))  # the new β reached the loss

    from datasets import Dataset
    from trl import GRPOConfig

    model, tok = load_policy(str(policy_dir))
    args = GRPOConfig(output_dir=str(tmp_path / "trl2"), use_cpu=True, bf16=False, report_to=[],
                      per_device_train_batch_size=8, num_generations=4)
    kw = dict(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
              train_dataset=Dataset.from_dict({"prompt": ["123>7:"] * 8}), processing_class=tok, agg="token-mean",
              loss_base={"eps_high": None, "ref_kl_estimator": "k1"})
    plain = erft_trl.EntropyControlGRPOTrainer(method="none", **kw)
    assert plain.loss_settings.eps_high is None and plain.loss_settings.ref_kl_estimator == "k1"
    higher = erft_trl.EntropyControlGRPOTrainer(method="clip_higher", **kw)
    assert higher.loss_settings.eps_high == 0.28 and higher.loss_settings.eps_low == 0.2


LOSS_TYPES = [{"loss_type": t} for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")] + [
    {"loss_type": "grpo", "importance_sampling_level": "sequence"}]


def delegated_inputs(trainer, seed: int, shift: float = 0.05):
    """A training micro-batch as the plug-in buffers it (old-policy log-probs shifted off-policy by ``shift``·A,
    so ratios differ from 1), the only one of its optimizer window."""
    prompt, comp, cmask, adv = fixed_batch(seed=seed)
    ids, am = torch.cat([prompt, comp], 1), torch.cat([torch.ones_like(prompt), cmask.long()], 1)
    with torch.no_grad():
        logp = trainer._policy_stats(trainer.model, ids, am, comp.shape[1], None)[0]
    old = logp - shift * adv[:, None]
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": comp,
              "completion_mask": cmask.long(), "advantages": adv, "old_per_token_logps": old,
              "erft_old_logps": old, "erft_keep": cmask.clone(), "num_items_in_batch": cmask.sum()}
    trainer._buffered_inputs, trainer._step = [inputs], 0
    trainer.current_gradient_accumulation_steps = 1
    return inputs


def loss_and_grad(fn, model, inputs):
    loss = fn(model, inputs)
    loss.backward()
    grad = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad()
    return loss.detach(), grad


@pytest.mark.parametrize("cfg", LOSS_TYPES, ids=lambda c: "-".join(map(str, c.values())))
def test_clip_cov_is_trls_own_loss_with_zero_advantages(policy_dir, tmp_path, cfg):
    """Clip-Cov composes into TRL's loss on every loss type and level: TRL's ``_compute_loss`` with per-token
    advantages that are 0 on the selected tokens (the selection from TRL's training forward), the buffered
    micro-batch's advantages untouched afterwards."""
    from trl import GRPOTrainer

    trainer = make_trainer(policy_dir, "clip_cov", {"ratio": 0.2, "lb": -5.0, "ub": 5.0}, tmp_path, **cfg)
    assert trainer.delegates
    model = trainer.model
    model.train()
    inputs = delegated_inputs(trainer, seed=5)
    adv = inputs["advantages"]
    ours = loss_and_grad(trainer._compute_loss, model, inputs)
    assert inputs["advantages"] is adv
    zeroed = trainer._generation.window.masks[0].zeroed
    assert zeroed is not None and 0 < int(zeroed.sum()) < int(inputs["completion_mask"].sum())
    by_hand = torch.where(zeroed, 0.0, adv[:, None].expand(zeroed.shape))
    want = loss_and_grad(lambda m, x: GRPOTrainer._compute_loss(trainer, m, x), model,
                         {**inputs, "advantages": by_hand})
    stock = loss_and_grad(lambda m, x: GRPOTrainer._compute_loss(trainer, m, x), model, dict(inputs))
    assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1])
    assert not torch.equal(ours[1], stock[1])  # the zeroes changed the step


@pytest.mark.parametrize("method, params", [("clip_cov", {"ratio": 0.2, "lb": -5.0, "ub": 5.0}),
                                            ("kl_cov", {"ratio": 0.2})])
def test_a_loss_leaves_trls_micro_batch_as_it_found_it(policy_dir, tmp_path, method, params, monkeypatch):
    """During and after a loss (TRL's own with Clip-Cov's zeroes, or erft's with KL-Cov's selection), every key of
    the buffered micro-batch holds the same tensor with the same values (TRL reuses it for its next iterations);
    Clip-Cov's zeroes reach TRL's loss in a copy; the plug-in adds no key during a loss (its rows,
    ``trl_support.RolloutRows``, are set with the generation batch; its window is the trainer's ``GenerationState``)."""
    from trl import GRPOTrainer

    trainer = make_trainer(policy_dir, method, params, tmp_path)
    trainer.model.train()
    inputs = delegated_inputs(trainer, seed=5)
    before = dict(inputs)
    values = {k: v.clone() for k, v in inputs.items()}
    trl_loss, seen = GRPOTrainer._compute_loss, []

    def watched(self, model, x):
        loss = trl_loss(self, model, x)
        seen.append((x is not inputs, inputs["advantages"] is before["advantages"], x["advantages"].dim()))
        return loss

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", watched)
    trainer._compute_loss(trainer.model, inputs).backward()
    assert seen == ([(True, True, 2)] if trainer.delegates else []), seen  # TRL read per-token zeroes from a copy
    assert set(inputs) == set(before), set(inputs) ^ set(before)
    for k, v in before.items():
        assert inputs[k] is v and torch.equal(v, values[k]), k


@pytest.mark.parametrize("cfg", LOSS_TYPES[4:], ids=lambda c: "-".join(map(str, c.values())))
def test_entropy_bonus_is_trls_entropy_term_on_every_loss_type(policy_dir, tmp_path, cfg):
    """The entropy bonus composes as TRL's own entropy term: the loss is TRL's minus coef times the token mean of
    H over the loss mask (H from the logits in float64 here), on loss types the plug-in's surrogate lacks."""
    from trl import GRPOTrainer

    coef = 0.1
    trainer = make_trainer(policy_dir, "entropy_bonus", {"coef": coef}, tmp_path, **cfg)
    assert trainer.delegates
    model = trainer.model
    model.train()
    inputs = delegated_inputs(trainer, seed=6)
    ours = trainer._compute_loss(model, dict(inputs)).item()
    trainer._entropy_bonus_enabled = False
    plain = GRPOTrainer._compute_loss(trainer, model, dict(inputs)).item()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    c = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am).logits[:, -c - 1:-1].double() / trainer.temperature
    logq = logits.log_softmax(-1)
    h = -(logq.exp() * logq).sum(-1)
    m = inputs["completion_mask"].bool()
    assert ours == pytest.approx(plain - coef * float(h[m].mean()), abs=1e-6)


# ----------------------------------------------------------------------------- accumulation re-weighting


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_scales_make_accumulation_equal_whole_batch(agg):
    g = torch.Generator().manual_seed(7)
    widths, rows = [5, 9, 3], [4, 2, 5]
    parts = []
    for b, t in zip(rows, widths):
        lp = torch.randn(b, t, generator=g) * 0.3 - 1.0
        old = lp + 0.1 * torch.randn(b, t, generator=g)
        mask = torch.rand(b, t, generator=g) < 0.7
        keep = torch.rand(b, t, generator=g) < 0.8
        adv = torch.randn(b, generator=g)
        parts.append((lp, old, mask, keep, adv))
    width = 9
    scales = window.global_loss_scales([m & k for _, _, m, k, _ in parts], agg, width)
    acc = sum(s * policy_loss(lp, old, adv, m, keep=k, agg=agg)[0] for s, (lp, old, m, k, adv) in zip(scales, parts))

    def pad(x, v):
        out = torch.full((x.shape[0], width), v, dtype=x.dtype)
        out[:, : x.shape[1]] = x
        return out

    whole, _ = policy_loss(torch.cat([pad(p[0], 0.0) for p in parts]), torch.cat([pad(p[1], 0.0) for p in parts]),
                           torch.cat([p[4] for p in parts]), torch.cat([pad(p[2], False) for p in parts]),
                           keep=torch.cat([pad(p[3], False) for p in parts]), agg=agg)
    torch.testing.assert_close(acc, whole, atol=1e-6, rtol=1e-5)
    assert any(abs(s - 1.0) > 1e-3 for s in scales)  # re-weighting was needed


def test_unsupported_trl_options_are_rejected_before_loading(policy_dir, tmp_path, monkeypatch):
    """A method whose loss path cannot run the config is refused in one line naming the pair, before TRL reads a
    weight (GRPOTrainer.__init__ never runs); ``none`` runs them (TRL's own loss)."""
    from trl import GRPOTrainer

    loaded = []
    real = GRPOTrainer.__init__
    monkeypatch.setattr(GRPOTrainer, "__init__", lambda self, *a, **k: loaded.append(1) or real(self, *a, **k))
    with pytest.raises(ValueError, match="loss_type='sapo' with method 'kl_cov'"):
        make_trainer(policy_dir, "kl_cov", {}, tmp_path, loss_type="sapo")
    with pytest.raises(ValueError, match="importance_sampling_level='sequence' with method 'kl_cov'"):
        make_trainer(policy_dir, "kl_cov", {}, tmp_path, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="high_entropy"):
        make_trainer(policy_dir, "kl_cov", {}, tmp_path, top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match="entropy_coef / use_adaptive_entropy with method 'entropy_bonus'"):
        make_trainer(policy_dir, "entropy_bonus", {}, tmp_path, entropy_coef=0.01)
    assert loaded == []
    make_trainer(policy_dir, "none", {}, tmp_path, loss_type="sapo", top_entropy_quantile=0.2)
    make_trainer(policy_dir, "clip_v", {}, tmp_path, loss_type="sapo", importance_sampling_level="sequence")
    make_trainer(policy_dir, "clip_cov", {}, tmp_path, loss_type="cispo", importance_sampling_level="sequence")
    make_trainer(policy_dir, "entropy_bonus", {}, tmp_path, loss_type="vespo")
    assert loaded == [1] * 4  # drops, zeroes and TRL's entropy term compose with TRL's own loss: every type and level
    with pytest.raises(ValueError, match="unknown method"):
        make_trainer(policy_dir, "clip_z", {}, tmp_path)


# ----------------------------------------------------------------------------- erft train --engine trl


def trl_config(policy_dir: Path, method: str, **extra):
    sets = micro_overrides(policy_dir, **{"eval.every": 0, "train.tensorboard": "false", "train.max_steps": 2,
                                          "train.checkpoint_every": 1, **extra})
    return load_config(None, sets, extra={"engine": "trl", "method": {"name": method, "params": ACTING[method]}})


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", sorted(ACTING))
def test_erft_train_engine_trl_every_method(policy_dir, tmp_path, method):
    out = tmp_path / "run"
    launch.start(trl_config(policy_dir, method), out)
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["loss/total"] is not None and abs(r["loss/total"]) < 1e3
        assert 0.0 < r["entropy/mean"] < 4.0  # below log(vocab): a real entropy, not a placeholder
        assert r["dynamics/s_centered_std"] > 0
        assert 0.0 <= r["control/kept_frac"] <= 1.0
    if method in ("clip_b_paper", "clip_v_paper", "high_entropy"):
        assert all(r["control/kept_frac"] < 1.0 for r in rows)
    if method == "clip_cov":
        assert all(r["control/zeroed_frac"] > 0 for r in rows)
    if method == "none":
        assert all(r["control/kept_frac"] == 1.0 and r["control/zeroed_frac"] == 0.0 for r in rows)
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert (out / "final" / "config.json").is_file()


def test_engine_trl_refuses_overwrite_and_resumes(policy_dir, tmp_path):
    out = tmp_path / "run"
    launch.start(trl_config(policy_dir, "clip_v"), out)
    with pytest.raises(UserError, match="already exists"):
        launch.start(trl_config(policy_dir, "clip_v"), out)
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text() + '{"step": 9, "torn')
    launch.resume(out, max_steps=3, given={"task.name": "micro:DigitTask"})  # the recorded import path, again
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert json.loads((out / "run.json").read_text())["step"] == 3


def test_engine_trl_applies_chat_template_and_scores_text(policy_dir, tmp_path):
    """Chat prompts reach TRL as conversations (TRL templates them) and the verifier gets the text."""
    from transformers import AutoTokenizer

    from micro import CHAT_TEMPLATE

    chat_dir = tmp_path / "chat_policy"
    shutil.copytree(policy_dir, chat_dir)
    tok = AutoTokenizer.from_pretrained(chat_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(chat_dir)
    out = tmp_path / "run"
    launch.start(trl_config(chat_dir, "none", **{"task.name": "micro:ChatDigitTask"}), out)
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/mean"] is not None for r in rows)


def test_prompt_dataset_uses_conversations_only_with_a_chat_template(policy_dir):
    from transformers import AutoTokenizer

    from micro import CHAT_TEMPLATE, ChatDigitTask, DigitTask

    tok = AutoTokenizer.from_pretrained(policy_dir)
    chat_train, _ = ChatDigitTask().split(0)
    plain_train, _ = DigitTask().split(0)
    assert trl_task.prompt_dataset(chat_train, tok)[0]["prompt"] == str(chat_train[0].prompt)  # no template
    tok.chat_template = CHAT_TEMPLATE
    ds = trl_task.prompt_dataset(chat_train, tok)
    assert ds[3]["prompt"] == [{"role": "user", "content": str(chat_train[3].prompt)}]
    assert ds[3]["erft_index"] == 3
    assert trl_task.prompt_dataset(plain_train, tok)[0]["prompt"] == plain_train[0].prompt


@pytest.mark.parametrize("on", [False, True])
def test_grpo_config_follows_erfts_gradient_checkpointing(tmp_path, on):
    """GRPOConfig turns gradient checkpointing on by default; the erft config decides, as on the native engine
    (TRL's peak memory and step time are otherwise not comparable with ours)."""
    from entropy_rft.config.loading import load_config
    from entropy_rft.integrations.trl import grpo_config

    cfg = load_config(None, [f"model.gradient_checkpointing={str(on).lower()}", "engine=trl"])
    assert grpo_config(cfg, tmp_path, 1).gradient_checkpointing is on


def test_engine_trl_logs_on_the_erft_step_axis_with_native_names(policy_dir, tmp_path):
    """metrics.jsonl and <out>/tb hold one row per erft step (here 2 optimizer steps each), with the native key
    names; TRL's own TensorBoard stays off (trl.report_to is empty); samples.jsonl has every completion of a due
    step with its prompt, gold answer and reward."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from micro import DigitTask

    out = tmp_path / "run"
    launch.start(trl_config(policy_dir, "clip_v", **{"train.tensorboard": "true", "train.samples_every": 1}), out)
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    numeric = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    assert tags == numeric and {"entropy/mean", "reward/mean", "control/kept_frac", "loss/total"} <= tags
    for tag in ("entropy/mean", "reward/mean", "optim/lr"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([r[tag] for r in rows], rel=1e-6)
    assert not (out / "trl" / "runs").exists()  # one TensorBoard layout

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    per_step = 4 * 4  # micro_overrides: prompts_per_step × group_size
    assert [s["step"] for s in samples] == [1] * per_step + [2] * per_step
    task, train = DigitTask(), DigitTask().split(0)[0]
    by_prompt = {ex.prompt: ex for ex in train}
    for s in samples:
        assert set(s) == {"step", "prompt", "response", "reward", "answer"}
        ex = by_prompt[s["prompt"]]
        assert s["answer"] == ex.answer and s["reward"] == task.reward(s["response"], ex)
    for step, row in zip((1, 2), rows):  # the samples are the step's batch: their mean is its reward/mean
        mean = sum(s["reward"] for s in samples if s["step"] == step) / per_step
        assert mean == pytest.approx(row["reward/mean"])


def test_zero3_path_hands_trl_the_folder_and_trains_the_same(policy_dir, tmp_path, monkeypatch):
    """Under DeepSpeed ZeRO-3 erft does not load the model itself: GRPOTrainer gets the policy's folder and loads
    it (transformers partitions it under zero.Init, so no rank holds a full copy), with model.dtype in
    model_init_kwargs. DeepSpeed is not installed here, so the ZeRO-3 switch is forced; the run must equal the
    default path's, which loads the model in erft."""
    from entropy_rft.integrations import trl as erft_trl
    from entropy_rft.integrations import trl_train

    seen: list = []
    real_init = erft_trl.EntropyControlGRPOTrainer.__init__

    def spy(self, *a, **kw):
        seen.append((kw["model"], dict(kw["args"].model_init_kwargs or {})))
        real_init(self, *a, **kw)

    monkeypatch.setattr(erft_trl.EntropyControlGRPOTrainer, "__init__", spy)
    launch.start(trl_config(policy_dir, "clip_v"), tmp_path / "loaded")
    monkeypatch.setattr(trl_train, "zero3_enabled", lambda: True)
    launch.start(trl_config(policy_dir, "clip_v"), tmp_path / "zero3")
    (loaded_model, loaded_kw), (zero3_model, zero3_kw) = seen
    assert not isinstance(loaded_model, str) and "dtype" not in loaded_kw
    assert zero3_model == str(policy_dir) and zero3_kw["dtype"] == "float32"

    def stable(out):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in read_rows(out)]

    assert stable(tmp_path / "zero3") == stable(tmp_path / "loaded")


@pytest.mark.parametrize("cfg", [{}, {"epsilon": 0.3}, {"epsilon": 0.1, "epsilon_high": 0.4},
                                 {"beta": 0.04, "use_bias_correction_kl": True, "loss_type": "grpo"},
                                 {"beta": 0.02, "loss_type": "dr_grpo"}],
                         ids=["defaults", "epsilon", "both-sides", "beta-corrected-grpo", "beta-dr_grpo"])
def test_the_plans_loss_base_is_what_trl_set_up(policy_dir, tmp_path, cfg):
    """``trl_plan`` reads TRL's loss settings off the config before TRL runs (``config_loss_settings``); after
    GRPOTrainer's own ``__init__`` they are the attributes TRL's loss reads (the peer's values, not ours)."""
    from entropy_rft.integrations.trl_support import AGG_FOR_LOSS_TYPE

    for method, params in (("none", {}), ("kl_cov", {"ratio": 0.2})):  # TRL's loss, and erft's
        trainer = make_trainer(policy_dir, method, params, tmp_path, **cfg)
        base = trainer.plan.loss_base
        assert trainer.plan.delegated == (method == "none") and trainer.args is trainer.plan.args
        assert (base.eps_low, base.eps_high) == (trainer.epsilon_low, trainer.epsilon_high), cfg
        assert base.ref_kl_coef == trainer.beta and base.agg == AGG_FOR_LOSS_TYPE[trainer.loss_type]
        assert base.ref_kl_ratio_weighted == bool(trainer.beta and trainer.args.use_bias_correction_kl)


def test_a_plan_without_args_gives_trl_its_own_default_config(tmp_path):
    """No ``args``: the config TRL receives is the one TRL would build (``GRPOConfig("<model>-GRPO")``; on this CPU
    its bf16 default refuses, as stock GRPOTrainer's does, with TRL's own words); a composing method's clip goes into
    a copy of the caller's config, which is never changed in place."""
    from trl import GRPOConfig

    from entropy_rft.integrations.trl_support import trl_plan

    with pytest.raises(ValueError) as stock:
        GRPOConfig("tiny-model-GRPO")
    with pytest.raises(ValueError) as ours:
        trl_plan(control.build_method("none"), None, "org/tiny-model")
    assert str(ours.value) == str(stock.value)
    args = GRPOConfig(str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[])
    plan = trl_plan(control.build_method("none"), args, "org/tiny-model")
    assert plan.delegated and not plan.config_fields and plan.args is args
    higher = trl_plan(control.build_method("clip_higher"), args, "org/tiny-model")
    assert dict(higher.config_fields) == {"epsilon": 0.2, "epsilon_high": 0.28} and higher.args.epsilon_high == 0.28
    assert args.epsilon_high is None and higher.args is not args and higher.loss_base.eps_high == 0.28
    ours_loss = trl_plan(control.build_method("clip_higher"), args, "org/tiny-model", agg="token-mean")
    assert not ours_loss.delegated and ours_loss.args is args and ours_loss.loss_base.eps_high == 0.2
    assert ours_loss.loss_settings(control.build_method("clip_higher")).eps_high == 0.28  # the method's, per call


@pytest.mark.parametrize("method, params", [("kl_cov", {"ratio": 0.2}), ("none", {})])
def test_the_loss_metrics_are_read_once_when_trl_logs(policy_dir, tmp_path, method, params, monkeypatch):
    """Our metrics of TRL's loss calls (erft's loss, or TRL's own with ``none``) stay on the device until TRL's
    ``log`` reads its buffer: then every call's are read in one transfer, and TRL's log and our step row get the
    values each call's tensors give read one by one (issue 66's reference), averaged as TRL averages."""
    from entropy_rft.integrations import trl as trl_mod
    from host_reads import Reads, per_tensor_metrics

    trainer = make_trainer(policy_dir, method, params, tmp_path)
    trainer.model.train()
    outs, policy = [], trl_mod.compute_policy_loss
    monkeypatch.setattr(trl_mod, "compute_policy_loss", lambda *a, **k: outs.append(policy(*a, **k)) or outs[-1])
    reads = Reads(monkeypatch)
    for seed in (5, 6):
        inputs = delegated_inputs(trainer, seed=seed)
        reads.on = True
        trainer._compute_loss(trainer.model, inputs).backward()
        reads.on = False
    assert reads.made_in("loss_types.py") == [] and len(trainer._loss_rows) == 2  # nothing read during a loss
    reads.on = True
    trainer.log({})
    reads.on = False
    assert reads.made_in("loss_types.py") == ["tolist"] and trainer._loss_rows == []
    want = [per_tensor_metrics(o) for o in outs]
    logged, row = trainer.state.log_history[-1], trainer.step_metrics.pop()
    for key in ("loss/total", "ratio/mean", "ratio/max", "clip/ratio_frac") if method != "none" else ("ratio/mean",):
        assert logged[key] == pytest.approx(sum(w[key] for w in want) / 2, rel=0, abs=0), key
        assert row[key] == logged[key], key
