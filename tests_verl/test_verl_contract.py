"""The contract between erft's verl plug-in (``entropy_rft.integrations.verl``) and the installed verl (0.9.1): every
hook of verl the plug-in overrides, registers into or calls exists with the parameter names it relies on, and
the config fields and per-batch keys it reads are verl's. A verl release that renames or removes one fails here,
naming it, before a job meets it (the tested-version pin, ``check_verl_version``, is the other guard).

How a break shows: ``contract_breaks`` reads each name with ``getattr`` and the parameters with
``inspect.signature``, so a removed hook is "missing" and a renamed or reordered parameter differs from the
table; ``test_a_renamed_or_removed_hook_is_a_break`` runs it on fake classes that do exactly that.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from verl.single_controller.base.decorator import MAGIC_ATTR, register
from verl.trainer.ppo import core_algos
from verl.trainer.ppo import v1 as verl_v1
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils import tensordict_utils
from verl.workers import engine_workers
from verl.workers.config import FSDPActorConfig, PolicyLossConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils import losses, padding

import entropy_rft.integrations.verl as ev
from entropy_rft.integrations.verl_conventions import VERL_KEYS

# (owner, hook) -> the parameters (self excluded) erft relies on, and how:
#   "prefix": the first parameters, in this order (erft passes them positionally, or verl passes them to ours so);
#   "names": present, in any order (passed or read by name).
HOOKS: dict[tuple[object, str], tuple[str, tuple[str, ...]]] = {
    # overridden by erft's subclasses
    (engine_workers.ActorRolloutRefWorker, "init_model"): ("prefix", ()),
    (engine_workers.ActorRolloutRefWorker, "compute_log_prob"): ("prefix", ("data",)),
    (engine_workers.ActorRolloutRefWorker, "update_actor"): ("prefix", ("data",)),
    (FSDPEngineWithLMHead, "prepare_model_outputs"): ("prefix", ("output", "output_args", "micro_batch",
                                                                "logits_processor_func")),
    (PPOTrainerSync, "_init_resource_pool_mgr"): ("prefix", ()),
    # called only
    (FSDPEngineWithLMHead, "_gather_and_unpad_packed"): ("prefix", ("tensor", "pad_size")),  # gather(t, pad_size)
    (engine_workers.TrainingWorker, "set_loss_fn"): ("names", ("loss_fn",)),
    (core_algos, "register_policy_loss"): ("prefix", ("name",)),
    (verl_v1, "register_trainer"): ("prefix", ("name",)),
    (verl_v1, "get_trainer_cls"): ("prefix", ("name",)),
    (losses, "ppo_loss"): ("prefix", ("config", "model_output", "data", "dp_group")),
    (padding, "no_padding_2_padding"): ("prefix", ("tensor", "data")),
    (tensordict_utils, "get_non_tensor_data"): ("names", ("data", "key", "default")),
    (tensordict_utils, "assign_non_tensor"): ("prefix", ("tensor_dict",)),
}
OVERRIDDEN = {(engine_workers.ActorRolloutRefWorker, "init_model"), (engine_workers.ActorRolloutRefWorker,
              "compute_log_prob"), (engine_workers.ActorRolloutRefWorker, "update_actor"),
              (FSDPEngineWithLMHead, "prepare_model_outputs"), (PPOTrainerSync, "_init_resource_pool_mgr")}
# verl calls a registered policy loss with these keywords (verl.workers.utils.losses.ppo_loss)
POLICY_LOSS_PARAMS = ("old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config",
                      "rollout_is_weights")
# actor config fields the loss and the worker read (verl_conventions, ErftActorRolloutRefWorker)
ACTOR_FIELDS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "global_batch_info",
                "policy_loss", "calculate_entropy", "data_loader_seed", "strategy")
# keys of verl's engine forward that the statistics pass reads (verl_stats.stats_model_output)
OUTPUT_ARGS = ("input_ids_rmpad_rolled", "temperature_rmpad", "temperature_is_one", "pad_size")


def _self_bound(owner: object, name: str) -> bool:
    """Whether ``owner.name`` is a method looked up on a class (its first parameter is self)."""
    return isinstance(owner, type) and not isinstance(inspect.getattr_static(owner, name, None), staticmethod)


def contract_breaks(hooks: dict[tuple[object, str], tuple[str, tuple[str, ...]]]) -> list[str]:
    """Each way the owners break ``hooks``: a hook missing, or its parameters not those erft relies on."""
    out = []
    for (owner, name), (how, want) in hooks.items():
        where = f"{getattr(owner, '__name__', owner)}.{name}"
        fn = getattr(owner, name, None)
        if not callable(fn):
            out.append(f"{where}: missing")
            continue
        have = tuple(inspect.signature(fn).parameters)[1 if _self_bound(owner, name) else 0:]
        ok = have[:len(want)] == want if how == "prefix" else set(want) <= set(have)
        if not ok:
            out.append(f"{where}{have}: erft relies on {how} {want}")
    return out


def test_verls_hooks_have_the_parameters_erft_relies_on():
    assert contract_breaks(HOOKS) == []


def test_a_renamed_or_removed_hook_is_a_break():
    """The check fails on a verl whose hook is gone, renamed, or has a parameter renamed or moved."""

    class Engine:  # prepare_model_outputs with its parameters swapped; no _gather_and_unpad_packed
        def prepare_model_outputs(self, output, micro_batch, output_args, logits_processor_func): ...

    class FakeLosses:  # ppo_loss(cfg, ...): its first parameter renamed
        @staticmethod
        def ppo_loss(cfg, model_output, data, dp_group=None): ...

    swap = {FSDPEngineWithLMHead: Engine, losses: FakeLosses}
    breaks = contract_breaks({(swap.get(o, o), n): v for (o, n), v in HOOKS.items()})
    assert len(breaks) == 3, breaks
    for what in ("Engine.prepare_model_outputs", "Engine._gather_and_unpad_packed: missing", "FakeLosses.ppo_loss"):
        assert any(what in b for b in breaks), (what, breaks)


def test_the_registered_losses_take_what_verl_passes():
    """A registered erft loss takes the keywords verl's ``ppo_loss`` passes, which are the parameters of verl's
    own ``vanilla`` loss, and verl's ``ppo_loss`` does pass them by those names."""
    vanilla = tuple(inspect.signature(core_algos.POLICY_LOSS_REGISTRY["vanilla"]).parameters)
    assert vanilla == POLICY_LOSS_PARAMS
    ours = inspect.signature(core_algos.get_policy_loss_fn("erft_clip_v"))
    ours.bind(**{p: None for p in POLICY_LOSS_PARAMS})  # TypeError: ours lacks one of them
    source = inspect.getsource(losses.ppo_loss)
    assert all(f"{p}=" in source for p in POLICY_LOSS_PARAMS)


