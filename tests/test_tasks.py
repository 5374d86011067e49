"""Task interface, registry and the Countdown verifier (CPU, fast)."""

from __future__ import annotations

import pytest

from entropy_rft import tasks
from entropy_rft.tasks.base import Example, Task
from entropy_rft.tasks.countdown import (
    CountdownTask,
    ParseError,
    evaluate,
    expressions,
    format_prompt,
    parse_expression,
    parse_prompt,
)


@pytest.fixture(scope="module")
def task() -> CountdownTask:
    return CountdownTask()


def ex(task: CountdownTask, digits: tuple[int, ...], target: int) -> Example:
    return task.example(digits, target)


# ----------------------------------------------------------------------------- verifier


@pytest.mark.parametrize(
    "response, expected",
    [
        ("3*8", 1.0),
        ("8*3", 1.0),
        (" 3 * 8 ", 1.0),
        ("(3*8)", 1.0),
        ("((3))*(8)", 1.0),
        ("3*(5+8)-15", 0.0),  # 15 is not a digit of the prompt
        ("8*(5-3)+8", 0.0),  # 8 used twice
        ("3*8+5-5", 0.0),  # 5 used twice (four operands)
        ("(5+3)*8", 0.0),  # valid, wrong value (64)
        ("5*8-3*5", 0.0),  # digit reuse
        ("24", 0.0),  # two-digit number
        ("38", 0.0),
        ("-3*8", 0.0),  # unary minus
        ("3*8*", 0.0),
        ("3**8", 0.0),
        ("3/8", 0.0),
        ("(3*8", 0.0),
        ("3*8)", 0.0),
        ("8", 0.0),  # one operand is not enough
        ("", 0.0),
        ("garbage<eos>", 0.0),
        ("٣*8", 0.0),  # a non-ASCII digit
        ("(" * 500 + "3" + ")" * 500, 0.0),
        ("3*8" * 100, 0.0),
    ],
)
def test_reward_hand_cases(task, response, expected):
    assert task.reward(response, ex(task, (3, 5, 8), 24)) == expected


def test_parentheses_and_unused_digits(task):
    e = ex(task, (2, 3, 4), 20)
    assert task.reward("(2+3)*4", e) == 1.0
    assert task.reward("2+3*4", e) == 0.0  # 14: precedence matters
    assert task.reward("4*(3+2)", e) == 1.0
    e2 = ex(task, (2, 3, 4), 6)
    assert task.reward("2*3", e2) == 1.0  # the 4 is unused: fine
    assert task.reward("2+4", e2) == 1.0


def test_repeated_digit_in_prompt_may_be_used_twice(task):
    e = ex(task, (3, 3, 5), 9)
    assert task.reward("3*3", e) == 1.0
    assert task.reward("3*3*3", ex(task, (3, 3, 5), 27)) == 0.0  # three 3s from two
    assert task.reward("5+5-1", e) == 0.0


def test_reward_never_raises_on_odd_inputs(task):
    e = ex(task, (3, 5, 8), 24)
    for bad in [None, 24, 3.5, b"3*8", object(), ["3*8"]]:
        assert task.reward(bad, e) == 0.0  # type: ignore[arg-type]
        assert task.canonical(bad, e) is None  # type: ignore[arg-type]
    weird = Example(prompt="nonsense", answer="x", meta={})
    assert task.reward("3*8", weird) == 0.0


def test_reward_without_meta_parses_prompt(task):
    e = Example(prompt="358>24:", answer=24)
    assert task.reward("3*8", e) == 1.0
    assert task.reward("3+8", e) == 0.0


def test_parser_and_evaluator():
    assert evaluate(parse_expression("2+3*4")) == 14
    assert evaluate(parse_expression("(2+3)*4")) == 20
    assert evaluate(parse_expression("9-5-1")) == 3  # left associative
    assert evaluate(parse_expression("9-(5-1)")) == 5
    with pytest.raises(ParseError):
        parse_expression("2+")


# ----------------------------------------------------------------------------- canonical


def test_canonical_syntactic(task):
    e = ex(task, (3, 5, 8), 24)
    assert task.canonical(" (3 * 8) ", e) == "3*8"
    assert task.canonical("3*(8)", e) == "3*8"
    assert task.canonical("8*3", e) == "8*3"  # a different answer in the default mode
    assert task.canonical("3+(5+8)", e) == "3+5+8"
    assert task.canonical("8-(3-5)", e) == "8-(3-5)"
    assert task.canonical("(5+3)*8", e) == "(5+3)*8"  # wrong but valid: still has a form
    assert task.canonical("35", e) is None
    assert task.canonical("3*3", e) is None  # digit reuse is invalid


