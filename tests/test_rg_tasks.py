"""``rg:<dataset>`` tasks (reasoning-gym), the model-aware built-in config and the settings warnings."""

from __future__ import annotations

from pathlib import Path

import pytest

from entropy_rft import tasks
from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import default_config_path, load_config, load_yaml
from entropy_rft.tasks.rg import ReasoningGymTask, extract_answer
from entropy_rft.training.preflight import build_task as preflight_build_task
from entropy_rft.training.preflight import settings_warnings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def products() -> ReasoningGymTask:
    return tasks.build_task("rg:products", params={"min_digits": 1, "max_digits": 1}, answer_format="number",
                            size=300, val_size=20)


# ----------------------------------------------------------------------------- answers


@pytest.mark.parametrize("fmt, response, expected", [
    ("tag", "so <answer> 42 </answer>", "42"),
    ("tag", "<answer>1</answer> then <answer>2</answer>", "2"),
    ("tag", "<answer>7", None),
    ("boxed", "the result is \\boxed{12}.", "12"),
    ("boxed", "no box", None),
    ("line", "work...\nAnswer: 15\nthanks", "15"),
    ("line", "answer:  3 x  4", "3 x 4"),
    ("number", "4 * 7 = 28. Anything else?", "28"),
    ("number", "It is 1,234 exactly", "1234"),
    ("number", "minus: -5", "-5"),
    ("number", "3.50 dollars", "3.50"),
    ("number", "no digits here", None),
    ("number", "", None),
])
def test_extract_answer_hand_cases(fmt, response, expected):
    assert extract_answer(response, fmt) == expected


def test_reward_uses_reasoning_gyms_verifier(products):
    train, val = products.split(0)
    ex = val[0]
    a, b = (int(x) for x in ex.meta["entry"]["question"].split(":")[1].split(".")[0].split("*"))
    assert ex.answer == str(a * b)  # the gold answer is the product the question asks for
    assert products.reward(f"The product is {a * b}.", ex) == 1.0
    assert products.reward(f"The product is {a * b + 1}.", ex) == 0.0
    assert products.reward("I do not know", ex) == 0.0
    assert products.reward("\x00" * 50, ex) == 0.0
    assert products.canonical(f"so {a * b}", ex) == str(a * b)
    assert products.canonical("nothing", ex) is None
    assert products.correct(f"{a * b}", ex)


def test_params_reach_the_generator(products):
    train, val = products.split(0)
    for ex in train + val:
        q = ex.meta["entry"]["question"]
        factors = q.split(":")[1].split(".")[0].split("*")
        assert all(0 <= int(f) <= 9 for f in factors), q  # one-digit factors, as task.params asked


def test_split_seeded_disjoint_and_validation_fixed(products):
    t0, v0 = products.split(0)
    t1, v1 = products.split(1)
    assert [e.prompt for e in v0] == [e.prompt for e in v1]  # validation does not move with the run seed
    assert sorted(e.prompt for e in t0) == sorted(e.prompt for e in t1)
    assert [e.prompt for e in t0] != [e.prompt for e in t1]  # the run seed orders training problems
    assert not {str(e.prompt) for e in t0} & {str(e.prompt) for e in v0}
    assert len(v0) == 20
    again = tasks.build_task("rg:products", params={"min_digits": 1, "max_digits": 1}, answer_format="number",
                             size=300, val_size=20)
    assert [e.prompt for e in again.split(0)[0]] == [e.prompt for e in t0]


def test_prompt_is_a_short_chat_message(products):
    ex = products.split(0)[1][0]
    assert ex.prompt.messages == [{"role": "user", "content": str(ex.prompt)}]  # no system prompt
    tagged = tasks.build_task("rg:products", size=10, val_size=2)
    assert "<answer></answer>" in str(tagged.split(0)[1][0].prompt)


def test_partial_credit_is_optional():
    t = tasks.build_task("rg:products", size=20, val_size=2, answer_format="number")
    strict = tasks.build_task("rg:products", size=20, val_size=2, answer_format="number", partial_credit=True)
    ex = t.split(0)[1][0]
    wrong = str(int(ex.answer) + 1)
    assert t.reward(wrong, ex) == 0.0
    assert strict.reward(wrong, ex) == pytest.approx(strict.score(wrong, ex))
    assert strict.reward(ex.answer, ex) == 1.0


def test_unknown_dataset_lists_the_available_ones():
    with pytest.raises(ValueError, match="basic_arithmetic.*chain_sum"):
        tasks.build_task("rg:no_such_dataset")
    with pytest.raises(UserError) as e:
        preflight_build_task("rg:no_such_dataset")
    assert "\n" not in str(e.value) and "leg_counting" in str(e.value)


@pytest.mark.parametrize("params, field", [
    ({"answer_format": "xml"}, "answer_format"),
    ({"params": {"max_digitz": 1}}, "max_digitz"),
    ({"val_size": 10_000, "size": 5}, "val_size"),
    ({"template": "no placeholder"}, "template"),
])
def test_bad_params_are_one_line(params, field):
    with pytest.raises(UserError) as e:
        preflight_build_task("rg:products", params)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_gsm_symbolic_is_one_of_them():
    t = tasks.build_task("rg:gsm_symbolic", size=6, val_size=2, answer_format="number")
    ex = t.split(0)[1][0]
    assert t.reward(f"so the answer is {ex.answer}", ex) == 1.0


# ----------------------------------------------------------------------------- model-aware settings


