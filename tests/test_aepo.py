"""Issue 39: AEPO (arXiv 2510.08141). The step's batch after the swap against a transcription of the authors'
released trainer (597358816/AEPO, ``verl/trainer/ray_trainer.py``: the temperature switch, the second rollout
of the first quarter of the prompts, ``_select_by_advantage``, the sample count and ``DataProto.concat``), row by
row and token by token; and a run of ``erft train --method aepo`` read back from its metrics, stopped and
resumed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from entropy_rft import control
from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import load_config
from entropy_rft.control.aepo import AEPOMethod, aepo_sample_num, aepo_splice, aepo_temperature
from entropy_rft.launch.run import start, start_or_resume
from entropy_rft.policy.rollout import RolloutBatch
from entropy_rft.rundir.files import read_jsonl
from entropy_rft.tasks.base import Example
from entropy_rft.training import stages
from entropy_rft.training.records import Scored
from micro import make_micro_policy, micro_overrides

G = 4


def released_grpo(scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """EasyR1's GRPO outcome advantage per uid: (s − mean) / (std + eps), unbiased std, groups of G rows."""
    g = scores.view(-1, G)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).flatten()


def released_step(batch_scores, extra_scores, entropy, base, cap, t_high=1.2, t_low=0.8):
    """The released AEPO branch, transcribed (lines 784-810): the temperature from the last entropy
    (``entropy <= entropy_base``: T_high), the extra batch's GRPO advantages, the rows with advantage > 0.05
    (``_select_by_advantage``, absolute=False), their advantages set to 1, ``sample_num`` = min(cap, kept) or its
    half, and ``concat([kept[:n], batch[n:]])``. Returns (temperature, [(source, row, advantage)])."""
    temperature = t_high if entropy <= base else t_low
    adv = released_grpo(batch_scores)
    extra_adv = released_grpo(extra_scores)
    kept = [i for i in range(len(extra_scores)) if extra_adv[i] > 0.05]
    n = min(cap, len(kept)) if entropy <= base else min(cap, len(kept)) // 2
    rows = [("extra", i, 1.0) for i in kept[:n]] + [("batch", i, float(adv[i])) for i in range(n, len(batch_scores))]
    return temperature, rows


def fake_run(method, monkeypatch, extra_rewards):
    """A run whose second rollout returns responses 'x<i>' (variable length) with ``extra_rewards``, recording the
    temperature it was asked for."""
    asked = {}

    def rollout(run, prompts, temperature=None):
        asked["temperature"], asked["prompts"] = temperature, list(prompts)
        b, r = len(prompts), 5
        mask = torch.tensor([[j < 2 + i % 3 for j in range(r)] for i in range(b)])
        return RolloutBatch(torch.ones(b, 3, dtype=torch.long), torch.ones(b, 3, dtype=torch.bool),
                            torch.full((b, r), 7), mask, [f"x{i}" for i in range(b)])

    def score(run, group, rb):
        return Scored(group, rb, torch.tensor(extra_rewards[:len(group)], dtype=torch.float32), rb.response_mask)

    monkeypatch.setattr(stages, "rollout", rollout)
    monkeypatch.setattr(stages, "score", score)
    cfg = SimpleNamespace(algo=SimpleNamespace(algorithm="grpo", adv_eps=1e-6), rollout=SimpleNamespace(group_size=G))
    return SimpleNamespace(method=method, cfg=cfg, tok=SimpleNamespace(pad_token_id=0, eos_token_id=1)), asked


def batch_of(rewards: list[float]) -> Scored:
    b = len(rewards)
    group = [Example(f"p{i // G}", "a") for i in range(b)]
    rb = RolloutBatch(torch.ones(b, 2, dtype=torch.long), torch.ones(b, 2, dtype=torch.bool),
                      torch.full((b, 3), 5), torch.ones(b, 3, dtype=torch.bool), [f"b{i}" for i in range(b)])
    return Scored(group, rb, torch.tensor(rewards), rb.response_mask.clone())


