"""The typed interface of the policy loss: what a method contributes (``Masks`` per call, ``LossOverrides`` to the
settings), what one call reads (``LossInputs``, checked when built), how the loss is set (``LossSettings``, validated
once when built) and what it returns (``LossOutputs``: the loss with its graph, and the metrics as tensors until
``read_metrics`` turns those of a whole update into numbers, in one transfer, where the step logs them).

    settings = LossSettings(eps_low=0.2, eps_high=0.28, agg="token-mean")      # once, where the engine sets up
    settings = method.loss_overrides().apply(settings)                          # the method's own (clip-higher, ...)
    out = compute_policy_loss(LossInputs(logp, old_logp, adv, mask, Masks(keep=keep)), settings)
    out.loss.backward(); outs.append(out)                                      # per micro-batch: nothing read
    rows, _ = read_metrics([o.pending() for o in outs])                        # once per update: one transfer

``core.loss.compute_policy_loss`` is the maths; ``core.loss.policy_loss`` is the keyword call that builds these by
field name. The aggregation modes' names and their shape rule are checked here (``check_agg``); their formulas are
``core.loss.aggregation_weights``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor

from entropy_rft.common.options import AGG_MODES, KL_ESTIMATORS
from entropy_rft.core.tensor_checks import as_mask, broadcast_advantages, check_bool_like, check_like, is_number

__all__ = [
    "UNSET",
    "Agg",
    "ClipRegions",
    "KLEstimator",
    "LossInputs",
    "LossOutputs",
    "LossOverrides",
    "LossSettings",
    "MASK_FIELDS",
    "Masks",
    "PendingMetrics",
    "check_agg",
    "host_floats",
    "ratio_clip",
    "read_metrics",
]

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

    def map(self, fn: Callable[[Tensor], Tensor | None]) -> Masks:
        """The same masks with ``fn`` applied to each one that is set (a rank's rows, a micro-batch's, a
        width cut back); unset ones stay None."""
        return Masks(**{f.name: None if (v := getattr(self, f.name)) is None else fn(v) for f in fields(self)})

    def set_fields(self) -> tuple[str, ...]:
        """The names of the masks that are set, in field order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) is not None)


MASK_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Masks))


def _check_eps(value: Any, name: str) -> None:
    if value is not None and (not is_number(value) or not value >= 0):
        raise ValueError(f"{name} must be None or a number >= 0, got {value!r}")


def _check_coef(value: Any, name: str) -> None:
    if not is_number(value) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


def check_agg(agg: Any, mask: Tensor | None = None) -> None:
    """The aggregation mode's rule, checked in one place: ``agg`` is one of ``AGG_MODES``; the per-sequence modes
    need a mask shaped [B, T] (``mask``, when given)."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {list(AGG_MODES)}, got {agg!r}")
    if mask is not None and agg != "token-mean" and mask.dim() < 2:
        raise ValueError(f"agg={agg!r} needs a mask shaped [B, T], got {tuple(mask.shape)}")


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
        check_agg(self.agg)
        for name in ("kl_cov_coef", "ref_kl_coef", "entropy_coef"):
            _check_coef(getattr(self, name), name)
        if self.ref_kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"ref_kl_estimator must be one of {list(KL_ESTIMATORS)}, got {self.ref_kl_estimator!r}")

    def kwargs(self) -> dict[str, Any]:
        """The settings as ``policy_loss`` keywords (by field name)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET  # a ``LossOverrides`` field the method leaves to the engine


