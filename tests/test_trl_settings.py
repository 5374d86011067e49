"""The TRL engine's settings (``entropy_rft.config.trl``): the ``trl:`` pass-through section checked against
TRL's own GRPOConfig dataclass and passed into it, and every erft setting that engine does not honour refused
(it would change training) or warned about (it only changes what is measured), one line each, by name."""

from __future__ import annotations

import dataclasses

import pytest
from trl import GRPOConfig

from entropy_rft.common.errors import UserError
from entropy_rft.config import trl as trl_settings
from entropy_rft.config.loading import load_config
from entropy_rft.training import preflight

# The native-only measurements off: a config the TRL engine honours completely.
CLEAN = {"eval.every": 0, "probe.enabled": False, "probe.records_every": 0, "probe.jvp_every": 0,
         "probe.counterfactual_every": 0}


def cfg_of(trl: dict | None = None, **sets):
    merged = {**CLEAN, **sets}
    return load_config(None, [f"{k}={v}" for k, v in merged.items()],
                       extra={"engine": "trl", **({"trl": trl} if trl is not None else {})})


def test_every_grpo_config_field_is_known_and_reserved_names_are_real_fields():
    names = trl_settings.grpo_fields()
    assert names == [f.name for f in dataclasses.fields(GRPOConfig)]
    for table in (trl_settings.RESERVED, trl_settings.REPLACED):  # a typo in a table would never match
        assert not sorted(set(table) - set(names))


def test_a_clean_config_and_a_good_section_pass():
    cfg = cfg_of({"use_vllm": False, "vllm_mode": "colocate", "report_to": ["tensorboard"], "log_completions": True})
    assert trl_settings.section_errors(cfg) == []
    assert trl_settings.unhonoured(cfg) == ([], [])
    assert trl_settings.check(cfg) == []


def test_unknown_key_is_refused_naming_it_and_the_closest_field():
    (line,) = trl_settings.section_errors(cfg_of({"use_vlm": True}))
    assert "'trl.use_vlm'" in line and "did you mean 'trl.use_vllm'?" in line and "\n" not in line
    (line,) = trl_settings.section_errors(cfg_of({"zzzqqq": 1}))
    assert "'trl.zzzqqq'" in line and "did you mean" not in line


@pytest.mark.parametrize("key,value,use", [
    ("learning_rate", 1e-6, "optim.lr"), ("num_generations", 16, "rollout.group_size"),
    ("max_completion_length", 512, "rollout.max_new_tokens"), ("seed", 3, "train.seed"),
    ("output_dir", "x", "--out"), ("beta", 0.1, "algo.ref_kl_coef"), ("loss_type", "grpo", "algo.agg"),
    ("gradient_checkpointing", True, "model.gradient_checkpointing"),
    ("top_entropy_quantile", 0.2, "method.name high_entropy"), ("delta", 2.0, "algo.dual_clip"),
    ("entropy_coef", 0.01, "method.name entropy_bonus"),
])
def test_keys_erft_sets_itself_are_refused_naming_the_erft_field(key, value, use):
    (line,) = trl_settings.section_errors(cfg_of({key: value}))
    assert line.startswith(f"config field 'trl.{key}' ") and line.endswith(f"; use {use} instead")


@pytest.mark.parametrize("key,value", [("importance_sampling_level", "sequence"),
                                       ("vllm_importance_sampling_correction", True),
                                       ("off_policy_mask_threshold", 0.5)])
def test_values_the_trainer_cannot_reproduce_are_refused(key, value):
    (line,) = trl_settings.section_errors(cfg_of({key: value}))
    assert f"'trl.{key}'" in line and "not supported" in line


def test_section_reaches_grpo_config(tmp_path):
    trl = {"vllm_mode": "server", "vllm_server_port": 8123, "num_completions_to_print": 3,
           "mask_truncated_completions": True, "log_completions": True, "report_to": ["tensorboard"]}
    args = trl_settings.grpo_config(cfg_of(trl), tmp_path, 1)
    assert (args.vllm_mode, args.vllm_server_port, args.num_completions_to_print) == ("server", 8123, 3)
    assert args.mask_truncated_completions is True and args.log_completions is True
    assert args.report_to == ["tensorboard"]
    assert args.vllm_importance_sampling_correction is False  # TRL's default, which the trainer refuses, is off
    base = trl_settings.grpo_config(cfg_of(), tmp_path, 1)
    assert base.report_to == [] and base.log_completions is False and base.vllm_mode == "colocate"
    with pytest.raises(UserError, match=r"trl\.learning_rate.*optim\.lr"):
        trl_settings.grpo_config(cfg_of({"learning_rate": 1.0}), tmp_path, 1)


