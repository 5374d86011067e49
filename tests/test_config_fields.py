"""Config constraints live on the fields (issue 26 item 3): each field's range, choices or rule is declared next to
its help text, one loop checks them all, and a command builds its method once.

Expected messages are written by hand from the rule (they are the lines ``config.py``'s ``_check`` block printed),
not read from the metadata under test.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from entropy_rft.cli.main import main
from entropy_rft.common.constraints import range_rule
from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import load_config
from entropy_rft.config.schema import Config
from entropy_rft.control.paper_methods import ClipV
from micro import again, make_micro_policy, micro_overrides


def _error(*sets: str) -> str:
    with pytest.raises(UserError) as e:
        load_config(None, list(sets), check_method=False)
    return str(e.value)


@pytest.mark.parametrize("sets, line", [
    (["rollout.group_size=0"], "config field 'rollout.group_size' must be >= 1, got 0"),
    (["rollout.temperature=0"], "config field 'rollout.temperature' must be > 0, got 0.0"),
    (["rollout.top_p=1.5"], "config field 'rollout.top_p' must be in (0, 1], got 1.5"),
    (["algo.gamma=-0.1"], "config field 'algo.gamma' must be in [0, 1], got -0.1"),
    (["algo.dual_clip=1"], "config field 'algo.dual_clip' must be > 1 or null, got 1.0"),
    (["algo.eps_high=-0.5"], "config field 'algo.eps_high' must be in [0, 10] or null, got -0.5"),
    (["train.seed=99999999999"], "config field 'train.seed' must be in 0..4294967295, got 99999999999"),
    (["train.log_every=-1"], "config field 'train.log_every' must be >= 0 (0: no per-step lines), got -1"),
    (["train.threads=-1"],
     "config field 'train.threads' must be in 0..1024 (0: automatic, see train.threads), got -1"),
    (["autopilot.span=1"], "config field 'autopilot.span' must be > 1, got 1.0"),
    (["algo.ref_kl_estimator=k9"], "config field 'algo.ref_kl_estimator' must be k1, k2 or k3, got 'k9'"),
    (["algo.algorithm=foo"], "config field 'algo.algorithm' must be grpo, dr_grpo or ppo, got 'foo'"),
    (["engine=foo"], "config field 'engine' must be native or trl, got 'foo'"),
    (["model.device=cuda:x"], "config field 'model.device' must be 'cpu', 'cuda', 'cuda:N' or 'mps', got 'cuda:x'"),
    (["model.device='cpu '"], "config field 'model.device' must be 'cpu', 'cuda', 'cuda:N' or 'mps', got 'cpu '"),
    (["model.name=  "], "config field 'model.name' is empty; pass --model default, a folder or a hub id"),
    (["method.params={1: 2}"], "config field 'method.params' has invalid parameter name(s) [1]; use name: value pairs"),
    (["method.presets.none=3"],
     "config field 'method.presets.none' must be a mapping of parameters (e.g. {mu: 2.0}), got 3"),
    (["optim.betas=[0.9,1.5]"],
     "config field 'optim.betas' must be two numbers in [0, 1), e.g. [0.9, 0.999]; got [0.9, 1.5]"),
    (["optim.max_grad_norm=0"], "config field 'optim.max_grad_norm' must be > 0 or null, got 0.0"),
    (["eval.samples=0"], "config field 'eval.samples' must be >= 1, got 0"),
    (["eval.batch_size=0"], "config field 'eval.batch_size' must be >= 1, got 0"),
    # the rules between fields, after the loop
    (["rollout.group_size=1"], "config field 'rollout.group_size' must be >= 2 for grpo (group baseline)"),
    (["algo.minibatches=100000"],
     "config field 'algo.minibatches' (100000) must not exceed the rollout batch (128 sequences)"),
    (["eval.batch_size=1"], "config field 'eval.batch_size' must be >= eval.samples (8), got 1"),
    (["autopilot.knob_min=5", "autopilot.knob_max=1"],
     "config field 'autopilot.knob_min' (5.0) must be < autopilot.knob_max (1.0)"),
])
def test_one_line_per_violation(sets, line):
    assert _error(*sets) == line


def test_values_at_the_edges_pass_and_betas_become_floats():
    cfg = load_config(None, ["rollout.top_p=1", "algo.gamma=0", "algo.lam=1", "train.seed=4294967295",
                             "algo.eps_low=null", "optim.max_grad_norm=null", "autopilot.ema=1",
                             "optim.betas=[0, 0.5]"], check_method=False)
    assert cfg.optim.betas == [0.0, 0.5] and all(type(b) is float for b in cfg.optim.betas)


def test_range_words():
    assert range_rule({"ge": 1}, integer=True) == ">= 1"
    assert range_rule({"gt": 0, "le": 1}, integer=False) == "in (0, 1]"
    assert range_rule({"ge": 0, "lt": 1}, integer=False) == "in [0, 1)"
    assert range_rule({"ge": 0, "le": 9}, integer=True) == "in 0..9"
    assert range_rule({"lt": 3}, integer=False) == "< 3"
    assert range_rule({"choices": ("a",)}, integer=False) is None


def _numeric_fields(cls: type = Config, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, f"{prefix}{f.name}.")
        elif tp in (int, float, int | None, float | None):
            yield f"{prefix}{f.name}", f.metadata, tp


# Numbers with no range of their own (none now: eval.batch_size, also bounded by eval.samples, has its >= 1).
FREE: set[str] = set()


def test_every_number_declares_its_range_next_to_its_help():
    fields = list(_numeric_fields())
    assert len(fields) > 40
    missing = [n for n, meta, _ in fields if n not in FREE and not {"ge", "gt", "le", "lt"} & set(meta)]
    assert not missing, f"numeric config fields without a range: {missing}"
    assert all(meta.get("help") for _, meta, _ in fields)


@pytest.mark.parametrize("name, meta, tp", [f for f in _numeric_fields() if f[0] not in FREE],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_loop_checks_every_declared_range(name, meta, tp):
    """A value just outside each declared bound is refused naming that field (the loop reaches every field)."""
    bad = [meta["ge"] - 1] if "ge" in meta else [meta["gt"]] if "gt" in meta else []
    bad += [meta["le"] + 1] if "le" in meta else [meta["lt"]] if "lt" in meta else []
    assert bad
    for value in bad:
        assert _error(f"{name}={value}").startswith(f"config field '{name}' must be ")


# ----------------------------------------------------------------------------- a method is built once


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


def _count_builds(monkeypatch, cls) -> list[int]:
    built = [0]
    post_init = cls.__post_init__

    def counted(self):
        built[0] += 1
        post_init(self)

    monkeypatch.setattr(cls, "__post_init__", counted)
    return built


def test_erft_train_builds_the_method_once(micro_model, tmp_path, monkeypatch):
    """Validation, preflight (twice: the command, then launch) and the run used to build clip_v three times."""
    built = _count_builds(monkeypatch, ClipV)
    sets = micro_overrides(micro_model, **{"train.max_steps": 1, "eval.every": 0, "train.report_to": "[]",
                                           "method.entropy_target": "0.8x", "method.presets.clip_b": "{mu: 3.0}"})
    out = tmp_path / "run"
    argv = ["train", "--method", "clip_v", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    assert built[0] == 1
    assert (out / "metrics.jsonl").is_file()
    built[0] = 0
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "2"]) == 0
    assert built[0] == 1
