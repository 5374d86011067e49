"""Triton kernels for the token statistics (Paper A, Lemma 3.1 and Thm 3.3) on an accelerator.

``stats`` reads materialised logits once and returns log p_k, H, S_k, E_p[S] (and log-sum-exp) per row;
``grad`` turns a tile of logits into d/dz of ``g_logp log p_k + g_ent H`` for the fused LM head's backward.
The formulas are ``dynamics``'s (its module docstring); nothing here imports ``dynamics`` or ``fused``, which
call these kernels lazily (Triton is an optional extra: ``pip install --no-deps 'triton==3.6.0'``).
On CPU tensors the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton
is first imported), which is how the test suite runs them.
"""