@dataclass(frozen=True)
class LossOverrides:
    """A method's own loss settings (``Method.loss_overrides``): each field it sets replaces the ``LossSettings``
    field of the same name; ``UNSET`` leaves the engine's. Clip-higher and clip-low set the clip, KL-Cov takes it
    off and sets its coefficient, the entropy bonus its coefficient, CE-GPPO its β, EntroPIC its α. A method never
    sets the aggregation, the dual clip or the reference KL: those are the engine's."""

    eps_low: float | None | _Unset = UNSET
    eps_high: float | None | _Unset = UNSET
    kl_cov_coef: float | _Unset = UNSET
    entropy_coef: float | _Unset = UNSET
    ce_beta_low: float | _Unset = UNSET
    ce_beta_high: float | _Unset = UNSET
    weight_alpha: float | _Unset = UNSET

    def kwargs(self) -> dict[str, Any]:
        """The fields the method sets, by name (``Method.loss_kwargs``)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not UNSET}

    def apply(self, settings: LossSettings) -> LossSettings:
        """``settings`` with the fields the method sets replaced, by name (validated as any ``LossSettings``);
        ``settings`` itself when it sets none."""
        changes = self.kwargs()
        return replace(settings, **changes) if changes else settings


def ratio_clip(settings: LossSettings | Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(eps_low, eps_high) of the loss's settings, or of their keywords by name (a side not named: None, unclipped),
    for the selections that read the clip (``loss.ppo_clipped_mask``)."""
    if isinstance(settings, LossSettings):
        return settings.eps_low, settings.eps_high
    return settings.get("eps_low"), settings.get("eps_high")


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
        check_agg(s.agg, self.mask)
        if s.kl_cov_coef != 0 and self.masks.kl_cov_select is None:
            raise ValueError("kl_cov_coef is non-zero but kl_cov_select is None (pass the KL-Cov selection)")
        if s.ref_kl_coef != 0 and self.ref_logp is None:
            raise ValueError("ref_kl_coef is non-zero but ref_logp is None")
        if s.entropy_coef != 0 and self.entropy is None:
            raise ValueError("entropy_coef is non-zero but entropy is None")


class ClipRegions(NamedTuple):
    """Where PPO's ratio clip removes a token's gradient (``loss.clip_regions``), bool like the mask."""

    low: Tensor  # A < 0 and r < 1 − eps_low
    high: Tensor  # A > 0 and r > 1 + eps_high
    dual: Tensor | None = None  # A < 0 and r > c (only with a dual clip)


def host_floats(tensors: Sequence[Tensor]) -> list[float]:
    """The numbers of one-element tensors, in one device-to-host transfer (one host sync): stacked in float64,
    which holds every float32, bfloat16 and float16 value and every integer count below 2**53 exactly, so each
    number is the one ``float(t)`` reads."""
    if not tensors:
        return []
    device = tensors[0].device
    return torch.stack([t.detach().reshape(()).to(device, torch.float64) for t in tensors]).tolist()


_Read = Literal["value", "frac", "tokens", "of_valid"]


@dataclass(frozen=True)
class PendingMetrics:
    """One loss call's metrics before their numbers leave the device (``LossOutputs.pending``): ``n``, the counted
    tokens (a host number: the compaction of the counted tokens sized it), the response tokens as a tensor, and per
    metric, in row order, how it is read and from which one-element tensor: ``value`` the number itself, ``frac``
    a count over n (both None with no counted token or no tensor), ``tokens`` n, ``of_valid`` n over the response
    tokens. ``finish`` makes the row from the numbers ``host_floats`` read of ``tensors()``."""

    n: int
    n_valid: Tensor
    reads: dict[str, tuple[_Read, Tensor | None]]

    def tensors(self) -> list[Tensor]:
        """What the row is read from, in the order ``finish`` takes the numbers."""
        return [self.n_valid, *(x for _, x in self.reads.values() if x is not None)]

    def finish(self, numbers: Iterator[float]) -> dict[str, float | None]:
        """The metrics row from the numbers of ``tensors()`` (taken from ``numbers`` in that order)."""
        n, n_valid = self.n, int(next(numbers))
        out: dict[str, float | None] = {}
        for name, (how, x) in self.reads.items():
            if how == "tokens":
                out[name] = float(n)
            elif how == "of_valid":
                out[name] = n / n_valid if n_valid else None
            elif x is None:
                out[name] = None
            else:
                v = next(numbers)
                out[name] = v / n if how == "frac" else v
        return out


def read_metrics(pending: Sequence[PendingMetrics], extra: Sequence[Tensor] = ()
                 ) -> tuple[list[dict[str, float | None]], list[float]]:
    """The rows of many loss calls (an update's micro-batches) and the numbers of ``extra`` one-element tensors (a
    gradient norm, a critic loss), read in one transfer (``host_floats``): one host sync for all of them."""
    numbers = iter(host_floats([t for p in pending for t in p.tensors()] + list(extra)))
    rows = [p.finish(numbers) for p in pending]
    return rows, list(numbers)