def test_canonical_algebraic():
    t = CountdownTask(canonical_mode="algebraic")
    e = t.example((3, 5, 8), 24)
    assert t.canonical("8*3", e) == t.canonical("3*8", e) == "3*8"
    assert t.canonical("8-(3-5)", e) == t.canonical("5+8-3", e)
    assert t.canonical("(5+3)*8", e) == t.canonical("8*(3+5)", e)
    assert t.canonical("3-5+8", e) != t.canonical("3-8+5", e)


def test_expressions_are_valid_and_cover_solutions(task):
    digits = (3, 5, 8)
    es = expressions(digits)
    assert len(es) == len(set(es)) > 50
    e = ex(task, digits, 24)
    sols = task.solutions(e)
    assert "3*8" in sols and "8*3" in sols
    assert all(task.reward(s, e) == 1.0 for s in sols)
    assert e.meta["n_solutions"] == len({task.canonical(s, e) for s in sols})


# ----------------------------------------------------------------------------- split


def test_split_deterministic_disjoint(task):
    tr1, va1 = task.split(0)
    tr2, va2 = task.split(0)
    assert [x.prompt for x in va1] == [x.prompt for x in va2]
    assert [x.prompt for x in tr1[:50]] == [x.prompt for x in tr2[:50]]
    assert len(va1) == 256
    val_prompts = {x.prompt for x in va1}
    assert len(val_prompts) == 256
    assert not val_prompts & {x.prompt for x in tr1}
    assert len(tr1) + len(va1) == len(task.all_pairs())
    _, va3 = task.split(1)
    assert [x.prompt for x in va3] != [x.prompt for x in va1]


def test_every_prompt_is_solvable_and_well_formed(task):
    tr, va = task.split(0)
    for e in va + tr[:300]:
        digits, target = parse_prompt(e.prompt)
        assert len(e.prompt) == 7 and 1 <= target <= 99
        assert e.answer == target and e.meta["digits"] == digits
        assert task.solutions(e), e.prompt


def test_validation_pool_is_outside_sft_pairs(task):
    pool = set(task.held_out_pool())
    assert pool and not pool & set(task.sft_pairs())
    _, va = task.split(3)
    assert {parse_prompt(e.prompt) for e in va} <= pool


def test_format_parse_prompt_round_trip():
    assert format_prompt((3, 5, 8), 7) == "358>07:"
    assert parse_prompt("358>07:") == ((3, 5, 8), 7)
    with pytest.raises(ValueError):
        parse_prompt("358>7:")


# ----------------------------------------------------------------------------- registry


def test_registry_builds_by_name_and_import_path():
    assert "countdown" in tasks.available_tasks()
    t = tasks.build_task("countdown", n_val=16)
    assert isinstance(t, Task) and t.name == "countdown" and len(t.split(0)[1]) == 16
    t2 = tasks.build_task("entropy_rft.tasks.countdown:CountdownTask", n_val=8)
    assert isinstance(t2, CountdownTask)


def test_registry_errors():
    with pytest.raises(ValueError, match="known tasks: .*countdown"):
        tasks.build_task("no-such-task")
    with pytest.raises(ValueError, match="cannot import"):
        tasks.build_task("no_such_module_xyz:Thing")
    with pytest.raises(ValueError, match="no attribute"):
        tasks.build_task("entropy_rft.tasks.countdown:Nope")
    with pytest.raises(ValueError, match="not an entropy_rft Task"):
        tasks.build_task("collections:OrderedDict")
    with pytest.raises(ValueError, match="already registered"):
        tasks.register_task("countdown", CountdownTask)
    with pytest.raises(ValueError, match="max_target"):
        tasks.build_task("countdown", max_target=150)


def test_register_custom_task():
    class Echo(Task):
        name = "echo-test"

        def split(self, seed):
            return [Example("a", "a")], [Example("b", "b")]

        def reward(self, response, example):
            return float(response == example.answer)

        def canonical(self, response, example):
            return response

    tasks.register_task("echo-test", Echo, overwrite=True)
    t = tasks.build_task("echo-test")
    assert t.reward("b", t.split(0)[1][0]) == 1.0
    assert "echo-test" in tasks.available_tasks()
