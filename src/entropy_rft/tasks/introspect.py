"""What a task takes: its parameters, defaults and help, read from the task's factory (the library side of
``erft tasks``; ``erft train --help-config`` uses it too).

A task's parameters are read from its factory: the signature gives the names and defaults, the ``Args:``
section of the docstring the help. A registered factory that takes only ``**params`` and is annotated to
return a Task class (``math_task``, ``dapo500``...) is described by that class; the values its closure fixes
(``dataset``) or presets (``defaults``) are shown as such, and the fields of the dataset's spec in the class
module's ``DATASETS`` fill the defaults the class leaves as ``None``. Imports nothing heavy at load.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from entropy_rft.tasks.rg import PREFIX as RG_PREFIX

SET_HINT = ("set with --set task.params.NAME=VALUE (erft train) or --task-param NAME=VALUE (erft eval, "
            "erft filter)")


def _clean(text: str) -> str:
    """Docstring markup to plain text: ``x`` -> x, :data:`X` -> X, one space between words."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return " ".join(text.split())


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(the text before ``Args:``, {parameter: help}) of a Google-style docstring. An ``Args:`` entry may
    name several parameters (``split, config: ...``); continuation lines are indented deeper."""
    import inspect

    lines = inspect.cleandoc(doc or "").splitlines()
    head: list[str] = []
    helps: dict[str, str] = {}
    in_args, base, cur = False, None, []
    for line in lines:
        if not in_args:
            if line.strip() == "Args:":
                in_args = True
            else:
                head.append(line)
            continue
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # the next section
            break
        base = indent if base is None else base
        names, sep, text = line.strip().partition(":")
        keys = [n.strip() for n in names.split(",")]
        if indent == base and sep and all(k.isidentifier() for k in keys):
            cur = keys
            for k in cur:
                helps[k] = text.strip()
        elif cur:
            for k in cur:
                helps[k] += " " + line.strip()
    return _clean("\n".join(head)), {k: _clean(v) for k, v in helps.items()}


def _summary(description: str) -> str:
    """The first sentence of a description."""
    m = re.match(r"(.+?[.!?])(\s|$)", description)
    return m.group(1) if m else description


def _target(factory: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(the callable whose signature holds the parameters, values fixed positionally, preset defaults)."""
    import functools
    import inspect
    import typing

    if isinstance(factory, functools.partial):
        return factory.func, {}, dict(factory.keywords)
    if inspect.isclass(factory):
        return factory, {}, {}
    params = inspect.signature(factory).parameters.values()
    if all(p.kind == p.VAR_KEYWORD for p in params):  # def f(**params) -> SomeTask: described by SomeTask
        try:
            ret = typing.get_type_hints(factory).get("return")
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: describe the factory itself
            ret = None
        if inspect.isclass(ret):
            free = inspect.getclosurevars(factory).nonlocals
            fixed = {"dataset": free["dataset"]} if isinstance(free.get("dataset"), str) else {}
            preset = dict(free["defaults"]) if isinstance(free.get("defaults"), dict) else {}
            return ret, fixed, preset
    return factory, {}, {}


def _spec_defaults(cls: Any, dataset: str | None) -> tuple[dict[str, Any], str]:
    """The fields of ``DATASETS[dataset]`` in ``cls``'s module (where its data lives, its columns) and the
    spec's help text."""
    import dataclasses

    spec = getattr(sys.modules.get(getattr(cls, "__module__", ""), None), "DATASETS", {}).get(dataset)
    if spec is None or not dataclasses.is_dataclass(spec):
        return {}, ""
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "help"}
    return values, str(getattr(spec, "help", "") or "")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return list(value) if isinstance(value, (tuple, set, frozenset)) else repr(value)


def _path(obj: Any) -> str:
    """``module:attr`` of ``obj``: the module attribute that holds it (a factory made by a helper function
    has no useful ``__qualname__``)."""
    module = sys.modules.get(obj.__module__)
    attr = next((k for k, v in vars(module).items() if v is obj and not k.startswith("_")), None) if module else None
    return f"{obj.__module__}:{attr or obj.__qualname__}"