@dataclass
class LossOutputs:
    """The loss (a scalar with its graph) and what its metrics are made of, detached, still on the device:
    ``pending()`` gathers them as tensors, ``read_metrics`` reads those of a whole update at once, so nothing is read
    per micro-batch or per term (``metrics()``: one call's alone)."""

    loss: Tensor
    terms: dict[str, Tensor | None]  # loss/total, loss/pg, loss/kl_cov, loss/kl_ref, kl/ref, loss/entropy_bonus
    counted: Tensor  # m = mask & keep, bool
    valid: Tensor  # the response mask
    ratio: Tensor  # r, detached
    clipped: ClipRegions  # where the ratio clip removes the gradient (low, high; dual with a dual clip)
    masks: Masks  # the method's, as the loss read them
    ce: Tensor | None = None  # the tokens CE-GPPO's term reached (None: term off)
    weight_adjust: Tensor | None = None  # EntroPIC's term (None: off)

    def pending(self) -> PendingMetrics:
        """The metrics as one-element tensors, over the counted tokens m (names: ``entropy_rft.common.metric_names``):
        ``loss/total``, ``loss/pg``, ``loss/kl_cov``, ``loss/kl_ref`` (coefficient-weighted contributions that sum to
        ``loss/total``), ``kl/ref`` (the raw aggregated estimate), ``loss/entropy_bonus``, ``clip/ratio_low_frac``,
        ``clip/ratio_high_frac``, ``clip/ratio_frac``, ``clip/dual_frac``, ``ratio/mean``, ``ratio/max``,
        ``ratio/min``, ``loss/counted_frac`` (Σm/Σmask), ``loss/zeroed_frac`` and ``control/kl_cov_selected_frac``,
        ``tokens/counted``; with their terms ``loss/adv_shift_mean``, ``clip/ce_frac``, ``loss/weight_adjust`` and
        ``control/weight_selected_frac``. Each is None when no token counts or its term is absent. The counted
        tokens are compacted once (their count sizes the result: on CUDA a wait for the device, no transfer)."""
        m, c, mk = self.counted, self.clipped, self.masks
        at = m.reshape(-1).nonzero().squeeze(-1)  # the counted tokens in order: x.reshape(-1)[at] is x[m]
        n = at.numel()

        def count(x: Tensor | None) -> tuple[_Read, Tensor | None]:
            return "frac", None if x is None or n == 0 else (x & m).sum()

        def value(x: Tensor | None) -> tuple[_Read, Tensor | None]:
            return "value", None if x is None or n == 0 else x

        rm = self.ratio.reshape(-1)[at]  # every tensor here is detached: no graph is built
        reads: dict[str, tuple[_Read, Tensor | None]] = {k: value(v) for k, v in self.terms.items()}
        reads.update({
            "clip/ratio_low_frac": count(c.low),
            "clip/ratio_high_frac": count(c.high),
            "clip/ratio_frac": count(c.low | c.high),
            "clip/dual_frac": count(c.dual),
            "ratio/mean": value(rm.to(torch.float64).mean() if n else None),
            "ratio/max": value(rm.max() if n else None),
            "ratio/min": value(rm.min() if n else None),
            "loss/counted_frac": ("of_valid", None),
            "loss/zeroed_frac": count(mk.zeroed),
            "control/kl_cov_selected_frac": count(mk.kl_cov_select),
            "tokens/counted": ("tokens", None),
        })
        if mk.adv_shift is not None:
            shift = mk.adv_shift.detach().to(torch.float64).reshape(-1)[at].mean() if n else None
            reads["loss/adv_shift_mean"] = value(shift)
        if self.ce is not None:
            reads["clip/ce_frac"] = count(self.ce)
        if mk.weight_select is not None:
            reads["loss/weight_adjust"] = value(self.weight_adjust)
            reads["control/weight_selected_frac"] = count(mk.weight_select)
        return PendingMetrics(n, self.valid.sum(), reads)

    def metrics(self) -> dict[str, float | None]:
        """This call's metrics as numbers (``pending``), read in one transfer; an update reads all of its calls'
        together (``read_metrics``)."""
        rows, _ = read_metrics([self.pending()])
        return rows[0]
