"""Layer 1: the maths, pure functions over tensors: token statistics and the fused LM head (Paper A, Lemma 3.1, Thm
3.2/3.3), the covariances (Paper B), advantages, the surrogate loss with its typed inputs, settings and outputs,
batch metrics, tensor checks, the one Pearson r and sign agreement of a prediction against a measurement, and their
Triton kernels.
"""
