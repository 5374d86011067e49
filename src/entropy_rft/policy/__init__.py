"""Layer 6: running a policy: the raw-weights Llama forward, the samplers (static KV cache, graph-ready decode), the
packed policy forward with statistics, rollout, evaluation (Pass@K) and the JVP probe.
"""
