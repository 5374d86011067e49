"""Layer 7: the run directory: atomic files and JSONL logs, the lock, status, the trackers, checkpoints and the
recorded config.
"""
