"""CPU measurements, each a script (``python -m benchmarks.cpu.<name>``): they import none of the benchmarks'
other modules."""
