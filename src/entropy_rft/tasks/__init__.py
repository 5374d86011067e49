"""Task registry: ``build_task(name, **params)``, ``available_tasks()``, ``register_task(...)``.

A name is a registered task (``"countdown"``), ``"rg:<dataset>"`` for any reasoning-gym dataset
(:mod:`entropy_rft.tasks.rg`), or an import path ``"package.module:ClassName"`` to any
:class:`~entropy_rft.tasks.base.Task` subclass (a plain function is accepted only when it is a registered factory:
the target is checked before it is called).

Code is named by the person who runs erft, never by data: an import path (the task's, or one inside its
parameters, :func:`code_references`) is taken from the command line or a ``--config`` file only. Readers of a run
directory or a dataset row check what they read with :func:`untrusted_code` before they build anything.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Collection, Mapping
from typing import Any

from entropy_rft.tasks.base import Example, Task
from entropy_rft.tasks.rg import PREFIX

__all__ = ["Example", "Task", "available_tasks", "build_task", "code_references", "is_import_path", "register_task",
           "task_factory", "untrusted_code"]

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


def is_import_path(name: Any) -> bool:
    """Whether a task name is an import path (``"package.module:ClassName"``), not a registered or ``rg:`` name."""
    return isinstance(name, str) and ":" in name and name not in _REGISTRY and not name.startswith(RG_PREFIX)


def code_references(name: Any, params: Mapping[str, Any] | None = None, field: str = "task") -> list[tuple[str, str]]:
    """The code a task spec names by import path, as ``(config field, path)`` pairs: the task itself
    (``task.name``), a custom reward function (``task.params.reward``, anything but ``"math"``) and a validation
    task (``task.params.val_task``, with its own ``val_task_params``)."""
    refs = [(f"{field}.name", name)] if is_import_path(name) else []
    params = params if isinstance(params, Mapping) else {}
    if "reward" in params and params["reward"] != "math":
        refs.append((f"{field}.params.reward", str(params["reward"])))
    if params.get("val_task") is not None:
        inner = code_references(params["val_task"], params.get("val_task_params"), f"{field}.params.val_task")
        refs += [(k.replace("val_task.name", "val_task").replace("val_task.params", "val_task_params"), v)
                 for k, v in inner]
    return refs


def untrusted_code(name: Any, params: Mapping[str, Any] | None, given: Mapping[str, str] | Collection[str]
                   ) -> list[tuple[str, str]]:
    """The code references of a task spec read from data (a run directory, a dataset row) that the person running
    erft did not name: ``given`` is what they named, ``{field: path}`` (the same path for the same field) or a
    collection of paths (any field)."""
    if isinstance(given, Mapping):
        return [(f, p) for f, p in code_references(name, params) if given.get(f) != p]
    return [(f, p) for f, p in code_references(name, params) if p not in given]


def _registered_factories() -> list[Any]:
    out: list[Any] = []
    for entry in _REGISTRY.values():
        try:
            out.append(_import_path(entry) if isinstance(entry, str) else entry)
        except ValueError:
            continue
    return out


def _checked_target(path: str) -> TaskFactory:
    """The object behind a task import path, refused unless it is a Task subclass or a registered factory (checked
    before anything calls it)."""
    obj: Any = _import_path(path)  # not yet checked: whatever the path names
    if isinstance(obj, type) and issubclass(obj, Task):
        return obj
    if any(obj is f for f in _registered_factories()):
        return obj
    kind = "class" if isinstance(obj, type) else type(obj).__name__
    raise ValueError(f"task {path!r} is a {kind} ({getattr(obj, '__qualname__', obj)!r}), not an entropy_rft Task "
                     "subclass; point it at a Task subclass, or register a factory with register_task")


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
        return _checked_target(name)
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
