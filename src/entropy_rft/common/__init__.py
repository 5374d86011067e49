"""Layer 0: leaves every layer may use, torch-free: one-line user errors, the option lists, the metric-name table, the
CPU thread rule.
"""