def describe(name: str, factory: Any, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """One task: ``name``, ``factory`` (module:attr), ``summary``, ``description``, ``fixed`` (values the name
    sets) and ``params`` (name, default, required, help), in signature order."""
    import inspect

    target, fixed, preset = _target(factory)
    description, helps = parse_docstring(inspect.getdoc(target))
    own_doc = inspect.getdoc(factory) if factory is not target and not isinstance(factory, type) else None
    if own_doc:
        description = _clean(own_doc) + (" " + description if description else "")
    spec, spec_help = _spec_defaults(target, fixed.get("dataset"))
    if spec_help:
        description = f"{spec_help}. {description}"
    elif "dataset" in fixed:
        description = f"The {fixed['dataset']} dataset. {description}"
    params = []
    for p in inspect.signature(target).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in fixed or p.name in skip:
            continue
        required = p.default is p.empty
        default = preset.get(p.name, None if required else p.default)
        if default is None and spec.get(p.name) is not None:
            default = spec[p.name]
        params.append({"name": p.name, "default": _jsonable(default), "required": required and p.name not in preset,
                       "help": helps.get(p.name, "")})
    return {"name": name, "factory": _path(getattr(factory, "func", factory)), "summary": _summary(description),
            "description": description, "fixed": fixed, "params": params}


# ----------------------------------------------------------------------------- reasoning-gym


def rg_datasets() -> tuple[list[str], str | None]:
    """The installed reasoning-gym dataset names, or ([], why not)."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.tasks import rg

    try:
        return rg.available_datasets(), None
    except UserError as e:
        return [], str(e)


def rg_dataset_fields(dataset: str) -> list[dict[str, Any]]:
    """The reasoning-gym dataset's own config fields (name, type, default), set in task param ``params``;
    ``size`` and ``seed`` are left out (the task sets them from ``size``, ``val_size`` and ``gen_seed``)."""
    import dataclasses

    from reasoning_gym import factory

    config_cls = factory.DATASETS[dataset][1]
    out = []
    for f in dataclasses.fields(config_cls):
        if f.name in ("size", "seed") or not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        kind = f.type if isinstance(f.type, str) else f.type.__name__ if isinstance(f.type, type) else str(f.type)
        out.append({"name": f.name, "type": str(kind).replace("typing.", ""), "default": _jsonable(default)})
    return out


def rg_info(dataset: str | None) -> dict[str, Any]:
    """``rg:<dataset>`` (``dataset`` None: the family, with the installed names) or one dataset in full."""
    from entropy_rft.tasks.rg import ReasoningGymTask

    info = describe(f"{RG_PREFIX}{dataset or '<dataset>'}", ReasoningGymTask, skip=("dataset",))
    if dataset is None:
        names, why = rg_datasets()
        info["summary"] = why or f"Any reasoning-gym dataset as a task ({len(names)} installed)."
        info["datasets"] = names
    else:
        info["fixed"] = {"dataset": dataset}
        info["dataset_params"] = rg_dataset_fields(dataset)
    return info


# ----------------------------------------------------------------------------- the command


def _unknown(name: str, known: list[str], what: str):
    import difflib

    from entropy_rft.common.errors import UserError

    near = difflib.get_close_matches(name, known, n=3)
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    names = f"known: {', '.join(known)}" if len(known) <= 20 else f"'erft tasks' lists the {len(known)} known"
    return UserError(f"unknown {what} {name!r}{hint}; {names}")


def infos(name: str | None) -> list[dict[str, Any]]:
    from entropy_rft.tasks import available_tasks, task_factory

    if name is None:
        return [describe(n, task_factory(n)) for n in available_tasks()] + [rg_info(None)]
    if name.startswith(RG_PREFIX):
        dataset = name[len(RG_PREFIX):]
        names, why = rg_datasets()
        if why:
            from entropy_rft.common.errors import UserError

            raise UserError(why)
        if dataset not in names:
            raise _unknown(dataset, names, "reasoning-gym dataset")
        return [rg_info(dataset)]
    if name in available_tasks() or ":" in name:
        try:
            return [describe(name, task_factory(name))]
        except ValueError as e:
            from entropy_rft.common.errors import UserError

            raise UserError(str(e)) from None
    raise _unknown(name, available_tasks() + [f"{RG_PREFIX}<dataset>"], "task")
