"""What ``EntropyControlGRPOTrainer`` can run, decided from the ``GRPOConfig`` before any weight is read, and
how its statistics pass stays out of the training's way (dropout, random streams).

Method ``none`` hands the loss to TRL's own ``_compute_loss`` untouched, so every loss type, importance-sampling
level and option of TRL 1.16 trains exactly as stock ``GRPOTrainer``; the methods that drop or zero tokens, set
the clip or add TRL's entropy term compose into TRL's own loss inputs the same way (``composes_with_trl``). The
other methods (KL-Cov, CE-GPPO, EntroPIC, STEER) run entropy-rft's ``policy_loss`` with TRL's token-level clipped
surrogate (loss types grpo, bnpo, dr_grpo, dapo); on the other loss types and on sequence-level importance
sampling they are refused in one line, naming the pair.

Also the plug-in's own vocabulary in TRL's pipeline: its plan (``TrlPlan``, made by ``trl_plan`` for
``erft train --engine trl`` and the library alike: whose loss trains, the ``GRPOConfig`` TRL receives with the
fields a composing method sets, the loss's base settings), GRPOTrainer's arguments by name (``bound_arguments``,
``replace_argument``), what it adds to each row of TRL's generation batch (``RolloutRows``, the only keys it puts
in TRL's ``inputs``), its state of the generation batch TRL trains on (``GenerationState``) and of one hook call
(``HookCall``, ``Capture``).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from entropy_rft.control.carriage import carriage_problem
from entropy_rft.control.exchange import exchange_problem
from entropy_rft.control.registry import Method
from entropy_rft.core.dynamics import TokenStats
from entropy_rft.core.loss import clip_regions
from entropy_rft.core.loss_types import UNSET, Agg, LossSettings

if TYPE_CHECKING:
    from entropy_rft.integrations.window import Window

# TRL loss_type -> our aggregation mode (DESIGN.md, "Semantics of policy_loss").
AGG_FOR_LOSS_TYPE = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
                     "dr_grpo": "seq-mean-token-sum-norm"}


def config_loss_settings(args: Any, agg: str | None, dual_clip: float | None) -> LossSettings:
    """The loss's settings as TRL sets its loss up from the ``GRPOConfig`` ``args`` (``GRPOTrainer.__init__``): the
    clip (``epsilon``; ``epsilon_high``, which defaults to ``epsilon``), the aggregation (``agg``, or the one of TRL's
    ``loss_type``: ``AGG_FOR_LOSS_TYPE``), the dual clip, TRL's reference KL (``beta``, k3, ratio-weighted with
    ``use_bias_correction_kl``). tests/test_trl.py holds them to the attributes TRL's own ``__init__`` sets."""
    beta = float(args.beta)
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    return LossSettings(
        eps_low=args.epsilon, eps_high=eps_high, dual_clip=dual_clip,
        agg=cast(Agg, agg or AGG_FOR_LOSS_TYPE.get(args.loss_type, "token-mean")), ref_kl_coef=beta,
        ref_kl_estimator="k3", ref_kl_ratio_weighted=bool(beta and getattr(args, "use_bias_correction_kl", False)))


@dataclass(frozen=True)
class TrlPlan:
    """How ``EntropyControlGRPOTrainer`` trains a method, decided once from the caller's arguments before TRL reads
    a weight (``trl_plan``; the same function for ``erft train --engine trl`` and the library)."""

    delegated: bool  # TRL's own ``_compute_loss`` trains, the method composed into its inputs (``delegates_loss``)
    args: Any  # the ``GRPOConfig`` TRL receives: the caller's (or TRL's default), or a copy with ``config_fields``
    config_fields: Mapping[str, float]  # the GRPOConfig fields the method sets in ``args`` (``grpo_settings``)
    loss_base: LossSettings  # TRL's loss as ``args`` sets it up, the caller's own fields on top

    def loss_settings(self, method: Method) -> LossSettings:
        """The loss's settings now: ``loss_base`` with the method's own on top, read at each loss call, so a knob
        moved since the plan was made (a resume, an autopilot, ``set_knob``) is the one that trains."""
        return method.loss_overrides().apply(self.loss_base)


def default_grpo_config(model: Any) -> Any:
    """The ``GRPOConfig`` TRL builds for a trainer given no ``args``, named after ``model`` as TRL names it."""
    from trl import GRPOConfig
    from trl.trainer.utils import get_config_model_id

    name = model if isinstance(model, str) else get_config_model_id(model.config)
    return GRPOConfig(f"{name.split('/')[-1]}-GRPO")


