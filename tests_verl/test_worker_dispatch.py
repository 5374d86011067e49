"""The worker's overrides keep verl's dispatch: Ray's worker group binds only methods that carry
``@register``'s attribute, so an override without it (``init_model``, ``compute_log_prob``, ``update_actor``) is
unreachable from the trainer and ``trainer_mode=erft_sync`` dies at start-up with
``'RayWorkerGroup' object has no attribute 'init_model'``. Checked without Ray: the attribute itself, and the
method names verl's own ``WorkerGroup._bind_worker_method`` binds."""

from __future__ import annotations

import inspect

from verl.single_controller.base.decorator import MAGIC_ATTR
from verl.single_controller.base.worker_group import WorkerGroup
from verl.workers.engine_workers import ActorRolloutRefWorker

from entropy_rft.integrations.verl import ErftActorRolloutRefWorker


def overrides() -> list[str]:
    """Methods the erft worker defines itself that the parent also defines."""
    own = ErftActorRolloutRefWorker.__dict__
    return sorted(n for n, v in own.items() if inspect.isfunction(v) and hasattr(ActorRolloutRefWorker, n))


def test_every_override_carries_its_parents_dispatch():
    names = overrides()
    assert {"init_model", "compute_log_prob", "update_actor"} <= set(names), names
    for name in names:
        parent = getattr(getattr(ActorRolloutRefWorker, name), MAGIC_ATTR, None)
        ours = getattr(getattr(ErftActorRolloutRefWorker, name), MAGIC_ATTR, None)
        assert parent is not None, name  # every overridden method is a registered one in verl 0.9
        assert ours == parent, (name, ours, parent)


def bound_names(cls: type) -> set[str]:
    """The method names verl's worker group binds for ``cls`` (its own ``_bind_worker_method``)."""
    group = WorkerGroup.__new__(WorkerGroup)
    group.execute_all = group.execute_rank_zero = lambda *a, **k: None  # execute functions are looked up by name

    def func_generator(self, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
        return method_name

    return set(group._bind_worker_method(cls, func_generator))


def test_verls_worker_group_binds_the_same_methods_as_for_the_parent():
    ours, parent = bound_names(ErftActorRolloutRefWorker), bound_names(ActorRolloutRefWorker)
    assert {"init_model", "compute_log_prob", "update_actor"} <= parent
    assert ours == parent, sorted(parent ^ ours)
