"""The GPU lease kit (``python -m benchmarks.lease.kit``, docs/lease.md): it imports ``benchmarks.lease`` and
``benchmarks.gpu``."""
