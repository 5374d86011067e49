"""Entropy-control methods: pure mask functions, the method registry, the quadrant lens, and the one
minibatch selection rule every engine calls (``select_minibatch``, ``microbatch_loss_scale``).

``from entropy_rft import control; control.clip_b_mask(...)``. See DESIGN.md ("Semantics of the mask
functions") and papers.md for the rules.
"""

from entropy_rft.control import builtins as _builtins  # noqa: F401  (registers the built-in methods)
from entropy_rft.control.builtins import (
    CEGPPO,
    AdaptiveEntropy,
    ClipB,
    ClipBPaper,
    ClipCov,
    ClipHigher,
    ClipLow,
    ClipV,
    ClipVPaper,
    EntropicControl,
    EntropyAdvantage,
    EntropyBonus,
    GradMask,
    HighEntropy,
    KLCov,
    NoControl,
    Steer,
)
from entropy_rft.control.lens import (
    QUADRANTS,
    gradient_coefficients,
    lens_attribution,
    loss_gradient,
    quadrant_effects,
    weight_lens,
)
from entropy_rft.control.masks import (
    clip_b_mask,
    clip_cov_mask,
    clip_v_mask,
    grad_mask,
    high_entropy_mask,
    kl_cov_select,
)
from entropy_rft.control.registry import (
    LossOverrides,
    Masks,
    Method,
    available_methods,
    build_method,
    get_method_class,
    method_info,
    on_register,
    param,
    register_method,
)
from entropy_rft.control.selection import MinibatchSelection, microbatch_loss_scale, select_minibatch

__all__ = [
    "clip_b_mask",
    "clip_v_mask",
    "clip_cov_mask",
    "kl_cov_select",
    "high_entropy_mask",
    "grad_mask",
    "lens_attribution",
    "gradient_coefficients",
    "loss_gradient",
    "weight_lens",
    "quadrant_effects",
    "QUADRANTS",
    "LossOverrides",
    "Masks",
    "Method",
    "param",
    "register_method",
    "on_register",
    "build_method",
    "available_methods",
    "method_info",
    "get_method_class",
    "select_minibatch",
    "microbatch_loss_scale",
    "MinibatchSelection",
    "NoControl",
    "ClipB",
    "ClipBPaper",
    "ClipV",
    "ClipVPaper",
    "ClipCov",
    "KLCov",
    "ClipHigher",
    "EntropyBonus",
    "HighEntropy",
    "GradMask",
    "EntropyAdvantage",
    "AdaptiveEntropy",
    "CEGPPO",
    "ClipLow",
    "EntropicControl",
    "Steer",
]
