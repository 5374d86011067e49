"""Layer 10: starting runs: one run (start or resume under the run directory's lock, on the native or TRL engine;
for the native engine, the run directory's side of its loop: resume point, status, SIGTERM/SIGINT), and a sweep
of them (erft compare: the variant grammar, the plans, the folder checks, the scheduler).
"""