def trl_plan(method: Method, args: Any, model: Any, agg: str | None = None, dual_clip: float | None = None,
             loss_base: Mapping[str, Any] | None = None) -> TrlPlan:
    """The trainer's plan for ``method``: whether TRL's loss trains (``delegates_loss``: the caller named none of
    erft's loss settings, ``agg`` or ``dual_clip``, and the method composes), the ``GRPOConfig`` TRL receives
    (``args``, TRL's default when None, or a copy with the method's clip or entropy coefficient when delegated:
    ``config_for_trl``) and the loss's base settings (``config_loss_settings`` of that config, ``loss_base``'s
    ``LossSettings`` fields on top: ``erft train``'s unclipped side and reference-KL estimator)."""
    delegated = delegates_loss(method, agg, dual_clip)
    fields = grpo_settings(method, args) if delegated else {}
    trl_args = config_for_trl(fields, args if args is not None else default_grpo_config(model))
    base = replace(config_loss_settings(trl_args, agg, dual_clip), **dict(loss_base or {}))
    return TrlPlan(delegated, trl_args, MappingProxyType(dict(fields)), base)


def trl_knobs(method: Method) -> dict[str, float]:
    """The method's own clip and entropy coefficient (``Method.loss_overrides``) under the names of the attributes
    TRL's ``_compute_loss`` reads them from (``epsilon_low``, ``epsilon_high``, ``entropy_coef``): those it sets."""
    own = method.loss_overrides()
    values = {"epsilon_low": own.eps_low, "epsilon_high": own.eps_high, "entropy_coef": own.entropy_coef}
    return {attr: float(v) for attr, v in values.items() if v is not UNSET and v is not None}


@functools.lru_cache(maxsize=8)
def surrogate_settings(settings: LossSettings) -> LossSettings:
    """``settings`` without the reference KL and the entropy bonus, for the ratio and clip metrics of a loss TRL
    computed; built once per settings."""
    return replace(settings, ref_kl_coef=0.0, entropy_coef=0.0)


def delegates_loss(method: Method, agg: str | None = None, dual_clip: float | None = None) -> bool:
    """Whether the loss is TRL's own ``_compute_loss``, with the method composed into its inputs: the caller asked
    for none of entropy-rft's loss settings (``agg``, ``dual_clip``: ``erft train --engine trl`` passes its
    ``algo.agg``), and the method is one that composes (``composes_with_trl``)."""
    return agg is None and dual_clip is None and composes_with_trl(method)


def composes_with_trl(method: Method) -> bool:
    """Whether ``method`` is expressed in TRL's own loss inputs, so it runs on every loss type and both
    importance-sampling levels:

    - ``none``: nothing to add;
    - a rollout-stage selection that only drops tokens (ClipB, ClipV, 80/20, grad-mask): a dropped token is a
      zero in TRL's ``tool_mask`` (the loss mask, not the attention mask), and ``num_items_in_batch`` counts the
      kept tokens, so a dropped token leaves the loss and its normaliser on every loss type, as in the authors'
      code; under sequence-level ratios (GSPO) it also leaves its sequence's mean log-ratio;
    - Clip-Cov, a minibatch-stage selection that only zeroes tokens: a zeroed token is a zero in TRL's per-token
      advantages (shape (B, T), which TRL's ``_compute_loss`` takes "to support subclasses"), so its policy term
      is 0 on every loss type while it stays in the loss mask and the normaliser, as in the authors' code (where
      the reference-KL loss is a separate term that the selection does not touch, as TRL's ``beta`` term here);
    - a static method that only sets the clip (clip-higher, clip-low): TRL's ``epsilon_low``/``epsilon_high``;
    - the entropy bonus: TRL's own ``entropy_coef`` term (the token mean of H over the loss mask, scaled for
      accumulation only, whatever the loss type).

    KL-Cov runs in entropy-rft's ``policy_loss``: it replaces the clipped surrogate by the unclipped one and adds
    coef·|log p − log p_old| on its tokens, a rule the authors state on the token-level PPO surrogate only, so
    it has no meaning on TRL's cispo, sapo, luspo and vespo losses or on sequence-level ratios. CE-GPPO's
    gradient on clipped tokens and the EntroPIC / STEER weights run there too (a term or weight of their own
    on the PPO surrogate)."""
    kw = method.loss_overrides().kwargs()
    if "trl" not in method.engines:
        return False
    if method.stage == "static":
        if method.needs_entropy_grad():
            return set(kw) == {"entropy_coef"}
        return set(kw) <= {"eps_low", "eps_high"} and all(v is not None for v in kw.values())
    if method.needs_entropy_grad() or kw:
        return False
    return method.stage in ("rollout", "minibatch")


