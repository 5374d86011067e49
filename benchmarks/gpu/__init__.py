"""GPU measurements and the comparison's driver (``python -m benchmarks.gpu.<name>``): they import
``benchmarks.gpu`` only."""
