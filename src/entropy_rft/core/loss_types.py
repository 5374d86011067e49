"""The typed interface of the policy loss: what a method contributes (``Masks``), what one call reads
(``LossInputs``, checked when built), how the loss is set (``LossSettings``, validated once when built) and what
it returns (``LossOutputs``: the loss with its graph, and the metrics as tensors until ``metrics()`` turns them
into numbers, once, where the step logs them).

    settings = LossSettings(eps_low=0.2, eps_high=0.28, agg="token-mean")      # once per step
    out = compute_policy_loss(LossInputs(logp, old_logp, adv, mask, Masks(keep=keep)), settings)
    out.loss.backward(); row = out.metrics()                                   # per micro-batch

``core.loss.compute_policy_loss`` is the maths; ``core.loss.policy_loss`` is the keyword call that builds these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from entropy_rft.common.options import AGG_MODES, KL_ESTIMATORS
from entropy_rft.core.tensor_checks import as_mask, broadcast_advantages, check_bool_like, check_like, is_number

__all__ = ["Agg", "KLEstimator", "LossInputs", "LossOutputs", "LossSettings", "Masks"]

Agg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
assert get_args(Agg) == AGG_MODES and get_args(KLEstimator) == KL_ESTIMATORS  # one list of names each


@dataclass
class Masks:
    """What a method contributes to one loss call (all shaped like the response mask)."""

    keep: Tensor | None = None  # False = leaves loss and counts (ClipB, ClipV, high_entropy, grad_mask)
    zeroed: Tensor | None = None  # True = loss × 0 but still counted (Clip-Cov)
    kl_cov_select: Tensor | None = None  # tokens that get kl_cov_coef·|logp − old_logp| (KL-Cov)
    adv_shift: Tensor | None = None  # float, added to the advantage in the surrogate (entropy advantage shaping)
    weight_select: Tensor | None = None  # tokens of EntroPIC's sample-weight adjustment (p > threshold)
    eps_low: Tensor | None = None  # float, per-token clip widths replacing the loss's (Flexible Entropy Control)
    eps_high: Tensor | None = None


def _check_eps(value: Any, name: str) -> None:
    if value is not None and (not is_number(value) or not value >= 0):
        raise ValueError(f"{name} must be None or a number >= 0, got {value!r}")


def _check_coef(value: Any, name: str) -> None:
    if not is_number(value) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


@dataclass(frozen=True)
class LossSettings:
    """How the loss is set: the same for every micro-batch of an update, validated once when built (a bad value
    raises ``ValueError`` naming the field). Per-token clip widths come with the inputs (``Masks.eps_*``)."""

    eps_low: float | None = 0.2  # ratio clip below 1 (None: that side unclipped)
    eps_high: float | None = 0.2  # ratio clip above 1 (clip-higher: > eps_low)
    dual_clip: float | None = None  # c > 1 bounds the loss of A < 0 tokens by −A·c
    agg: Agg = "token-mean"
    kl_cov_coef: float = 0.0  # KL-Cov's |logp − old_logp| pull on the selected tokens
    ref_kl_coef: float = 0.0
    ref_kl_estimator: KLEstimator = "k3"
    ref_kl_ratio_weighted: bool = False  # TRL's use_bias_correction_kl
    entropy_coef: float = 0.0  # the entropy bonus
    ce_beta_low: float = 0.0  # CE-GPPO's β1, β2 (0: PPO)
    ce_beta_high: float = 0.0
    weight_alpha: float = 0.0  # EntroPIC's weight adjustment α

    def __post_init__(self) -> None:
        for name in ("ce_beta_low", "ce_beta_high", "weight_alpha"):
            _check_coef(getattr(self, name), name)
        _check_eps(self.eps_low, "eps_low")
        _check_eps(self.eps_high, "eps_high")
        if self.dual_clip is not None and (not is_number(self.dual_clip) or not self.dual_clip > 1):
            raise ValueError(f"dual_clip must be None or a number > 1, got {self.dual_clip!r}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {list(AGG_MODES)}, got {self.agg!r}")
        for name in ("kl_cov_coef", "ref_kl_coef", "entropy_coef"):
            _check_coef(getattr(self, name), name)
        if self.ref_kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"ref_kl_estimator must be one of {list(KL_ESTIMATORS)}, got {self.ref_kl_estimator!r}")

    def kwargs(self) -> dict[str, Any]:
        """The settings as ``policy_loss`` keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_BOOL_MASKS = ("keep", "zeroed", "kl_cov_select", "weight_select")


def _check_widths(value: Tensor | None, mask: Tensor, name: str) -> None:
    if value is None:
        return
    check_like(value, mask, name)
    if not bool(((value >= 0) & torch.isfinite(value)).all()):
        raise ValueError(f"{name} must be finite and >= 0 on every token")


