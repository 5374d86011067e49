"""A verl reward function that scores with an erft task's own reward: rows written by ``erft export-verl``.

verl loads this file by path and calls, for every response,
``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`` (its ``naive`` reward
manager, both the legacy one and the reward-loop one). Point verl at it with
``reward.custom_reward_function.path=<this file> reward.custom_reward_function.name=compute_score``; the
path is printed by ``erft export-verl`` and by
``python -c "import entropy_rft.integrations.verl_reward as m; print(m.__file__)"``.

How a row finds its :class:`~entropy_rft.tasks.base.Example`: ``extra_info`` holds the task name, its
parameters (JSON text), the split seed, the split (``train`` or ``val``) and the row's index in that split.
The task is rebuilt once per process and per (task, params, seed) and split with the same seed, and the row's
example is looked up by index. So a reasoning-gym task gets the generator entry its verifier needs
(``example.meta["entry"]``) and Countdown its digits, without storing task-specific data in the parquet. The
example's answer must equal the row's ``ground_truth``; when it does not (the task was rebuilt differently:
another reasoning-gym version, a changed data file), the function raises instead of scoring against the
wrong problem: export again.

Code is named by the person who runs verl, never by a row: a row builds a registered task or an ``rg:`` task. A
task given by import path (``package.module:Class``), or a custom reward function among its parameters, is built
only when the reward function's own arguments name it (``import_paths``, set by the launcher:
``+reward.custom_reward_function.reward_kwargs.import_paths='pkg.mod:Class'``, comma-separated for several);
otherwise the row is refused before anything is imported. A parquet is data, and datasets are downloaded.

Imports nothing heavy at load; entropy_rft must be installed in verl's environment.
"""

from __future__ import annotations

import functools
import json
from typing import Any

SPLITS = ("train", "val")


@functools.lru_cache(maxsize=16)
def _examples(task_name: str, params_json: str, seed: int) -> tuple[Any, dict[str, list]]:
    """(task, {"train": [...], "val": [...]}) for one exported (task, params, seed), built once per process."""
    from entropy_rft.tasks import build_task

    task = build_task(task_name, **json.loads(params_json or "{}"))
    train, val = task.split(int(seed))
    return task, {"train": train, "val": val}


def allowed_paths(import_paths: Any) -> frozenset[str]:
    """The import paths the launcher allows (``import_paths``: a comma-separated string or a list of them)."""
    if import_paths is None:
        return frozenset()
    items = import_paths.split(",") if isinstance(import_paths, str) else [str(p) for p in import_paths]
    return frozenset(p.strip() for p in items if p.strip())


def example_for(extra_info: dict | None, ground_truth: Any = None, import_paths: Any = None) -> tuple[Any, Any]:
    """(task, example) of an exported row, from its ``extra_info``; checks the answer against
    ``ground_truth`` when given. A code reference in the row (a task import path, a reward function) that
    ``import_paths`` does not name is refused before anything is imported."""
    from entropy_rft.tasks import untrusted_code

    info = dict(extra_info or {})
    missing = [k for k in ("task", "split", "index") if info.get(k) is None]
    if missing:
        raise ValueError(f"erft compute_score: extra_info lacks {missing}; the data was not written by "
                         "'erft export-verl' (or verl dropped extra_info)")
    split = str(info["split"])
    if split not in SPLITS:
        raise ValueError(f"erft compute_score: extra_info split {split!r} is not one of {SPLITS}")
    params_json = str(info.get("task_params") or "{}")
    try:
        params = json.loads(params_json)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"erft compute_score: extra_info task_params is not JSON ({type(e).__name__}); "
                         "export again") from None
    bad = untrusted_code(str(info["task"]), params, allowed_paths(import_paths))
    if bad:
        field, path = bad[0]
        raise ValueError(f"erft compute_score: the row names code to import ({field} {path!r}); a dataset row is "
                         "data: if you trust it, name it in the launcher with "
                         f"+reward.custom_reward_function.reward_kwargs.import_paths='{path}'")
    task, splits = _examples(str(info["task"]), params_json, int(info.get("seed") or 0))
    rows, index = splits[split], int(info["index"])
    if not 0 <= index < len(rows):
        raise ValueError(f"erft compute_score: index {index} is outside the {len(rows)} {split} examples of task "
                         f"{info['task']!r}; export again with this version of the task")
    example = rows[index]
    if ground_truth is not None and str(example.answer) != str(ground_truth):
        raise ValueError(f"erft compute_score: task {info['task']!r} rebuilt {split} example {index} with answer "
                         f"{str(example.answer)!r}, but the row's ground_truth is {str(ground_truth)!r}; the task "
                         "differs from the one exported (versions, data files): export again")
    return task, example


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  import_paths: Any = None, **kwargs: Any) -> float:
    """The erft task's reward (``task.reward(solution_str, example)``) for one response, as a float.

    ``data_source`` is not used (the task comes from ``extra_info``). ``import_paths``: the task import paths and
    reward functions rows may name (from verl's ``reward_kwargs``, which the launcher sets; a row never can).
    Other keyword arguments that verl adds (``reward_router_address``) are ignored.
    """
    task, example = example_for(extra_info, ground_truth, import_paths)
    return float(task.reward(str(solution_str), example))