@pytest.mark.parametrize("entropy, cap", [(0.0, 60), (0.3, 2), (0.7, 60), (0.7, 3)])
def test_the_swapped_batch_is_the_released_one(entropy, cap, monkeypatch):
    """16 prompts of 4; the first quarter (4 prompts, 16 rollouts) rolled out again with rewards that give 6
    rollouts above 0.05 (one group all correct: advantage 0, not kept). At or below the target all of them (or the
    cap) replace the batch's first rows with advantage 1; above it half; the other rows keep the batch's own GRPO
    advantages, including the rows of groups that lost members to the swap."""
    batch_rewards = [float((i * 7) % 3 == 0) for i in range(64)]
    extra_rewards = [1., 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0]
    m = control.build_method("aepo", target=0.5, reinforce_sample_num=cap)
    m._last_h = entropy
    run, asked = fake_run(m, monkeypatch, extra_rewards)
    s = batch_of(batch_rewards)
    out = stages.resample(run, s)
    temperature, rows = released_step(torch.tensor(batch_rewards), torch.tensor(extra_rewards), entropy, 0.5, cap)
    assert asked["temperature"] == temperature and asked["prompts"] == [ex.prompt for ex in s.group[:16]]
    assert len(out.group) == 64 and out.rewards.shape == (64,)
    extra_resp = [f"x{i}" for i in range(16)]
    want_resp = [extra_resp[i] if src == "extra" else f"b{i}" for src, i, _ in rows]
    assert out.rollout.responses == want_resp
    torch.testing.assert_close(out.seq_advantages, torch.tensor([a for _, _, a in rows]), rtol=1e-6, atol=1e-6)
    want_rewards = [extra_rewards[i] if src == "extra" else batch_rewards[i] for src, i, _ in rows]
    assert out.rewards.tolist() == want_rewards
    # token by token: each row's response mask is its own rollout's, right-padded to the wider batch
    for k, (src, i, _) in enumerate(rows):
        width = 2 + i % 3 if src == "extra" else 3
        own = torch.tensor([j < width for j in range(5)])
        assert torch.equal(out.rollout.response_mask[k], own) and torch.equal(out.mask[k], own)
    assert out.rollout.prompt_ids.shape == (64, 3) and not out.rollout.prompt_mask[len(rows) - 1, 0]
    n = sum(src == "extra" for src, _, _ in rows)
    metrics = m.observe(SimpleNamespace(entropy=torch.full((64, 5), 0.4)), out.mask, "token-mean")
    assert metrics["control/spliced_frac"] == n / 64


def test_nothing_kept_leaves_the_batch(monkeypatch):
    m = control.build_method("aepo")
    run, _ = fake_run(m, monkeypatch, [1.0] * 16)  # every group uniform: no advantage above 0.05
    s = batch_of([float(i % 2) for i in range(64)])
    assert stages.resample(run, s) is s


def test_pure_rules_by_hand():
    assert aepo_temperature(0.5, 0.5, 1.2, 0.8) == 1.2  # at the target: hot (<=)
    assert aepo_temperature(0.51, 0.5, 1.2, 0.8) == 0.8
    assert aepo_sample_num(0.4, 0.5, 7, 60) == 7 and aepo_sample_num(0.6, 0.5, 7, 60) == 3
    assert aepo_sample_num(0.4, 0.5, 70, 60) == 60 and aepo_sample_num(0.6, 0.5, 70, 60) == 30
    assert aepo_splice(torch.tensor([0.05, 0.06, -1.0, 2.0]), 0.05).tolist() == [1, 3]


