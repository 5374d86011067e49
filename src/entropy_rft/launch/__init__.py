"""Layer 10: starting runs: one run (start or resume under the run directory's lock, on the native or TRL engine),
and a sweep of them (erft compare: the variant grammar, the plans, the folder checks, the scheduler).
"""
