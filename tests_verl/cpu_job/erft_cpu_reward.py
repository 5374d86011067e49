"""Test harness only: a reward with spread for the CPU verl job. A tiny random policy scores 0 on Countdown
(every GRPO advantage would be 0), so the job scores the fraction of digits in the response instead; verl
loads this file by path (``reward.custom_reward_function.path``)."""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    text = str(solution_str)
    return sum(c.isdigit() for c in text) / max(len(text), 1)
