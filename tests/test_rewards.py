"""math_reward: last \\boxed{} extraction, plain-text gold answers, and the worker pool's hard time limit."""

import time

import pytest

from entropy_rft.tasks import rewards as R


def test_last_boxed_nested_and_last():
    assert R.last_boxed(r"x \boxed{1} then \boxed{\frac{a}{b^{2}}} end") == r"\frac{a}{b^{2}}"
    assert R.last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert R.last_boxed(r"\boxed 5$") == "5"
    assert R.last_boxed(r"\fbox{7}") == "7"
    assert R.last_boxed(r"\boxed{3} and \boxed{4") is None  # the last box is unclosed
    assert R.last_boxed("no box") is None
    assert R.last_boxed(None) is None


def test_wrap_gold_and_format_reward():
    assert R.wrap_gold("0.5") == r"$\boxed{0.5}$"
    assert R.wrap_gold(r"$\sqrt{12}$") == r"$\boxed{\sqrt{12}}$"
    assert R.wrap_gold(r"so \boxed{7}") == r"$\boxed{7}$"
    assert R.wrap_gold(288) == r"$\boxed{288}$"
    assert R.format_reward(r"\boxed{3}") == 1.0
    assert R.format_reward(r"\boxed{ }") == 0.0
    assert R.format_reward("3") == 0.0


@pytest.mark.parametrize("response,gold,expected", [
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"first \boxed{12} then \boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{2\sqrt{3}} then \boxed{12}", r"\sqrt{12}", 0.0),  # only the last box counts
    (r"\boxed{288}", 288, 1.0),
    (r"\boxed{289}", "288", 0.0),
    ("288", "288", 0.0),  # no box
    (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # unclosed
])
def test_math_reward_plain_gold(response, gold, expected):
    assert R.math_reward(response, gold) == expected


def test_batch_equals_single_and_pathological_answer_is_wrong_fast():
    resp = [rf"\boxed{{{i}}}" for i in range(12)]
    gold = [str(i if i % 3 else i + 1) for i in range(12)]
    assert R.math_rewards(resp, gold) == [R.math_reward(r, g) for r, g in zip(resp, gold)]
    assert R.math_rewards(resp, gold) == [0.0 if i % 3 == 0 else 1.0 for i in range(12)]
    R.math_reward(r"\boxed{1}", "1")  # warm
    t0 = time.monotonic()
    assert R.math_reward(r"\boxed{9^{9^{9^{9^{9^{9}}}}}!}", "5") == 0.0
    assert time.monotonic() - t0 < R.DEFAULT_TIMEOUT + 0.5


@pytest.fixture
def helper_module(tmp_path, monkeypatch):
    (tmp_path / "erft_reward_helper.py").write_text(
        "import os, time\n"
        "def slow(x):\n    time.sleep(x)\n    return x\n"
        "def crash(x):\n    if x < 0:\n        os._exit(3)\n    return x\n"
        "def boom(x):\n    raise RuntimeError('bad')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "erft_reward_helper"


def test_stuck_worker_is_killed_and_replaced(helper_module):
    with R.RewardPool(f"{helper_module}:slow", workers=1, timeout=0.5, default=-1.0) as pool:
        t0 = time.monotonic()
        assert pool.map([(30.0,), (0.01,)]) == [-1.0, 0.01]
        # the hang cost the limit only; the replacement's start-up is not charged to the hung answer
        assert time.monotonic() - t0 < 0.5 + 15
        assert pool.n_timeouts == 1 and pool.n_restarts == 1
        t1 = time.monotonic()
        assert pool(0.02) == 0.02
        assert time.monotonic() - t1 < 0.5
        assert sum(w.alive() for w in pool._workers) == 1


def test_crashing_or_raising_function_scores_default(helper_module):
    with R.RewardPool(f"{helper_module}:crash", workers=2, timeout=1.0, default=0.0) as pool:
        assert pool.map([(1.5,), (-1,), (2.5,), (-1,), (4,)]) == [1.5, 0.0, 2.5, 0.0, 4]
    with R.RewardPool(f"{helper_module}:boom", workers=1, timeout=1.0, default=0.0) as pool:
        assert pool.map([(1,), (2,)]) == [0.0, 0.0]


def test_pool_start_failure_is_reported():
    with pytest.raises(RuntimeError, match="failed to start"):
        R.RewardPool("no_such_module_xyz:fn", workers=1).start()
