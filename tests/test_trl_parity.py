"""Method ``none`` through EntropyControlGRPOTrainer trains as stock ``trl.GRPOTrainer``.

Both trainers run the same GRPOConfig from the same weights and seed for three optimizer steps, on prompts of
different lengths (so TRL left-pads them), with a reward that varies. The reference is TRL itself. Compared:
the parameters after the last step, and every logged loss, grad_norm and TRL metric (``entropy``, ``kl``,
``clip_ratio/*``) at every step. Under bf16 autocast (GRPOConfig's default ``bf16=True``; ``use_cpu=True``
autocasts bf16 on CPU) and in fp32, with ``beta`` 0 and 0.04 (TRL's default ``use_bias_correction_kl=True``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from entropy_rft.models.loading import load_policy  # noqa: E402
from micro import make_micro_policy  # noqa: E402

# Prompts of 4 to 8 characters: TRL left-pads them in every batch.
PROMPTS = ["12>7:", "9>42:", "345>7:", "1>7:", "2715>42:", "88>7:", "6>42:", "5123>7:"]
LOGGED = ("loss", "grad_norm", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
          "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")


def digit_reward(completions, prompts, **_kw):
    """1 when the completion starts with the prompt's first digit, 0.1 when it holds a digit, else 0."""
    return [1.0 if c[:1] == p[:1] else 0.1 if any(ch.isdigit() for ch in c) else 0.0
            for c, p in zip(completions, prompts)]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("parity") / "policy")


class Logs:
    """Every ``on_log`` row of a run."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def callback(self):
        from transformers import TrainerCallback

        rows = self.rows

        class Keep(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "train_runtime" not in logs:
                    rows.append(dict(logs))

        return Keep()


def run(trainer_cls, policy_dir: Path, out: Path, steps: int = 3, trainer_kw: dict | None = None,
        **cfg) -> tuple[dict, list[dict]]:
    from datasets import Dataset
    from trl import GRPOConfig

    model, tok = load_policy(str(policy_dir))
    kw = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=8, num_generations=4,
              max_completion_length=6, max_steps=steps, learning_rate=1e-2, logging_steps=1, report_to=[],
              save_strategy="no", disable_tqdm=True, seed=0, gradient_checkpointing=False)
    kw.update(cfg)
    logs = Logs()
    trainer = trainer_cls(model=model, reward_funcs=digit_reward, args=GRPOConfig(**kw),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tok,
                          callbacks=[logs.callback()], **(trainer_kw or {}))
    trainer.train()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, logs.rows


def assert_same_run(ours, stock) -> None:
    (p_ours, log_ours), (p_stock, log_stock) = ours, stock
    assert len(log_ours) == len(log_stock) == 3
    for step, (a, b) in enumerate(zip(log_ours, log_stock), 1):
        for k in LOGGED:
            assert (k in a) == (k in b), (step, k)
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (step, k, a[k], b[k])
    for name, w in p_stock.items():
        torch.testing.assert_close(p_ours[name], w, rtol=1e-5, atol=1e-6, msg=name)
    moved = max(float((w - w0).abs().max()) for w, w0 in zip(p_stock.values(), INITIAL.values()))
    assert moved > 1e-3  # the run trained: the equality is not that of two untouched models


INITIAL: dict = {}


@pytest.mark.parametrize("bf16,beta", [(True, 0.0), (True, 0.04), (False, 0.0), (False, 0.04)])
def test_method_none_trains_as_stock_grpo_trainer(policy_dir, tmp_path, bf16, beta):
    from trl import GRPOTrainer

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    model, _ = load_policy(str(policy_dir))
    INITIAL.clear()
    INITIAL.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    stock = run(GRPOTrainer, policy_dir, tmp_path / "stock", bf16=bf16, beta=beta)
    ours = run(EntropyControlGRPOTrainer, policy_dir, tmp_path / "ours", bf16=bf16, beta=beta)
    assert_same_run(ours, stock)
    if beta:
        assert all(r["kl"] > 0 for r in stock[1][1:])  # the KL term acted after the first update


def test_beta_with_every_other_grpo_config_default_trains(policy_dir, tmp_path):
    """``beta=0.04`` and TRL 1.16's defaults otherwise (bf16, gradient checkpointing, use_bias_correction_kl,
    8 generations, 512 completion tokens): before, the plug-in refused use_bias_correction_kl."""
    from datasets import Dataset
    from trl import GRPOConfig

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    model, tok = load_policy(str(policy_dir))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=0.04, max_steps=1, report_to=[],
                      save_strategy="no", disable_tqdm=True)
    assert args.use_bias_correction_kl and args.bf16 and args.gradient_checkpointing  # TRL's defaults
    logs = Logs()
    trainer = EntropyControlGRPOTrainer(model=model, reward_funcs=digit_reward, args=args,
                                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                                        callbacks=[logs.callback()])
    trainer.train()
    assert trainer.loss_kwargs["ref_kl_ratio_weighted"] is True
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def spy_policy_stats(policy_dir: Path, monkeypatch) -> list:
    """Reset the initial weights ``assert_same_run`` checks against; return the list that gets one entry per
    forward of the plug-in's own (``_policy_stats``)."""
    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    model, _ = load_policy(str(policy_dir))
    INITIAL.clear()
    INITIAL.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    calls: list = []
    real = EntropyControlGRPOTrainer._policy_stats
    monkeypatch.setattr(EntropyControlGRPOTrainer, "_policy_stats", lambda self, *a, **k: calls.append(1) or
                        real(self, *a, **k))
    return calls


