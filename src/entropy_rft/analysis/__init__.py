"""Layer 11: figures from run directories: runs as data and series, per-run summaries, the entropy-performance
law, the theory's agreement with the measured entropy change, the methods at equal entropy, the masking
experiment and the theory probe on a policy.
"""