@pytest.mark.parametrize("trl,wandb,want", [
    (None, False, []), (None, True, []), ({"report_to": "mlflow"}, True, ["mlflow"]),
    ({"report_to": ["wandb", "trackio"]}, True, ["wandb", "trackio"]), ({"report_to": "none"}, False, []),
])
def test_report_to_is_the_trl_section_only(trl, wandb, want):
    """train.wandb (and train.report_to) are erft's trackers, fed by erft's callback: not TRL's report_to."""
    cfg = cfg_of(trl, **{"train.wandb": str(wandb).lower()})
    assert trl_settings.report_to(cfg) == want


# (override, "error" or "warning", what the one line must name)
UNHONOURED = [
    ({"algo.algorithm": "ppo"}, "error", "algo.algorithm 'ppo'"),
    ({"algo.drop_uniform_groups": "true"}, "error", "algo.drop_uniform_groups"),
    ({"algo.adv_eps": 1e-3}, "error", "algo.adv_eps"),
    ({"eval.every": 10}, "warning", "eval.every 10"),
    ({"probe.enabled": "true"}, "warning", "probe.enabled=false"),
    ({"probe.records_every": 25}, "warning", "probe.records_every=0"),
    ({"probe.jvp_every": 10}, "warning", "probe.jvp_every=0"),
    ({"probe.counterfactual_every": 10}, "warning", "probe.counterfactual_every=0"),
    ({"rollout.backend": "kv"}, "warning", "rollout.backend"),
    ({"rollout.cuda_graphs": True}, "warning", "rollout.cuda_graphs"),
]


@pytest.mark.parametrize("sets,kind,name", UNHONOURED, ids=[next(iter(s)) for s, _, _ in UNHONOURED])
def test_unhonoured_settings_are_refused_or_warned_by_name(sets, kind, name):
    errors, warnings = trl_settings.unhonoured(cfg_of(**sets))
    assert len(errors) + len(warnings) == 1
    (line,) = errors if kind == "error" else warnings
    assert name in line and "\n" not in line


def test_entropy_target_is_refused():
    cfg = dataclasses.replace(cfg_of(), method=dataclasses.replace(cfg_of().method, entropy_target=0.4))
    errors, _ = trl_settings.unhonoured(cfg)
    assert len(errors) == 1 and "method.entropy_target" in errors[0]


def test_default_config_warns_about_each_native_only_measurement():
    cfg = load_config(None, [], extra={"engine": "trl"})
    errors, warnings = trl_settings.unhonoured(cfg)
    assert errors == []
    for name in ("eval.every", "probe.enabled", "probe.records_every", "probe.jvp_every", "probe.counterfactual_every"):
        assert sum(name in w for w in warnings) == 1, name


def test_loss_base_takes_the_clip_off_a_side_the_config_leaves_unclipped():
    cfg = cfg_of(**{"algo.eps_high": "null", "algo.ref_kl_estimator": "k1"})
    assert trl_settings.loss_base(cfg) == {"ref_kl_estimator": "k1", "eps_high": None}
    assert trl_settings.loss_base(cfg_of()) == {"ref_kl_estimator": "k3"}  # both sides clipped: TRL's epsilons


def test_check_is_one_line_and_lets_trl_validate_values():
    with pytest.raises(UserError) as e:
        trl_settings.check(cfg_of({"use_vlm": True, "seed": 1}))
    assert "\n" not in str(e.value) and "trl.use_vllm" in str(e.value) and "train.seed" in str(e.value)
    with pytest.raises(UserError, match=r"refused by trl\.GRPOConfig: .*log_completions"):
        trl_settings.check(cfg_of({"log_completions_hub_repo": "me/completions"}))
    with pytest.raises(UserError, match=r"algo\.minibatches\*algo\.grad_accum"):
        trl_settings.check(cfg_of(**{"algo.minibatches": 3}))


def test_preflight_runs_the_check_for_engine_trl_only(tmp_path, monkeypatch, capsys):
    called = []
    monkeypatch.setattr(preflight, "check_trl", lambda cfg: called.append(cfg) or [])
    native = load_config(None, ["engine=native", "trl.use_vllm=true"])
    preflight.check_train(native, tmp_path / "a")
    assert called == []
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "'trl'" in x]
    assert "config section 'trl' (use_vllm)" in line and "native engine ignores it" in line
    trl_cfg = cfg_of()
    preflight.check_train(trl_cfg, tmp_path / "b")
    assert called == [trl_cfg]
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"trl\.use_vllm"):
        preflight.check_train(cfg_of({"use_vlm": True}), tmp_path / "c")
    assert not any(tmp_path.iterdir())  # nothing written


def test_shipped_trl_configs_are_not_refused():
    from pathlib import Path

    paper = sorted((Path(__file__).resolve().parents[1] / "configs" / "paper").glob("*.yaml"))
    trl_configs = [cfg for cfg in map(load_config, paper) if cfg.engine == "trl"]
    assert len(trl_configs) >= 6
    for cfg in trl_configs:
        assert trl_settings.section_errors(cfg) == [] and trl_settings.unhonoured(cfg)[0] == []