def method_refusal(method: Method) -> str | None:
    """Why the trainer cannot run ``method``, in one line: its loss terms are not in TRL's loss path (``engines``),
    or its selection declares nothing to exchange across processes (``control.exchange``), or it sets or reads what
    an engine it names does not carry (``control.carriage``: a built method skips ``build_method``'s check); None
    when it can."""
    if "trl" not in method.engines:
        return (f"method {method.name!r} runs on engine {', '.join(method.engines)} only (its terms are not in this "
                "trainer's loss path); use another method or erft's native engine")
    return exchange_problem(type(method)) or carriage_problem(type(method))


def grpo_settings(method: Method, args: Any) -> dict[str, float]:
    """The ``GRPOConfig`` fields through which a method that composes with TRL's loss (``composes_with_trl``) sets
    it, at the method's current values: ``epsilon`` and ``epsilon_high`` (its clip), ``entropy_coef`` (its entropy
    bonus); empty for the others. A side of the clip the method leaves alone keeps ``args``' value (TRL's
    ``epsilon_high`` defaults to ``epsilon``: that default is pinned when the method moves ``epsilon`` alone)."""
    field_of = {"epsilon_low": "epsilon"}  # TRL's attribute -> the GRPOConfig field it is read from
    out = {field_of.get(attr, attr): value for attr, value in trl_knobs(method).items()}
    if "epsilon" in out and "epsilon_high" not in out and _get(args, "epsilon_high") is None:
        out["epsilon_high"] = float(_get(args, "epsilon", 0.2))
    return out


def config_for_trl(fields: Mapping[str, float], args: Any) -> Any:
    """The ``GRPOConfig`` TRL receives: ``args`` itself, or, for a method that composes into TRL's loss through
    TRL's options (``fields``: ``grpo_settings``), a copy of it with the method's values, so that TRL sets its loss
    up from them as from any config."""
    if not fields:
        return args
    ours = copy.copy(args)  # the caller's config stays as given (no second __post_init__: it is not idempotent)
    for name, value in fields.items():
        setattr(ours, name, value)
    return ours


def bound_arguments(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A method's arguments by name (``signature``: GRPOTrainer.__init__'s), bound from a call positional or by
    keyword; a call the signature refuses raises TypeError naming its parameters."""
    try:
        return dict(signature.bind(None, *args, **kwargs).arguments)  # None stands for self
    except TypeError as e:
        raise TypeError(f"EntropyControlGRPOTrainer: {e} (GRPOTrainer's parameters: "
                        f"{', '.join(list(signature.parameters)[1:])})") from None


def replace_argument(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any], name: str,
                     value: Any) -> tuple[tuple, dict[str, Any]]:
    """The call with argument ``name`` set to ``value`` where the caller put it (its position or its keyword; a
    keyword when the caller left it out)."""
    i = list(signature.parameters).index(name) - 1  # - self
    if name not in kwargs and i < len(args):
        return (*args[:i], value, *args[i + 1:]), kwargs
    return args, {**kwargs, name: value}


@dataclass(frozen=True)
class RolloutRows:
    """What the plug-in adds to each row of TRL's generation batch, set once with the batch: tensors in TRL's own
    per-micro-batch ``inputs`` (under ``KEYS``), so that TRL's shuffle and split carry them with the rows they
    belong to. TRL's loss reads none of them."""

    old_logps: torch.Tensor  # [B, T] the log-probs the minibatch selections compare against
    keep: torch.Tensor  # [B, T] the rollout-stage keep mask, chosen over all processes

    KEYS: ClassVar[tuple[str, str]] = ("erft_old_logps", "erft_keep")

    def put(self, inputs: dict[str, Any]) -> None:
        """Into a generation batch TRL has not split yet."""
        inputs[self.KEYS[0]], inputs[self.KEYS[1]] = self.old_logps, self.keep

    @classmethod
    def on(cls, inputs: Mapping[str, Any]) -> RolloutRows:
        """A training micro-batch's rows (set with its generation batch)."""
        return cls(inputs[cls.KEYS[0]], inputs[cls.KEYS[1]])

    @classmethod
    def of(cls, inputs: Mapping[str, Any]) -> RolloutRows | None:
        """A micro-batch's rows; None for a batch the plug-in did not see (evaluation)."""
        return cls.on(inputs) if cls.KEYS[1] in inputs else None


