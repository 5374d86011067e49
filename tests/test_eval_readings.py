"""Issue 74's evaluation readings: per-question correct counts, the questions' ids, a second temperature and greedy
pass@1; neither of the two optional readings moves the main evaluation or training."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from entropy_rft.common.errors import UserError
from entropy_rft.config.loading import config_from_dict, load_config
from entropy_rft.launch.run import start
from entropy_rft.policy import evaluation
from entropy_rft.tasks.base import Example
from entropy_rft.tasks.prompts import encode_prompt
from entropy_rft.training.stages import extra_due
from micro import DigitTask, make_micro_policy, micro_overrides

VOLATILE = ("time/", "perf/")
EXTRA = "eval_t0.5/"  # eval.extra_temperature 0.5 below
GREEDY = ("eval/greedy_pass@1", "eval/greedy_correct_per_question")


@pytest.fixture(scope="module")
def micro_path(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


@pytest.fixture(scope="module")
def policy(micro_path):
    return AutoModelForCausalLM.from_pretrained(micro_path), AutoTokenizer.from_pretrained(micro_path)


class CountedTask(DigitTask):
    """A task whose correct count per question is known whatever is sampled: question i's first ``answer``
    scored samples are correct, the rest wrong."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    def reward(self, response: str, example: Example) -> float:
        self.seen[example.prompt] += 1
        return 1.0 if self.seen[example.prompt] <= int(example.answer) else 0.0


def test_correct_per_question_counts_each_question_in_order(policy):
    model, tok = policy
    targets = [0, 3, 1, 4, 2]  # out of K = 4
    examples = [Example(f"{i}{i}{i}>7:", str(t)) for i, t in enumerate(targets, 1)]
    # batch_size 8: two prompts of 4 samples a batch, so the five questions span three batches
    out = evaluation.evaluate_policy(model, tok, CountedTask(), examples, n_samples=4, temperature=1.0,
                                     max_new_tokens=3, generator=torch.Generator().manual_seed(0), batch_size=8)
    assert out["eval/correct_per_question"] == [0, 3, 1, 4, 2]
    assert out["eval/pass_rate_hist"] == [1, 1, 1, 1, 1]
    assert out["eval/avg@4"] == pytest.approx(10 / 20)
    assert all(type(c) is int for c in out["eval/correct_per_question"])  # JSON integers, not floats
    # the same as a plain table: fractional scores round as the histogram counts them
    s = evaluation.summarize([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0.6, 0, 0, 0]], [["a"] * 4] * 4)
    assert s["eval/correct_per_question"] == [2, 0, 4, 1]


def argmax_first_chars(model, tok, examples) -> list[str]:
    """By hand: the model's most likely first token after each prompt (one plain HF forward, no sampler), decoded."""
    out = []
    for ex in examples:
        ids = torch.tensor([encode_prompt(tok, ex.prompt)])
        with torch.no_grad():
            first = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(tok.decode([first], skip_special_tokens=True))
    return out


def test_greedy_is_the_argmax_answer_and_draws_nothing(policy):
    model, tok = policy
    task = DigitTask()  # rewards a response whose first character is the example's answer
    prompts = task.split(0)[1][:12]
    chars = argmax_first_chars(model, tok, prompts)
    # the even questions' answer is the argmax character, the odd ones' another: greedy gets 1, 0, 1, 0, ...
    examples = [Example(ex.prompt, c if i % 2 == 0 else ("x" if c != "x" else "y"))
                for i, (ex, c) in enumerate(zip(prompts, chars))]
    rng = torch.get_rng_state()
    got = evaluation.greedy_correct(model, tok, task, examples, max_new_tokens=4, batch_size=5)
    assert torch.equal(torch.get_rng_state(), rng)  # no draw from the global generator
    assert got == [1, 0] * 6
    assert evaluation.greedy_correct(model, tok, task, examples, max_new_tokens=4, batch_size=12) == got


def test_question_ids_name_each_prompt():
    val = DigitTask().split(0)[1]
    ids = evaluation.question_ids(val)
    assert ids[0] == hashlib.sha256(val[0].prompt.encode()).hexdigest()[:12]
    assert len(set(ids)) == len(val) and all(len(i) == 12 for i in ids)
    other = DigitTask().split(1)[1]  # another seed, another order: the same prompt has the same id
    by_prompt = dict(zip((ex.prompt for ex in other), evaluation.question_ids(other)))
    assert all(by_prompt[ex.prompt] == i for ex, i in zip(val, ids) if ex.prompt in by_prompt)


