"""Layer 5: policies on disk: where a policy's files are, loading and saving (folders, hub ids, the SmolLM2 wheel), and
whether a low-precision dtype can hold an update.
"""