INPUT_KEYS = RolloutRows.KEYS  # the only keys the plug-in adds to TRL's inputs


@dataclass
class GenerationState:
    """The plug-in's state of the generation batch TRL trains on (its buffer of ``steps_per_generation``
    micro-batches), held by the trainer and made anew with each training generation batch."""

    # the statistics come from TRL's training forwards (on-policy: ``_defers_stats``), one micro-batch at a time
    stats_from_training: bool = False
    # per micro-batch of the buffer, its TokenStats from its training forward until the last one joins them
    parts: list[TokenStats | None] = field(default_factory=list)
    # the optimizer window being trained, built by its first micro-batch (a later pass over the buffer builds its own)
    window: Window | None = None


class Capture(enum.Enum):
    """What the override of TRL's ``_get_per_token_logps_and_entropies`` adds to TRL's own computation."""

    NOTHING = "nothing"  # TRL's computation alone (outside the hooks below; the forwards of a loss erft computes)
    # inside _generate_and_score_completions: TRL's no-grad old-policy pass of the policy (no dropout, no
    # multimodal input) also gives our TokenStats from its backbone pass
    OLD_POLICY_STATS = "old-policy statistics"
    # inside a delegated _compute_loss (TRL's own loss): keep the training forward's detached log-probs, and
    # zero the method's minibatch selection in the advantages before TRL reads them
    TRAINING_LOGPS = "training log-probs"


@dataclass
class HookCall:
    """One call of a TRL hook that ``_get_per_token_logps_and_entropies`` serves: made when the hook starts,
    read when it returns, then dropped (``EntropyControlGRPOTrainer._serving``)."""

    capture: Capture = Capture.NOTHING
    # TRAINING_LOGPS: the micro-batch whose minibatch selection (Clip-Cov) zeroes advantages, a copy of TRL's that
    # its loss reads (TRL's own stays untouched); None: no selection
    select: dict[str, Any] | None = None
    # the captured pass's log-probs (TRL's old-policy pass, or the training forward's, detached); None until it ran
    logp: torch.Tensor | None = None
    # OLD_POLICY_STATS: our TokenStats from the same backbone pass as logp
    stats: TokenStats | None = None


def model_config_of(model: Any) -> Any:
    """The model's config without reading its weights: ``model.config`` for a module, the folder's or hub id's
    config.json for a name (None when it cannot be read here: TRL reports that itself)."""
    if isinstance(model, str):
        try:
            from transformers import AutoConfig

            from entropy_rft.models.files import trust_remote_code

            return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code())
        except (OSError, ValueError):
            return None
    return getattr(model, "config", None)


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def refusals(method: Method, args: Any, model_config: Any = None, delegated: bool = False) -> list[str]:
    """The ``GRPOConfig`` options (and model features) that ``method``'s loss path does not reproduce, each as
    "option (what to do)"; empty when the trainer can run. ``args`` None stands for GRPOConfig's defaults.
    Read from the config alone, so the trainer refuses before TRL loads a model. ``delegated``: the loss is
    TRL's own (``delegates_loss``), which runs everything TRL runs."""
    trl_entropy_term = bool(_get(args, "entropy_coef", 0.0)) or bool(_get(args, "use_adaptive_entropy", False))
    if delegated:  # TRL's loss runs everything; only its entropy term would be set twice
        if method.loss_overrides().entropy_coef is not UNSET and trl_entropy_term:
            return [f"entropy_coef / use_adaptive_entropy with method {method.name!r} (the method sets TRL's "
                    "entropy_coef itself; leave them at their defaults)"]
        return []
    loss_type = _get(args, "loss_type", "dapo")
    pair = f"with method {method.name!r}"
    checks = [
        (loss_type not in AGG_FOR_LOSS_TYPE,
         f"loss_type={loss_type!r} {pair} (its token masks and terms are defined on the clipped token "
         f"surrogate of {', '.join(sorted(AGG_FOR_LOSS_TYPE))}; method 'none' runs every loss type)"),
        (_get(args, "importance_sampling_level", "token") != "token",
         f"importance_sampling_level='sequence' {pair} (a token selection inside a sequence-level ratio has no "
         "stated rule yet; method 'none' runs it)"),
        ((_get(args, "top_entropy_quantile", 1.0) or 1.0) < 1.0,
         f"top_entropy_quantile<1 {pair} (use method='high_entropy')"),
        (_get(args, "off_policy_mask_threshold") is not None, f"off_policy_mask_threshold {pair}"),
        (_get(args, "delta") is not None, f"delta {pair} (use dual_clip=...)"),
        (trl_entropy_term, f"entropy_coef / adaptive entropy {pair} (use method='entropy_bonus')"),
        (bool(_get(args, "use_vllm", False)) and bool(_get(args, "vllm_importance_sampling_correction", False)),
         f"vllm_importance_sampling_correction=True {pair} (set it to False)"),
        (bool(getattr(model_config, "output_router_logits", False)), f"MoE router aux loss {pair}"),
    ]
    return [what for failed, what in checks if failed]


