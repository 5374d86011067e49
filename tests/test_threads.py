"""entropy_rft.common.threads: the one thread-count rule (issue 15: OpenMP threads collapse on shared cores)."""

from __future__ import annotations

import pytest
import torch

from entropy_rft.common.threads import (
    MAX_AUTO_THREADS,
    SMALL_MODEL_PARAMS,
    apply_threads,
    available_cores,
    choose_threads,
    prefer_passive_wait,
)


@pytest.mark.parametrize(
    "requested,n_params,device,cores,expected",
    [
        (3, 1_000, "cpu", 2, 3),  # an explicit request wins, whatever the model
        (1, 10**9, "cpu", 16, 1),
        (0, 1_330_000, "cpu", 2, 1),  # the built-in default policy: 1 thread
        (0, SMALL_MODEL_PARAMS - 1, "cpu", 64, 1),
        (0, SMALL_MODEL_PARAMS, "cpu", 2, 2),  # at the threshold: the cores
        (0, 135_000_000, "cpu", 2, 2),  # SmolLM2-135M on this 2-core machine
        (0, 135_000_000, "cpu", 1, 1),
        (0, 10**9, "cpu", 64, MAX_AUTO_THREADS),  # capped
        (0, 10**9, "cuda", 64, 0),  # accelerator: torch's setting is left alone
        (0, 1_000, "cuda:1", 2, 0),
        (2, 1_000, "cuda", 8, 2),
    ],
)
def test_choose_threads_by_hand(requested, n_params, device, cores, expected):
    assert choose_threads(requested, n_params, device, cores) == expected


def test_choose_threads_refuses_negative_and_defaults_to_the_cores():
    with pytest.raises(ValueError, match=">= 0"):
        choose_threads(-1, 10, "cpu")
    assert choose_threads(0, 10**9) == min(available_cores(), MAX_AUTO_THREADS) >= 1


def test_apply_threads_sets_torch_and_restores():
    before = torch.get_num_threads()
    try:
        model = torch.nn.Linear(4, 4)
        assert apply_threads(0, model) == 1 == torch.get_num_threads()
        assert apply_threads(2, n_params=10) == 2 == torch.get_num_threads()
        assert apply_threads(0, model, "cuda") == 2  # left alone
    finally:
        torch.set_num_threads(before)


def test_prefer_passive_wait_only_before_torch_and_never_over_the_user():
    env: dict[str, str] = {}
    assert prefer_passive_wait(env, {}) is True and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "active"}
    assert prefer_passive_wait(env, {}) is False and env["OMP_WAIT_POLICY"] == "active"  # the user's choice
    env = {}
    assert prefer_passive_wait(env, {"torch": object()}) is False and env == {}  # too late: libgomp is loaded
