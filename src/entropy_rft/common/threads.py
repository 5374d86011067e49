"""How many CPU threads torch uses: the one rule for every command (``train.threads``, ``--threads``).

torch's default is one OpenMP thread per core. On a machine whose cores are shared with other busy processes
(other jobs, other agents, a second run), OpenMP's worker threads wait for each other at every parallel
region, spinning while a sibling is descheduled: on this project's 2-core machine with one other CPU-bound
process, steps of the built-in default policy took 11-49 s at 2 threads against 2.4-4.5 s at 1.
Small models gain nothing from a second thread even on an idle machine (their ops are too small to split),
so the automatic choice is 1 thread below ``SMALL_MODEL_PARAMS``; larger models get the cores, at most
``MAX_AUTO_THREADS``. ``benchmarks/cpu/threads.py`` measures the rule.

``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep instead of spinning) is read by libgomp (torch's
OpenMP runtime on Linux) once, when it loads, i.e. at ``import torch``: setting it in a process that already
imported torch does nothing. ``prefer_passive_wait()`` sets it (unless the user set it) when torch is not
loaded yet, for entry points to call first thing.
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "MAX_AUTO_THREADS",
    "SMALL_MODEL_PARAMS",
    "apply_threads",
    "available_cores",
    "choose_threads",
    "prefer_passive_wait",
]

# Below this many parameters a model runs on 1 thread by default (the built-in default policy has 1.3M,
# SmolLM2-135M has 135M).
SMALL_MODEL_PARAMS = 50_000_000
# The automatic choice never asks for more threads than this, whatever the core count.
MAX_AUTO_THREADS = 8
# The most threads a user may ask for (``train.threads``, ``--threads``): more than any CPU has cores; torch takes
# the count as a C int, so a larger number fails inside it rather than meaning anything.
MAX_THREADS = 1024


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def choose_threads(requested: int, n_params: int, device: str = "cpu", cores: int | None = None) -> int:
    """The torch thread count to use; 0 means "leave torch's setting alone".

    requested > 0: exactly that (``train.threads`` / ``--threads`` set by the user).
    requested == 0 (automatic):
      - device not CPU: 0 (the accelerator does the work; torch's default is kept);
      - a model under ``SMALL_MODEL_PARAMS`` parameters: 1 (no gain from more, and no collapse when the
        cores are shared);
      - otherwise: min(cores, ``MAX_AUTO_THREADS``), cores = ``available_cores()`` unless given.
    """
    if requested < 0:
        raise ValueError(f"threads must be >= 0 (0: automatic), got {requested}")
    if requested > 0:
        return int(requested)
    if not str(device).startswith("cpu"):
        return 0
    if n_params < SMALL_MODEL_PARAMS:
        return 1
    return max(1, min(available_cores() if cores is None else int(cores), MAX_AUTO_THREADS))


def apply_threads(requested: int, model=None, device: str = "cpu", n_params: int | None = None) -> int:
    """``torch.set_num_threads(choose_threads(...))`` for ``model`` (or ``n_params``); returns the count in
    effect afterwards (torch's own when the rule leaves it alone)."""
    import torch

    if n_params is None:
        n_params = sum(p.numel() for p in model.parameters()) if model is not None else 0
    n = choose_threads(requested, n_params, device)
    if n > 0 and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


def prefer_passive_wait(environ=None, modules=None) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process unless the user chose a policy or torch (hence libgomp)
    is already loaded; returns whether the variable is PASSIVE afterwards and takes effect. ``environ`` and
    ``modules`` default to ``os.environ`` and ``sys.modules`` (parameters for tests)."""
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    if "torch" in mods:
        return False
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env["OMP_WAIT_POLICY"].upper() == "PASSIVE"