def has_active_dropout(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` in its current mode draws random numbers for dropout (a ``Dropout`` module
    with p > 0 in training mode, or a config's attention dropout, which attention functions apply themselves)."""
    if not model.training:
        return False
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 and m.training:
            return True
    cfg = getattr(model, "config", None)
    return any(float(getattr(cfg, k, 0.0) or 0.0) > 0 for k in ("attention_dropout", "attn_pdrop"))


@contextlib.contextmanager
def quiet_pass(model: torch.nn.Module) -> Iterator[None]:
    """A statistics pass that the training does not see: the model in eval mode (no dropout noise in the
    statistics) and every random stream it could touch forked, so the training draws after it what stock
    TRL draws. The model's mode is restored afterwards."""
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    was = model.training
    with torch.random.fork_rng(devices=devices):
        model.eval()
        try:
            yield
        finally:
            model.train(was)


def trl_log_metrics(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    entropies: torch.Tensor, ref: torch.Tensor | None, kl_coef: float, bias_corrected_kl: bool,
                    eps_low: float, eps_high: float, accelerator: Any) -> dict[str, float]:
    """TRL's own log keys with TRL's definitions (``GRPOTrainer._compute_loss``) for a loss entropy-rft computed:
    ``entropy`` and ``kl`` (masked means over all processes' loss tokens, the KL with TRL's bias correction when
    on) and ``clip_ratio/{low_mean,high_mean,region_mean,low_min,high_max}`` with TRL's ``epsilon`` /
    ``epsilon_high``. ``accelerator`` reduces and gathers over the processes."""
    from trl.trainer.utils import nanmax, nanmin

    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv

    def global_masked_mean(x: torch.Tensor) -> float:
        totals = accelerator.reduce(torch.stack([(x * mask).sum(), mask.sum().float()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum(-1) / mask.sum(-1)

    coef_1 = torch.exp(logp - old)
    out: dict[str, float] = {}
    if kl_coef != 0.0 and ref is not None:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        out["kl"] = global_masked_mean(kl * coef_1 if bias_corrected_kl else kl)
    out["entropy"] = global_masked_mean(entropies)
    low, high, _ = clip_regions(adv, coef_1, eps_low, eps_high)  # TRL's rule is the loss's
    out["clip_ratio/low_mean"] = global_masked_mean(low.float())
    out["clip_ratio/high_mean"] = global_masked_mean(high.float())
    out["clip_ratio/region_mean"] = global_masked_mean((low | high).float())
    out["clip_ratio/low_min"] = nanmin(accelerator.gather(masked_seq_mean(low.float()))).item()
    out["clip_ratio/high_max"] = nanmax(accelerator.gather(masked_seq_mean(high.float()))).item()
    return out


def loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    """A TRL micro-batch's loss mask: ``completion_mask`` times ``tool_mask`` when TRL (or a drop) set one."""
    m, tool = inputs["completion_mask"], inputs.get("tool_mask")
    return (m if tool is None else m * tool).bool()


def model_inputs(inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A TRL micro-batch as ``_get_per_token_logps_and_entropies`` takes it: the prompt and completion ids, their
    attention mask, the completion length (``logits_to_keep``)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    return ids, am, inputs["completion_ids"].shape[1]
