"""The arithmetic of timings, without torch (the lease kit renders results on any machine)."""

from __future__ import annotations


def median(xs: list[float]) -> float:
    """The median of ``xs`` (the mean of the middle two for an even count)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
