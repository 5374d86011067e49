"""Layer 11: figures from run directories and policies: runs as data and series, per-run summaries and a sweep's
tables, the entropy-performance law, the theory's agreement with the measured entropy change, the methods at equal
entropy, the masking experiment, the theory probe on a policy, evaluating policies on benchmarks (erft eval) and
the pass-rate filter (erft filter).
"""
