"""Layer 4: the typed run configuration (fields with their help texts and constraints, YAML and --set), and the TRL
engine's settings derived from it.
"""
