"""Task registry: ``build_task(name, **params)``, ``available_tasks()``, ``register_task(...)``.

A name is a registered task (``"countdown"``), ``"rg:<dataset>"`` for any reasoning-gym dataset
(:mod:`entropy_rft.tasks.rg`), or an import path ``"package.module:ClassName"`` to any
:class:`~entropy_rft.tasks.base.Task` subclass (or factory returning one).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

from entropy_rft.tasks.base import Example, Task
from entropy_rft.tasks.rg import PREFIX

__all__ = ["Example", "Task", "available_tasks", "build_task", "register_task", "task_factory"]

TaskFactory = Callable[..., Task]

# name -> "module:attr" (resolved lazily, so importing the package stays cheap) or a factory.
_REGISTRY: dict[str, str | TaskFactory] = {
    "countdown": "entropy_rft.tasks.countdown:CountdownTask",
    "math": "entropy_rft.tasks.math:math_task",
    "dapo_math_17k": "entropy_rft.tasks.math:dapo_math_17k",
    "dapo500": "entropy_rft.tasks.math:dapo500",
    "aime24": "entropy_rft.tasks.math:aime24",
    "aime25": "entropy_rft.tasks.math:aime25",
    "amc23": "entropy_rft.tasks.math:amc23",
    "math500": "entropy_rft.tasks.math:math500",
    "champ": "entropy_rft.tasks.math:champ",
    "gsm_symbolic": "entropy_rft.tasks.math:gsm_symbolic",
}


def register_task(name: str, factory: TaskFactory | str, *, overwrite: bool = False) -> None:
    """Register ``factory`` (a Task subclass, a callable returning a Task, or a ``"module:attr"`` path)."""
    if not name or ":" in name:
        raise ValueError(f"invalid task name {name!r}: must be non-empty and contain no ':'")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"task {name!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[name] = factory


def available_tasks() -> list[str]:
    """The registered task names, sorted."""
    return sorted(_REGISTRY)


def _import_path(path: str) -> TaskFactory:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"invalid task import path {path!r}: expected 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for task {path!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (task {path!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"task {path!r} is not a class or callable")
    return obj


RG_PREFIX = PREFIX  # "rg:<dataset>": any reasoning-gym dataset


def task_factory(name: str) -> TaskFactory:
    """The factory behind a task name: registered, ``"rg:<dataset>"`` or ``"module.path:ClassName"``.

    Raises ``ValueError`` listing the known names when ``name`` is unknown.
    """
    if name in _REGISTRY:
        entry = _REGISTRY[name]
        return _import_path(entry) if isinstance(entry, str) else entry
    if name.startswith(RG_PREFIX):
        from entropy_rft.tasks.rg import ReasoningGymTask, available_datasets

        dataset = name[len(RG_PREFIX):]
        if dataset not in available_datasets():
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; available: {', '.join(available_datasets())}")
        return functools.partial(ReasoningGymTask, dataset)
    if ":" in name:
        return _import_path(name)
    known = ", ".join(available_tasks())
    raise ValueError(f"unknown task {name!r}; known tasks: {known}, rg:<reasoning-gym dataset> "
                     "(or 'package.module:ClassName')")


def build_task(name: str, **params) -> Task:
    """Build a task by registered name, ``"rg:<dataset>"`` or ``"module.path:ClassName"``.

    Raises ``ValueError`` listing the known names when ``name`` is unknown.
    """
    task = task_factory(name)(**params)
    if not isinstance(task, Task):
        raise ValueError(f"task {name!r} built a {type(task).__name__}, not an entropy_rft Task")
    return task
