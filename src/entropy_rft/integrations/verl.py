"""verl integration: entropy-rft's methods as verl policy losses, plus the small extension that carries the
old-policy TokenStats from the actor's forward to the loss.

Tested with verl 0.9.x (model-engine workers, ``trainer.use_v1``). Thin by design: the statistics come from
``dynamics.token_stats``, the masks from ``control`` (the method registry, and ``control.select_minibatch``,
the minibatch rule all engines share), the loss from ``loss.compute_policy_loss``. verl is not forked, and no module,
class or function of verl is modified. Three layers, each usable without the next:

1. **Policy losses** (``verl.trainer.ppo.core_algos.register_policy_loss``). Importing this module registers
   every entropy-rft method as ``erft_<name>`` (``erft_clip_v``, ``erft_clip_cov``, ...; a method registered
   after the import too, ``control.on_register``) and, where verl has no loss of that name, also under the plain
   name (``clip_b``, ``clip_v``, ``clip_b_paper``, ``clip_v_paper``,
   ``high_entropy``, ``grad_mask``, ``clip_higher``, ``entropy_bonus``). verl's own ``clip_cov``/``kl_cov``/
   ``vanilla`` keep their names. Select one with ``actor_rollout_ref.actor.policy_loss.loss_mode``. Import it
   in every verl process with ``actor_rollout_ref.model.external_lib=entropy_rft.integrations.verl`` (verl's
   ``HFModelConfig`` imports it) or ``VERL_USE_EXTERNAL_MODULES=entropy_rft.integrations.verl``.
   Each loss is ``compute_policy_loss`` with verl's ratio clip (``clip_ratio_low/high``, dual clip ``clip_ratio_c``)
   and the method's masks, rescaled to verl's global-batch normalisation (``config.global_batch_info``).
   Minibatch-stage methods (Clip-Cov, KL-Cov) work with the loss alone; rollout-stage methods (ClipB, ClipV,
   80/20, grad-mask) need layer 2 and raise a clear error without it.
2. **Micro-batch extras** (``erft_ppo_loss``): a drop-in for verl's ``workers.utils.losses.ppo_loss`` that
   reads entropy-rft's per-token fields (``erft_keep``) and the current entropy from verl's micro-batch and
   model output, hands them to the registered loss, then calls verl's own ``ppo_loss``.
3. **Worker and trainer** (``ErftActorRolloutRefWorker``, trainer ``trainer.v1.trainer_mode=erft_sync``):
   the old-policy pass (``compute_log_prob``) also returns TokenStats (``erft_entropy``, ``erft_s_star``,
   ``erft_s_expected``, ``erft_s_centered``, via ``dynamics.token_stats`` on the logits verl already has);
   ``update_actor`` all-gathers them with the advantages over the data-parallel ranks, builds the
   rollout-stage keep mask once per rollout batch over the *global* batch (``control``), folds it into
   ``loss_mask`` (so verl's global token count counts only kept tokens) and stores it as ``erft_keep``;
   the loss function is ``erft_ppo_loss``. The trainer only swaps the actor worker class (as verl's own
   ``separate_async`` trainer does) and is registered with ``verl.trainer.ppo.v1.register_trainer``.

What is per micro-batch or per rank (docs/verl.md): ClipB/ClipV/80-20/grad-mask select once per rollout
batch over all ranks (exact). Clip-Cov/KL-Cov select inside verl's loss hook, which sees one micro-batch:
per micro-batch, but over all data-parallel ranks (all-gather; verl gives every rank the same number of
micro-batches); per rank when the world is not the data-parallel group (sequence/tensor parallel).
Layer 3 is unit-tested piece by piece on CPU and runs inside real ``main_ppo`` jobs on CPU in CI (Ray, 1 and 2
FSDP ranks, a transformers rollout: ``tests_verl/test_real_job.py``); not on GPUs with vLLM/SGLang.

What erft changes in a verl process at run time, all of it in the processes that import this module (not
importing it, i.e. no ``external_lib`` / ``VERL_USE_EXTERNAL_MODULES``, turns every item off):

- on import: entries *added* to two of verl's registries, none replaced: the policy-loss registry
  (``core_algos.POLICY_LOSS_REGISTRY`` through ``register_policy_loss``: ``erft_<method>``, and the plain method
  names verl lacks) and the v1 trainer registry (``register_trainer("erft_sync")``). A run whose ``loss_mode`` and
  ``trainer.v1.trainer_mode`` name none of them runs verl's code only;
- a ``loss_mode`` of ours: verl's ``ppo_loss`` calls our function, found in its registry by that name;
- ``trainer_mode=erft_sync``: our subclass of verl's ``PPOTrainerSync`` maps the actor roles (Actor,
  ActorRollout, ActorRolloutRef) of its own ``role_worker_mapping`` to ``ErftActorRolloutRefWorker``, a subclass
  of verl's ``ActorRolloutRefWorker``. In that worker, after verl's ``init_model``: its loss function
  (``self.loss_fn``, handed to ``self.actor.set_loss_fn``) becomes ``erft_ppo_loss`` on verl's actor config
  (verl's ``ppo_loss`` inside; it takes the place of the ``ppo_loss`` or distillation loss verl built); and, for
  a rollout-stage method only (ClipB, ClipV, 80/20, grad-mask), the class of the live engine object
  ``self.actor.engine`` is swapped (``engine.__class__ = ErftStats<its class>``, a subclass made at that moment
  by ``_stats_engine_class``) so that its ``prepare_model_outputs`` also returns TokenStats when a micro-batch
  asks. That one object changes class; verl's engine class and every other object stay as they are. Per
  batch the worker adds keys to verl's batches: ``erft_token_stats`` (non-tensor) before the old-policy pass,
  whose outputs then carry ``erft_entropy``, ``erft_s_star``, ...; ``erft_keep`` before the update, folded into
  ``loss_mask``. To keep verl's own worker and engine, run another ``trainer_mode`` (layer 1 alone), or a
  method without rollout-stage selection (no engine swap).

The verl-free pieces live beside this module and stay importable from it: ``integrations.verl_conventions``
(verl's actor config as the loss's ``LossSettings``, ``global_scale``) and ``integrations.verl_stats`` (layer 3's
``stats_model_output`` and ``rollout_keep``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from entropy_rft.control.registry import Method, build_method, get_method_class, on_register
from entropy_rft.control.selection import MinibatchSelection, combine_selection, select_minibatch
from entropy_rft.core.loss import compute_policy_loss, ppo_clipped_mask
from entropy_rft.core.loss_types import LossInputs, LossSettings, ratio_clip
from entropy_rft.integrations._compat import require_version
from entropy_rft.integrations.dist import all_gather_rows, rank_and_world
from entropy_rft.integrations.dist_select import dist_minibatch_masks
from entropy_rft.integrations.verl_conventions import (
    VERL_KEYS,
    config_value,
    global_scale,
    params_from_verl_keys,
    settings_from_config,
)
from entropy_rft.integrations.verl_stats import PREFIX, STATS_FIELDS, rollout_keep, stats_model_output

# verl versions this integration was tested with (the loss signature and engine internals change often).
VERL_MIN, VERL_MAX_EXCLUSIVE = (0, 9, 0), (0, 10, 0)

__all__ = [
    "ErftActorRolloutRefWorker",
    "MicroBatchExtras",
    "check_verl_version",
    "configure",
    "configured_method",
    "erft_ppo_loss",
    "global_scale",
    "loss_names",
    "make_policy_loss",
    "rollout_keep",
    "stats_model_output",
]


def check_verl_version(version: str) -> None:
    """Raise ImportError unless verl ``version`` lies in [VERL_MIN, VERL_MAX_EXCLUSIVE)."""
    require_version("verl", version, VERL_MIN, VERL_MAX_EXCLUSIVE, hint=" (see constraints-verl.txt)")


import verl  # noqa: E402

check_verl_version(verl.__version__)

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss  # noqa: E402

# ----------------------------------------------------------------------------- configured methods

_METHODS: dict[str, Method] = {}
_GENERATOR: dict[str, torch.Generator] = {}


def configure(method: str, seed: int = 0, **params: Any) -> Method:
    """Set the parameters of ``method`` for this process (``control.build_method``; bad ones raise ValueError).

    Unconfigured methods use their defaults. ``seed`` seeds the generator of Clip-Cov's random pick; it must
    be the same on every rank (the worker passes ``actor_rollout_ref.actor.data_loader_seed``).
    """
    m = build_method(method, **params)
    _METHODS[method] = m
    _GENERATOR[method] = torch.Generator().manual_seed(int(seed) + 2)
    return m


def configured_method(method: str) -> Method:
    """The configured method of that name (its defaults when ``configure`` was never called for it)."""
    if method not in _METHODS:
        configure(method)
    return _METHODS[method]


def method_for_loss(method: str, config: Any) -> Method:
    """The method a loss call runs: the configured one, or for Clip-Cov and KL-Cov the one with the parameters
    of verl's own keys in ``config.policy_loss`` (``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``;
    ``kl_cov_ratio``, ``ppo_kl_coef``), read at every call: verl passes the actor config to the loss under every
    trainer, ``sync`` included, where no worker reads ``actor_rollout_ref.erft``."""
    m = configured_method(method)
    if method not in VERL_KEYS:
        return m
    current = m.params()
    params = {**current, **params_from_verl_keys(config, method)}
    if params != current:
        m = _METHODS[method] = build_method(method, **params)  # the generator keeps its seed and draws
    return m


# ----------------------------------------------------------------------------- micro-batch extras


@dataclass
class MicroBatchExtras:
    """Per-token tensors of the current micro-batch that verl's loss hook does not pass ([B, T] response
    layout): ``keep`` (rollout-stage keep mask, built on the global rollout batch) and ``entropy`` (current
    policy, with grad; for ``entropy_bonus``)."""

    keep: Tensor | None = None
    entropy: Tensor | None = None


_LOCAL = threading.local()


def _extras() -> MicroBatchExtras:
    return getattr(_LOCAL, "extras", None) or MicroBatchExtras()


class _use_extras:
    """Context manager: make ``extras`` visible to the registered loss during one micro-batch."""

    def __init__(self, extras: MicroBatchExtras) -> None:
        self.extras = extras

    def __enter__(self) -> MicroBatchExtras:
        self.prev = getattr(_LOCAL, "extras", None)
        _LOCAL.extras = self.extras
        return self.extras

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.extras = self.prev


# ----------------------------------------------------------------------------- the policy losses


def _minibatch_selection(method: Method, logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, keep: Tensor | None,
                         settings: LossSettings | Mapping[str, Any], generator: torch.Generator | None,
                         info: dict[str, Any]) -> MinibatchSelection:
    """``control.select_minibatch`` on this micro-batch of every data-parallel rank (per rank when the process
    group is larger than the data-parallel group), this rank's rows, with the loss's ratio clip (``settings``'s,
    ``ratio_clip``). Only a minibatch-stage method needs the other ranks, as its ``exchange`` declares
    (``integrations.dist_select``): Clip-Cov and KL-Cov exchange sums, counts and top-k candidates, a per-token
    rule selects on this rank's rows, any other is all-gathered."""
    _, world = rank_and_world()
    gather = method.stage == "minibatch" and world > 1 and int(info.get("dp_size") or 1) == world
    cur, old, adv = logp.detach().float(), old.detach().float(), adv.detach().float()
    eps_low, eps_high = ratio_clip(settings)
    if not gather:
        return select_minibatch(cur, old, adv, mask, keep, method, eps_low, eps_high, generator)
    clipped = ppo_clipped_mask(cur, old, adv, mask, eps_low, eps_high)
    selected = dist_minibatch_masks(method, cur, adv, mask, clipped, generator, old)
    if selected is not None:  # Clip-Cov, KL-Cov: sums, counts and top-k candidates; or local (Method.exchange)
        return combine_selection(selected, mask, keep)
    g_cur, rows = all_gather_rows(cur, 0.0)
    g_old, _ = all_gather_rows(old, 0.0)
    g_adv, _ = all_gather_rows(adv, 0.0)
    g_mask, _ = all_gather_rows(mask, False)
    g_keep = None if keep is None else all_gather_rows(keep, False)[0]
    sel = select_minibatch(g_cur, g_old, g_adv, g_mask, g_keep, method, eps_low, eps_high, generator)
    width = mask.shape[-1]

    def local(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[rows, :width]

    return MinibatchSelection(sel.masks.map(local), local(sel.counted), sel.method.map(local))


def make_policy_loss(method_name: str):
    """verl policy-loss function for entropy-rft method ``method_name`` (verl's PolicyLossFn signature)."""
    get_method_class(method_name)  # unknown names fail here, listing the known ones

    def erft_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                         loss_agg_mode: str = "token-mean", config: Any = None,
                         rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        if rollout_is_weights is not None:
            raise ValueError("entropy-rft losses take no rollout importance weights; disable "
                             "algorithm.rollout_correction's token/sequence weights (policy_loss has no weight)")
        method = method_for_loss(method_name, config)
        if "verl" not in method.engines:
            raise RuntimeError(f"loss_mode {method_name!r}: method runs on engine {', '.join(method.engines)} only "
                               "(its terms are not in this loss path); pick another entropy-rft method")
        mask = response_mask.bool()
        extras = _extras()
        if method.stage == "rollout" and extras.keep is None:
            raise RuntimeError(
                f"loss_mode {method_name!r} selects tokens from old-policy TokenStats of the whole rollout "
                "batch; run verl with trainer.v1.trainer_mode=erft_sync (ErftActorRolloutRefWorker), see "
                "docs/verl.md")
        if method.needs_entropy_grad() and extras.entropy is None:
            raise RuntimeError(f"loss_mode {method_name!r} needs the current entropy: set "
                               "actor_rollout_ref.actor.calculate_entropy=True and use trainer_mode=erft_sync")
        settings = settings_from_config(config, method, loss_agg_mode)
        info = dict(config_value(config, "global_batch_info", {}) or {})
        gen = None  # the selection rule is select_minibatch; only Clip-Cov draws from the generator
        if method.stage == "minibatch":
            gen = _GENERATOR.setdefault(method_name, torch.Generator().manual_seed(2))
        masks, counted, _ = _minibatch_selection(method, log_prob, old_log_prob, advantages, mask,
                                                 None if extras.keep is None else extras.keep.bool(), settings, gen,
                                                 info)
        out = compute_policy_loss(LossInputs(log_prob, old_log_prob, advantages, mask, masks,
                                             entropy=extras.entropy if method.needs_entropy_grad() else None),
                                  settings)
        metrics = {k: v for k, v in out.metrics().items() if v is not None}  # read in one transfer
        return out.loss * global_scale(counted, loss_agg_mode, info), metrics

    erft_policy_loss.__name__ = f"erft_policy_loss_{method_name}"
    erft_policy_loss.__qualname__ = erft_policy_loss.__name__
    return erft_policy_loss


def loss_names() -> dict[str, str]:
    """verl loss_mode -> entropy-rft method, for every name this module registers."""
    return dict(_REGISTERED)


_REGISTERED: dict[str, str] = {}


def _register(cls: type[Method]) -> None:
    """``make_policy_loss`` of one method, under ``erft_<name>`` and, where verl has no loss of that name, the
    plain name."""
    name = cls.name
    fn = make_policy_loss(name)
    names = [PREFIX + name]
    plain = POLICY_LOSS_REGISTRY.get(name)
    if name != "none" and (plain is None or _REGISTERED.get(name) == name):
        names.append(name)  # verl has no loss of that name: the plain name is ours too
    for n in names:
        register_policy_loss(n)(fn)
        _REGISTERED[n] = name


on_register(_register)  # every method registered now (name order) and each one registered later


# ----------------------------------------------------------------------------- layer 2: erft_ppo_loss


def _response_layout(x: Tensor, data: Any) -> Tensor:
    """A per-token field in the padded response layout [B, T] (verl's ``no_padding_2_padding`` for
    full-sequence nested tensors, ``to_padded_tensor`` for nested response tensors)."""
    from verl.workers.utils.padding import no_padding_2_padding

    if not x.is_nested:
        return x
    in_data = "responses" in data.keys()  # noqa: SIM118  (TensorDict: membership through keys())
    if in_data and x.offsets().diff().sum() != data["responses"].offsets().diff().sum():
        return no_padding_2_padding(x, data)
    return x.to_padded_tensor(0)


def erft_ppo_loss(config: Any, model_output: dict, data: Any, dp_group: Any = None):
    """verl's ``ppo_loss`` with entropy-rft's micro-batch extras visible to the registered loss."""
    from verl.workers.utils.losses import ppo_loss

    keep = data["erft_keep"] if "erft_keep" in data.keys() else None  # noqa: SIM118
    entropy = model_output.get("entropy")
    extras = MicroBatchExtras(
        keep=None if keep is None else _response_layout(keep, data).bool(),
        entropy=None if entropy is None else _response_layout(entropy, data),
    )
    if entropy is not None and configured_method(_method_of(config)).needs_entropy_grad():
        model_output = {k: v for k, v in model_output.items() if k != "entropy"}  # our bonus, not verl's
    with _use_extras(extras):
        return ppo_loss(config, model_output, data, dp_group)


def _method_of(config: Any) -> str:
    mode = config_value(config_value(config, "policy_loss", {}), "loss_mode", "vanilla")
    return _REGISTERED.get(mode, "none")


# ----------------------------------------------------------------------------- layer 3: stats and masks


def check_stats_engine(base: type) -> None:
    """Refuse, in one line, a verl engine whose model outputs the statistics hook cannot read: it needs the
    FSDP language-model engine's ``prepare_model_outputs(output, output_args, micro_batch, ...)`` with
    untouched logits (Megatron's divides them in place and has another signature)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if not issubclass(base, FSDPEngineWithLMHead):
        raise ValueError(
            f"erft's statistics hook supports verl's FSDP language-model engine (FSDPEngineWithLMHead), not "
            f"{base.__name__}: set actor_rollout_ref.actor.strategy=fsdp2 (or fsdp), or pick a method that needs "
            "no old-policy statistics (clip_cov, kl_cov, clip_higher, entropy_bonus)")


def _stats_engine_class(base: type) -> type:
    """A subclass of verl's engine class whose forward also returns TokenStats when the micro-batch asks
    (non-tensor key ``erft_token_stats``)."""
    check_stats_engine(base)

    class ErftStatsEngine(base):
        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            out = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            from verl.utils import tensordict_utils as tu

            if tu.get_non_tensor_data(data=micro_batch, key="erft_token_stats", default=False):
                out.update(stats_model_output(output, output_args, micro_batch, self._gather_and_unpad_packed))
            return out

    ErftStatsEngine.__name__ = f"ErftStats{base.__name__}"
    return ErftStatsEngine


from verl.single_controller.base.decorator import MAGIC_ATTR, register  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402


def parent_dispatch(fn):
    """Register ``fn`` with verl's ``@register`` under the dispatch, execute and blocking modes of the method of
    the same name on ``ActorRolloutRefWorker``. Ray's worker group binds only methods that carry that
    attribute: an override without it is never callable from the trainer (``'RayWorkerGroup' object has no
    attribute 'init_model'``)."""
    attrs = getattr(getattr(ActorRolloutRefWorker, fn.__name__), MAGIC_ATTR)
    return register(**attrs)(fn)


class ErftActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker`` with entropy-rft's statistics, global masks and loss.

    Method parameters come from ``actor_rollout_ref.erft`` (``+actor_rollout_ref.erft.mu=8.5`` ...), the
    method from ``actor_rollout_ref.actor.policy_loss.loss_mode``.
    """

    @parent_dispatch
    def init_model(self):
        super().init_model()
        if self.actor is None:
            return
        params = dict(self.config.get("erft", {}) or {})
        name = _REGISTERED.get(self.config.actor.policy_loss.get("loss_mode", "vanilla"))
        if name is not None:
            check_worker_params(name, params)
            configure(name, seed=int(self.config.actor.get("data_loader_seed", 0) or 0), **params)
        self.erft_method = configured_method(name) if name is not None else None
        engine = self.actor.engine
        if self.erft_method is not None and self.erft_method.stage == "rollout":
            # only rollout-stage methods read the old-policy statistics; the others run on any engine
            engine.__class__ = _stats_engine_class(type(engine))
        actor_config = self.loss_fn.keywords["config"]
        self.loss_fn: functools.partial[Any] = functools.partial(erft_ppo_loss, config=actor_config)
        self.actor.set_loss_fn(self.loss_fn)

    @parent_dispatch
    def compute_log_prob(self, data):
        # the old-policy pass (compute_loss False, calculate_entropy True); the ref pass goes to self.ref
        from verl.utils import tensordict_utils as tu

        if self.erft_method is not None and self.erft_method.stage == "rollout":
            tu.assign_non_tensor(data, erft_token_stats=True)
        return super().compute_log_prob(data)

    @parent_dispatch
    def update_actor(self, data):
        if self.erft_method is not None and self.erft_method.stage == "rollout":
            add_rollout_keep(self.erft_method, data)
        return super().update_actor(data)


def check_worker_params(method: str, params: dict[str, Any]) -> None:
    """Refuse, in one line, an ``actor_rollout_ref.erft.<param>`` that verl's own key sets for Clip-Cov and
    KL-Cov (the loss reads ``policy_loss.clip_cov_ratio`` ..., which the key would silently lose to)."""
    verl_keys = {param: key for key, param in VERL_KEYS.get(method, {}).items()}
    clash = sorted(set(params) & set(verl_keys))
    if clash:
        raise ValueError(f"actor_rollout_ref.erft.{clash[0]}: {PREFIX}{method} reads verl's own key; set "
                         f"actor_rollout_ref.actor.policy_loss.{verl_keys[clash[0]]}=... instead")


def add_rollout_keep(method: Method, data: Any) -> None:
    """Build ``erft_keep`` for this rank's shard of the rollout batch (``rollout_keep``, global over
    ranks) and fold it into ``loss_mask`` so that verl's global token count counts kept tokens only."""
    mask = _response_layout(data["response_mask"], data).bool()
    adv = _response_layout(data["advantages"], data)
    stats = {f: _response_layout(data[PREFIX + f], data) for f in STATS_FIELDS}
    keep = rollout_keep(method, stats, adv, mask)
    data["erft_keep"] = keep
    lm = data["loss_mask"] if "loss_mask" in data.keys() else None  # noqa: SIM118
    if lm is not None and not lm.is_nested and lm.shape == keep.shape:
        data["loss_mask"] = data["loss_mask"].bool() & keep


def _register_trainer() -> None:
    from verl.trainer.ppo.v1 import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    try:
        from verl.trainer.ppo.v1 import get_trainer_cls

        get_trainer_cls("erft_sync")
        return  # already registered (module imported twice under different names)
    except ValueError:
        pass

    import ray

    @register_trainer("erft_sync")
    class ErftPPOTrainerSync(PPOTrainerSync):
        """verl's synchronous v1 trainer with ``ErftActorRolloutRefWorker`` as the actor worker."""

        def _init_resource_pool_mgr(self):
            super()._init_resource_pool_mgr()
            for role in list(self.role_worker_mapping):
                if getattr(role, "name", "").startswith("Actor"):  # Actor, ActorRollout, ActorRolloutRef
                    self.role_worker_mapping[role] = ray.remote(ErftActorRolloutRefWorker)


_register_trainer()