def released_entropy_loss(micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Transcribed from the released AEPO (597358816/AEPO @ b353a05): ``dp_actor.py`` line 322,
    ``entropy_loss = -VF.masked_mean(log_probs, response_mask)`` appended per micro-batch to
    ``metrics["actor/entropy_loss"]``, reduced by the mean, and read by ``ray_trainer.py`` lines 844-845 as the
    next step's entropy. ``masked_mean`` is verl's: ``(values * mask).sum() / (mask.sum() + 1e-8)``."""
    values = []
    for log_probs, response_mask in micro:
        m = response_mask.float()
        values.append(float(-((log_probs * m).sum() / (m.sum() + 1e-8))))
    return sum(values) / len(values)


def test_the_switch_reads_the_released_sampled_entropy():
    """Issue 50's minimal case: target 0.5, true entropy 0.4, sampled tokens at log p -0.7. The released trainer
    reads 0.7 (above the target: T 0.8, half the swaps); the true entropy reads 0.4 (T 1.2, all of them)."""
    g = torch.Generator().manual_seed(0)
    micro = [(torch.full((4, 6), -0.7), torch.rand(4, 6, generator=g) > 0.3) for _ in range(3)]
    stats = SimpleNamespace(entropy=torch.full((12, 6), 0.4))
    mask = torch.ones(12, 6, dtype=torch.bool)
    for source, want_t, want_n in (("sampled", 0.8, 3), ("true", 1.2, 7)):
        m = control.build_method("aepo", target=0.5, entropy=source) if source == "true" else \
            control.build_method("aepo", target=0.5)  # the default is the released reading
        m.observe(stats, mask, "token-mean")
        for logp, mk in micro:
            m.observe_update(logp, mk)
        assert m.resample_plan().temperature == want_t
        assert aepo_sample_num(m._last_h, 0.5, 7, 60) == want_n
    # any log-probs: the reading is the released mean over micro-batches, not the token mean over the update
    m = control.build_method("aepo")
    micro = [(torch.randn(2 + i, 5, generator=g) - 1, torch.rand(2 + i, 5, generator=g) > 0.5) for i in range(4)]
    for logp, mk in micro:
        m.observe_update(logp, mk)
    m.resample_plan()
    assert m._last_h == pytest.approx(released_entropy_loss(micro), rel=1e-6)
    with pytest.raises(ValueError, match="entropy must be sampled or true, got 'mean'"):
        control.build_method("aepo", entropy="mean")


def test_the_trainer_hands_every_update_micro_batch_to_the_switch(micro_model, tmp_path, monkeypatch):
    """Two micro-batches a minibatch and two minibatches: each step's four readings reach the next step's switch,
    which logs the released mean of them as its entropy."""
    seen: list[list[float]] = []
    original = AEPOMethod.observe_update

    def spy(self, logp, mask):
        if not seen or len(seen[-1]) == 4:
            seen.append([])
        seen[-1].append(released_entropy_loss([(logp, mask)]))
        original(self, logp, mask)

    monkeypatch.setattr(AEPOMethod, "observe_update", spy)
    sets = {"eval.every": 0, "train.max_steps": 3, "probe.counterfactual_every": 0, "probe.jvp_every": 0,
            "algo.grad_accum": 2, "algo.minibatches": 2, "method.name": "aepo", "method.params": "{target: 9.0}"}
    start(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / "run")
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["step"] >= 1]
    assert [len(x) for x in seen] == [4, 4, 4]
    assert rows[0]["control/own_entropy"] == 0.0  # released: no update yet
    for k in (1, 2):
        assert rows[k]["control/own_entropy"] == pytest.approx(sum(seen[k - 1]) / 4, rel=1e-6)


def test_validation_names_the_bad_parameter():
    for bad, match in (({"target": None}, "target must be a number"), ({"temperature_low": 0.0}, "temperature_low"),
                       ({"prompt_frac": 0.0}, "prompt_frac"), ({"reinforce_sample_num": 1.5}, "reinforce_sample_num")):
        with pytest.raises(ValueError, match=match):
            control.build_method("aepo", **bad)
    info = control.method_info("aepo")
    assert info["engines"] == ["native"] and info["algorithms"] == ["grpo", "dr_grpo"] and "2510.08141" in info["paper"]


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    return make_micro_policy(tmp_path_factory.mktemp("aepo") / "model")


def test_ppo_is_refused_before_anything_is_written(micro_model, tmp_path):
    with pytest.raises(UserError, match="'algo.algorithm': method 'aepo' needs 'grpo' or 'dr_grpo'"):
        start(load_config(None, micro_overrides(micro_model, **{"method.name": "aepo", "algo.algorithm": "ppo"})),
              tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_erft_train_aepo_swaps_rollouts_logs_its_temperature_and_resumes(micro_model, tmp_path):
    """A target far above the policy's entropy: every step samples hot (1.2) and swaps in what it keeps; a run
    stopped after 2 of 4 steps and resumed continues as the whole run did."""
    sets = {"eval.every": 0, "train.max_steps": 4, "train.checkpoint_every": 2, "probe.counterfactual_every": 0,
            "probe.jvp_every": 0, "method.name": "aepo", "method.params": "{target: 9.0, prompt_frac: 1.0}"}
    start(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / "full")
    train = [r for r in read_jsonl(tmp_path / "full" / "metrics.jsonl") if r["step"] >= 1]
    assert [r["control/own_output"] for r in train] == [1.2] * 4
    assert all(r["control/own_target"] == 9.0 and math.isfinite(r["control/own_entropy"]) for r in train)
    assert all(0 <= r["control/spliced_frac"] <= 1 for r in train) and any(r["control/spliced_frac"] > 0 for r in train)
    start(load_config(None, micro_overrides(micro_model, **{**sets, "train.max_steps": 2})), tmp_path / "part")
    start_or_resume(load_config(None, micro_overrides(micro_model, **sets)), tmp_path / "part")
    resumed = [r for r in read_jsonl(tmp_path / "part" / "metrics.jsonl") if r["step"] >= 1]
    keys = ("control/own_output", "control/spliced_frac", "entropy/mean", "loss/total")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in train]