@dataclass(frozen=True)
class LossInputs:
    """One loss call's tensors, all shaped like ``mask`` [B, T] (advantages may be per sequence, [B] or [B, 1],
    or a scalar). Checked when built: ``mask`` and the masks become bool (0/1 integers accepted), the advantages
    are broadcast to the mask's shape, a wrong shape raises ``ValueError`` naming the tensor."""

    logp: Tensor  # log-probs of the sampled tokens under the policy being updated, with grad
    old_logp: Tensor  # the same under the policy that sampled them
    advantages: Tensor
    mask: Tensor  # the response tokens
    masks: Masks = field(default_factory=Masks)  # the method's contribution
    ref_logp: Tensor | None = None  # the reference policy's (ref-KL)
    entropy: Tensor | None = None  # token entropy with grad (entropy bonus)

    def __post_init__(self) -> None:
        mask = as_mask(self.mask)
        check_like(self.logp, mask, "logp")
        check_like(self.old_logp, mask, "old_logp")
        object.__setattr__(self, "mask", mask)
        object.__setattr__(self, "advantages", broadcast_advantages(self.advantages, mask))
        m = self.masks
        bools = {k: check_bool_like(v, mask, k) for k in _BOOL_MASKS if (v := getattr(m, k)) is not None}
        if m.adv_shift is not None:
            check_like(m.adv_shift, mask, "adv_shift")
        _check_widths(m.eps_low, mask, "eps_low")
        _check_widths(m.eps_high, mask, "eps_high")
        if any(v is not getattr(m, k) for k, v in bools.items()):  # 0/1 integers became bool: a new Masks
            object.__setattr__(self, "masks", Masks(**{**vars(m), **bools}))
        if self.ref_logp is not None:
            check_like(self.ref_logp, mask, "ref_logp")
        if self.entropy is not None:
            check_like(self.entropy, mask, "entropy")

    def check_against(self, s: LossSettings) -> None:
        """The rules that join the settings and the inputs: a non-zero coefficient needs its tensor, the
        per-sequence aggregations a [B, T] mask."""
        if s.weight_alpha != 0 and self.masks.weight_select is None:
            raise ValueError("weight_alpha is non-zero but weight_select is None (pass EntroPIC's token selection)")
        if s.agg != "token-mean" and self.mask.dim() < 2:
            raise ValueError(f"agg={s.agg!r} needs a mask shaped [B, T], got {tuple(self.mask.shape)}")
        if s.kl_cov_coef != 0 and self.masks.kl_cov_select is None:
            raise ValueError("kl_cov_coef is non-zero but kl_cov_select is None (pass the KL-Cov selection)")
        if s.ref_kl_coef != 0 and self.ref_logp is None:
            raise ValueError("ref_kl_coef is non-zero but ref_logp is None")
        if s.entropy_coef != 0 and self.entropy is None:
            raise ValueError("entropy_coef is non-zero but entropy is None")


def _frac(x: Tensor, m: Tensor, n: int) -> float | None:
    return float((x & m).sum()) / n if n else None


@dataclass
class LossOutputs:
    """The loss (a scalar with its graph) and what its metrics are made of, detached, still on the device:
    ``metrics()`` reads them (one host sync per call), so a step calls it where it logs, not per term."""

    loss: Tensor
    terms: dict[str, Tensor | None]  # loss/total, loss/pg, loss/kl_cov, loss/kl_ref, kl/ref, loss/entropy_bonus
    counted: Tensor  # m = mask & keep, bool
    valid: Tensor  # the response mask
    ratio: Tensor  # r, detached
    clipped: dict[str, Tensor]  # low, high, dual (only with a dual clip): where that clip removes the gradient
    masks: Masks  # the method's, as the loss read them
    ce: Tensor | None = None  # the tokens CE-GPPO's term reached (None: term off)
    weight_adjust: Tensor | None = None  # EntroPIC's term (None: off)

    def metrics(self) -> dict[str, float | None]:
        """The metrics as numbers (None when no token counts or the term is absent), over counted tokens:
        ``loss/total``, ``loss/pg``, ``loss/kl_cov``, ``loss/kl_ref`` (coefficient-weighted contributions that sum
        to ``loss/total``), ``kl/ref`` (the raw aggregated estimate), ``loss/entropy_bonus``,
        ``clip/ratio_low_frac``, ``clip/ratio_high_frac``, ``clip/ratio_frac``, ``clip/dual_frac``, ``ratio/mean``,
        ``ratio/max``, ``ratio/min``, ``loss/counted_frac`` (Σm/Σmask), ``loss/zeroed_frac`` and
        ``control/kl_cov_selected_frac``, ``tokens/counted``; with their terms ``loss/adv_shift_mean``,
        ``clip/ce_frac``, ``loss/weight_adjust`` and ``control/weight_selected_frac``
        (names: ``entropy_rft.common.metric_names``)."""
        m, c, mk = self.counted, self.clipped, self.masks
        n = int(m.sum())

        def val(x: Tensor | None) -> float | None:
            return None if x is None or n == 0 else float(x)

        rm = self.ratio[m]  # every tensor here is detached: no graph is built
        n_valid = int(self.valid.sum())
        out: dict[str, float | None] = {k: val(v) for k, v in self.terms.items()}
        out.update({
            "clip/ratio_low_frac": _frac(c["low"], m, n),
            "clip/ratio_high_frac": _frac(c["high"], m, n),
            "clip/ratio_frac": _frac(c["low"] | c["high"], m, n),
            "clip/dual_frac": _frac(c["dual"], m, n) if "dual" in c else None,
            "ratio/mean": float(rm.to(torch.float64).mean()) if n else None,
            "ratio/max": float(rm.max()) if n else None,
            "ratio/min": float(rm.min()) if n else None,
            "loss/counted_frac": n / n_valid if n_valid else None,
            "loss/zeroed_frac": _frac(mk.zeroed, m, n) if mk.zeroed is not None else None,
            "control/kl_cov_selected_frac": _frac(mk.kl_cov_select, m, n) if mk.kl_cov_select is not None else None,
            "tokens/counted": float(n),
        })
        if mk.adv_shift is not None:
            out["loss/adv_shift_mean"] = float(mk.adv_shift.detach().to(torch.float64)[m].mean()) if n else None
        if self.ce is not None:
            out["clip/ce_frac"] = _frac(self.ce, m, n)
        if mk.weight_select is not None:
            out["loss/weight_adjust"] = val(self.weight_adjust)
            out["control/weight_selected_frac"] = _frac(mk.weight_select, m, n)
        return out