def test_without_dynamics_metrics_method_none_does_only_stocks_work(policy_dir, tmp_path, monkeypatch):
    """``dynamics_metrics=False`` with a static method: no statistics pass at all (stock GRPOTrainer's work
    only), the same training as stock, and no ``dynamics/*`` keys; a selecting method refuses it."""
    from trl import GRPOTrainer

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    calls = spy_policy_stats(policy_dir, monkeypatch)
    stock = run(GRPOTrainer, policy_dir, tmp_path / "stock")
    ours = run(EntropyControlGRPOTrainer, policy_dir, tmp_path / "ours", trainer_kw={"dynamics_metrics": False})
    assert_same_run(ours, stock)
    assert calls == [] and not any(k.startswith("dynamics/") for r in ours[1] for k in r)
    with pytest.raises(ValueError, match=r"dynamics_metrics=False: method 'clip_v' selects tokens"):
        run(EntropyControlGRPOTrainer, policy_dir, tmp_path / "x", trainer_kw={"dynamics_metrics": False,
                                                                              "method": "clip_v"})


@pytest.mark.parametrize("cfg", [{}, {"steps_per_generation": 2, "gradient_accumulation_steps": 2,
                                      "per_device_train_batch_size": 4}], ids=["one-micro-batch", "two-joined"])
def test_on_policy_none_takes_its_statistics_from_trls_training_forward(policy_dir, tmp_path, monkeypatch, cfg):
    """On-policy (TRL runs no old-policy forward) with a static method, the plug-in runs no forward of its own
    (``_policy_stats`` never runs): the statistics come from the hidden states of TRL's training forward, one
    head pass per micro-batch, joined over the generation batch's micro-batches. The training is stock's, and
    ``entropy/mean`` is the entropy TRL computes in that same forward."""
    from trl import GRPOTrainer

    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    calls = spy_policy_stats(policy_dir, monkeypatch)
    stock = run(GRPOTrainer, policy_dir, tmp_path / "stock", bf16=False, **cfg)
    ours = run(EntropyControlGRPOTrainer, policy_dir, tmp_path / "ours", bf16=False, **cfg)
    assert_same_run(ours, stock)
    assert calls == []
    for row in ours[1]:
        assert "dynamics/s_centered_mean" in row and "entropy/mean" in row, row
        if not cfg:  # one micro-batch per generation batch: the same tokens as TRL's logged mean
            assert row["entropy/mean"] == pytest.approx(row["entropy"], rel=1e-5), row
