"""Layer 8: the native engine: the frozen records of a step, its stages and loop, the probes, what a step logs, the
pre-flight checks, and the built-in default policy (SFT).
"""