def test_smollm2_gets_its_own_config_not_the_toys():
    toy = load_config(None, [], None)
    real = load_config(None, [], {"model": {"name": "smollm2-135m"}})
    via_set = load_config(None, ["model.name=smollm2-135m"], None)
    assert toy.model.name == "default" and toy.tuned_for == "default"
    assert real.tuned_for == via_set.tuned_for == "smollm2-135m"
    assert real.task.name.startswith("rg:")
    assert real.rollout.max_new_tokens > toy.rollout.max_new_tokens
    assert real.optim.lr < toy.optim.lr
    assert default_config_path("smollm2-135m").name == "smollm2-135m.yaml"
    assert default_config_path("some/hub-id").name == "default.yaml"


def test_shipped_configs_equal_the_built_in_ones():
    assert load_yaml(ROOT / "configs" / "smollm2_products.yaml") == load_yaml(default_config_path("smollm2-135m"))
    assert load_yaml(ROOT / "configs" / "default.yaml") == load_yaml(default_config_path())


def test_settings_warnings():
    toy = load_config(None, [], None)
    assert settings_warnings(toy, 16) == []
    other = load_config(None, ["model.name=/models/my-lm"], None)
    (line,) = settings_warnings(other, 16)
    assert "tuned for model 'default'" in line and "my-lm" in line
    clip_v = load_config(None, ["model.name=/models/my-lm"], {"method": {"name": "clip_v"}})
    assert "clip_v" in settings_warnings(clip_v, 16)[0]
    short = load_config(None, ["rollout.max_new_tokens=12"], {"model": {"name": "smollm2-135m"}})
    (line,) = settings_warnings(short, 64)
    assert "rollout.max_new_tokens 12" in line and "64" in line
    assert settings_warnings(short, 24) == []  # 12 >= 24 / 2
    unchecked = load_config(None, ["tuned_for="], {"model": {"name": "smollm2-135m"}})
    assert settings_warnings(unchecked, 64) == []


# ----------------------------------------------------------------------------- evaluation progress


def test_evaluation_reports_progress_per_batch(tmp_path):
    import torch

    from entropy_rft.models.loading import load_policy
    from entropy_rft.policy.evaluation import evaluate_policy
    from micro import DigitTask, make_micro_policy

    model, tok = load_policy(str(make_micro_policy(tmp_path / "m")))
    task = DigitTask()
    val = task.split(0)[1][:10]
    seen: list[tuple[int, int]] = []
    common = dict(n_samples=2, temperature=1.0, max_new_tokens=3)
    out = evaluate_policy(model, tok, task, val, generator=torch.Generator().manual_seed(0), batch_size=8,
                          on_progress=lambda done, total: seen.append((done, total)), **common)
    assert seen == [(0, 10), (4, 10), (8, 10), (10, 10)]  # 8 sequences = 4 prompts x 2 samples per batch
    quiet = evaluate_policy(model, tok, task, val, generator=torch.Generator().manual_seed(0), batch_size=8,
                            **common)
    assert {k: v for k, v in out.items() if k not in ("eval/seconds",)} == \
        {k: v for k, v in quiet.items() if k not in ("eval/seconds",)}


def test_erft_train_warns_once_when_a_model_inherits_another_models_settings(tmp_path, capsys):
    from entropy_rft.cli.main import main
    from micro import make_micro_policy, micro_overrides

    model = make_micro_policy(tmp_path / "m")
    sets = micro_overrides(model, **{"train.max_steps": 1, "eval.every": 0, "tuned_for": "default"})
    assert main(["train", "--out", str(tmp_path / "run")] + sum((["--set", s] for s in sets), [])) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "tuned for model 'default'" in x]
    assert len(lines) == 1 and str(model) in lines[0]
    quiet = micro_overrides(model, **{"train.max_steps": 1, "eval.every": 0})  # tuned_for empty
    assert main(["train", "--out", str(tmp_path / "run2")] + sum((["--set", s] for s in quiet), [])) == 0
    assert "tuned for" not in capsys.readouterr().err  # tuned_for empty: no check


def test_only_a_declared_response_budget_is_checked():
    from entropy_rft.tasks.countdown import CountdownTask
    from entropy_rft.training.preflight import declared_response_tokens
    from micro import DigitTask

    assert declared_response_tokens(DigitTask()) == 0  # inherits Task's hint only: no warning
    assert declared_response_tokens(CountdownTask()) == 16
    assert declared_response_tokens(tasks.build_task("rg:products", size=10, val_size=2,
                                                     max_response_tokens=80)) == 80


def test_another_task_does_not_inherit_the_config_files_task_params():
    real = {"model": {"name": "smollm2-135m"}}
    assert load_config(None, [], real).task.params["answer_format"] == "number"  # the file's own task
    assert load_config(None, [], {**real, "task": {"name": "champ"}}).task.params == {}
    assert load_config(None, ["task.name=champ"], real).task.params == {}
    kept = load_config(None, ["task.params={size: 5}"], {**real, "task": {"name": "gsm_symbolic"}})
    assert kept.task.params == {"size": 5}  # given on the command line: kept
    same = load_config(None, [], {**real, "task": {"name": "rg:products"}})
    assert same.task.params["val_size"] == 32  # the file's task named again: its params stay


def test_help_config_lists_the_params_of_the_command_lines_task(capsys):
    from entropy_rft.cli.main import main

    assert main(["train", "--model", "smollm2-135m", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "task.params of task 'rg:products'" in out and "answer_format" in out and "max_digits" in out
    assert main(["train", "--task", "countdown", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "task.params of task 'countdown'" in out and "max_target = 99" in out
