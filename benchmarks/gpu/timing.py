"""Timing and peak memory for the GPU benchmarks: every function of a comparison timed in the same rounds.

On a GPU each call is timed with CUDA events after a synchronisation; on the CPU with ``perf_counter`` (the
CPU smoke runs only check that the scripts run: their figures mean nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks.gpu.timing_math import median  # noqa: F401  (kept here: timing's users import it from timing)


def sync(dev: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], object]], dev: str, reps: int, warmup: int = 2,
                     before: Callable[[str], None] | None = None) -> dict[str, float]:
    """Median seconds per call of each fn; every round runs every fn once, so a slow spell of the machine
    lands on all of them alike. ``before(name)`` runs untimed ahead of each call (clearing gradients)."""
    for _ in range(warmup):
        for name, fn in fns.items():
            if before:
                before(name)
            fn()
    sync(dev)
    times: dict[str, list[float]] = {k: [] for k in fns}
    cuda = dev.startswith("cuda")
    for _ in range(reps):
        for name, fn in fns.items():
            if before:
                before(name)
            sync(dev)
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: median(v) for k, v in times.items()}


def extra_peak(fn: Callable[[], object], dev: str, before: Callable[[], None] | None = None) -> int | None:
    """Peak device memory allocated while ``fn`` runs, above what was allocated before it (CUDA only; None on
    the CPU). ``before()`` runs first (clearing gradients), so each function starts alike."""
    if not dev.startswith("cuda"):
        return None
    if before:
        before()
    sync(dev)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(dev)
    return torch.cuda.max_memory_allocated() - base