def test_the_extra_temperature_rule():
    def cfg(**e):
        return config_from_dict({"eval": e}, check_method=False).eval

    assert not extra_due(cfg(), 0)  # off by default
    every = cfg(extra_temperature=0.7)
    assert all(extra_due(every, s) for s in (0, 5, 100, 10_000))
    up_to = cfg(extra_temperature=0.7, extra_until_step=20)
    assert [s for s in (0, 3, 20, 21, 40) if extra_due(up_to, s)] == [0, 3, 20]
    only_base = cfg(extra_temperature=1.5, extra_until_step=0)
    assert [s for s in (0, 1, 3) if extra_due(only_base, s)] == [0]
    assert not extra_due(cfg(extra_until_step=5), 0)  # no temperature: off


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(micro_path: Path, out: Path, **sets) -> list[dict]:
    base = {"train.tensorboard": "false", "probe.records_every": 2, "train.max_steps": 4, "eval.every": 2}
    start(load_config(None, micro_overrides(micro_path, **{**base, **sets})), out)
    return _rows(out)


@pytest.fixture(scope="module")
def two_runs(micro_path, tmp_path_factory):
    """The micro policy trained 4 steps (evaluations at 0, 2 and 4) as is, and with the extra temperature up to
    step 2 and greedy decoding."""
    plain = tmp_path_factory.mktemp("plain") / "run"
    both = tmp_path_factory.mktemp("both") / "run"
    return (plain, _train(micro_path, plain)), (both, _train(micro_path, both, **{
        "eval.extra_temperature": 0.5, "eval.extra_until_step": 2, "eval.greedy": "true"}))


def test_the_readings_are_where_the_rule_says(two_runs):
    _, (_, rows) = two_runs
    by_step = {r["step"]: r for r in rows}
    for step in (0, 2, 4):
        assert len(by_step[step]["eval/correct_per_question"]) == 8  # eval.prompts
        assert len(by_step[step]["eval/greedy_correct_per_question"]) == 8
    assert [r["step"] for r in rows if f"{EXTRA}pass@1" in r] == [0, 2]  # eval.extra_until_step 2
    assert [r["step"] for r in rows if "eval/question_ids" in r] == [0]
    for step in (0, 2):
        r = by_step[step]
        counts = r[f"{EXTRA}correct_per_question"]
        assert len(counts) == 8 and all(0 <= c <= 4 for c in counts)
        assert r[f"{EXTRA}avg@4"] == pytest.approx(sum(counts) / 32)
        assert r[f"{EXTRA}pass_rate_hist"] == np.bincount(counts, minlength=5).tolist()
        assert r["eval/greedy_pass@1"] == pytest.approx(sum(r["eval/greedy_correct_per_question"]) / 8)
    assert not any(k.startswith(EXTRA) for r in rows for k in r if r["step"] in (1, 3, 4))
    # the held-out questions of seed 0, in order
    val = DigitTask().split(0)[1][:8]
    assert by_step[0]["eval/question_ids"] == [hashlib.sha256(ex.prompt.encode()).hexdigest()[:12] for ex in val]


def test_the_readings_move_nothing_else(two_runs):
    (plain_dir, plain), (both_dir, both) = two_runs

    def main_only(rows):
        return [{k: v for k, v in r.items() if not k.startswith((*VOLATILE, EXTRA, *GREEDY))} for r in rows]

    assert [r["step"] for r in both] == [0, 1, 2, 3, 4]
    assert any(k.startswith(EXTRA) for r in both for k in r)  # the filter below removes something
    assert main_only(both) == main_only(plain)  # every training and main-evaluation number, to the last bit
    for name in ("samples.jsonl", "token_records.jsonl"):
        assert (both_dir / name).read_bytes() == (plain_dir / name).read_bytes(), name
    # the extra temperature's samples are its own: its counts are not the main evaluation's
    extra = [r for r in both if f"{EXTRA}avg@4" in r]
    assert any(r[f"{EXTRA}correct_per_question"] != r["eval/correct_per_question"] for r in extra)


@pytest.mark.parametrize("sets, field", [
    ({"extra_temperature": -0.5}, "eval.extra_temperature"),
    ({"extra_temperature": 1.0}, "eval.extra_temperature"),  # = eval.temperature
    ({"extra_temperature": 0.7, "temperature": 0.7}, "eval.extra_temperature"),
    ({"extra_temperature": "hot"}, "eval.extra_temperature"),
    ({"extra_until_step": -1}, "eval.extra_until_step"),
    ({"extra_until_step": 2.5}, "eval.extra_until_step"),
    ({"greedy": "maybe"}, "eval.greedy"),
])
def test_bad_values_are_one_line_naming_the_field(sets, field):
    with pytest.raises(UserError) as e:
        config_from_dict({"eval": sets}, check_method=False)
    assert f"'{field}'" in str(e.value) and "\n" not in str(e.value)


def test_defaults_are_off():
    e = load_config().eval
    assert (e.extra_temperature, e.extra_until_step, e.greedy) == (0.0, None, False)