def test_the_worker_overrides_are_the_pinned_ones_and_keep_verls_dispatch():
    """Every method of erft's worker, statistics engine and trainer that shadows verl's is pinned above and takes every
    parameter verl's own takes, by the same names; verl's ``register`` takes the dispatch attributes the worker's
    overrides copy (``parent_dispatch``)."""
    register_params = set(inspect.signature(register).parameters)
    for parent, ours in ((engine_workers.ActorRolloutRefWorker, ev.ErftActorRolloutRefWorker),
                         (FSDPEngineWithLMHead, ev._stats_engine_class(FSDPEngineWithLMHead)),
                         (PPOTrainerSync, verl_v1.get_trainer_cls("erft_sync"))):
        shadowing = {n for n, v in vars(ours).items() if callable(v) and hasattr(parent, n)}
        assert shadowing == {n for (o, n) in OVERRIDDEN if o is parent}, (ours, shadowing)
        for name in shadowing:
            theirs = list(inspect.signature(getattr(parent, name)).parameters)[1:]
            inspect.signature(getattr(ours, name)).bind(None, **{p: None for p in theirs})
            if parent is engine_workers.ActorRolloutRefWorker:
                assert set(getattr(getattr(parent, name), MAGIC_ATTR)) <= register_params, name


def test_what_the_worker_replaces_is_where_verl_builds_it():
    """``init_model`` takes verl's actor config from the loss function verl built (a ``partial`` with
    ``config=actor_config``) and hands its own to ``self.actor.set_loss_fn``; the engine it may swap is
    ``self.actor.engine``; the trainer's actor roles live in ``role_worker_mapping``."""
    init = inspect.getsource(engine_workers.ActorRolloutRefWorker.init_model)
    assert "self.loss_fn = partial(ppo_loss, config=actor_config)" in init
    assert "self.actor.set_loss_fn(self.loss_fn)" in init
    assert "self.engine" in inspect.getsource(engine_workers.TrainingWorker)
    assert "self.role_worker_mapping" in inspect.getsource(PPOTrainerSync._init_resource_pool_mgr)


def test_config_fields_and_forward_keys_are_verls():
    actor = {f.name for f in dataclasses.fields(FSDPActorConfig)}
    assert set(ACTOR_FIELDS) <= actor, sorted(set(ACTOR_FIELDS) - actor)
    policy = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    wanted = {"loss_mode"} | {k for keys in VERL_KEYS.values() for k in keys}
    assert wanted <= policy, sorted(wanted - policy)
    forward = inspect.getsource(FSDPEngineWithLMHead)
    for key in OUTPUT_ARGS:
        assert key in forward, key


@pytest.mark.parametrize("name", ["erft_clip_v", "clip_v", "erft_none"])
def test_the_registry_entries_are_added_not_replacing_verls(name):
    """Importing the plug-in adds entries; verl's own losses keep theirs."""
    assert ev.loss_names()[name] in ("clip_v", "none")
    assert core_algos.POLICY_LOSS_REGISTRY["vanilla"].__module__.startswith("verl.")
    for own in ("clip_cov", "kl_cov"):
        assert core_algos.POLICY_LOSS_REGISTRY[own].__module__.startswith("verl."), own
    assert verl_v1.get_trainer_cls("erft_sync").__name__ == "ErftPPOTrainerSync"
