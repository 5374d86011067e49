"""``erft export-verl``: a task's train and validation split as the parquet files verl's RL dataset reads.

``DIR/train.parquet`` and ``DIR/val.parquet`` hold one row per example (``Task.split(seed)``), in the schema of
verl's ``RLHFDataset`` and its examples (``examples/data_preprocess/gsm8k.py``):

- ``data_source``: ``"erft:<task>"``;
- ``prompt``: the chat messages (``[{"role": "user", "content": ...}]``, with the system message first when the
  task sets one). verl always renders them with the model's chat template;
- ``ability``: the task's name;
- ``reward_model``: ``{"style": "rule", "ground_truth": <the answer as text>}``;
- ``extra_info``: ``{"split", "index", "task", "task_params" (JSON text), "seed"}``: what
  :mod:`entropy_rft.integrations.verl_reward` needs to rebuild the task and score with its own reward.

Imports nothing heavy at load (pyarrow, inside ``run``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from entropy_rft.cli.flags import add_sampling_flags, parse_task_params
from entropy_rft.common.errors import UserError

NAME = "export-verl"
HELP = "Write a task's train and validation split as parquet files for verl, with the reward function to use."

FILES = ("train.parquet", "val.parquet")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", required=True, metavar="NAME",
                   help="the task: a name from 'erft tasks', rg:<dataset> or package.module:Class")
    add_sampling_flags(p, "--task-param", "--seed",
                       task_param={"help": "a task parameter (repeatable; values read as YAML, e.g. --task-param "
                                           "size=2000)"},
                       seed={"help": "the split seed (Task.split(seed))"})
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the folder for train.parquet and val.parquet (new, empty, or holding only these two)")


def messages(prompt: Any) -> list[dict[str, str]]:
    """The chat messages of a prompt: a ChatPrompt's own (system first when set), else one user message."""
    msgs = getattr(prompt, "messages", None)
    if msgs is None:
        msgs = [{"role": "user", "content": str(prompt)}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in msgs]


def rows(task_name: str, task: Any, params: dict[str, Any], seed: int) -> dict[str, list[dict[str, Any]]]:
    """{"train": [...], "val": [...]}: one verl row per example of ``task.split(seed)``."""
    params_json = json.dumps(params, sort_keys=True)
    train, val = task.split(int(seed))
    out: dict[str, list[dict[str, Any]]] = {}
    for split, examples in (("train", train), ("val", val)):
        out[split] = [{
            "data_source": f"erft:{task_name}",
            "prompt": messages(ex.prompt),
            "ability": str(getattr(task, "name", task_name)),
            "reward_model": {"style": "rule", "ground_truth": str(ex.answer)},
            "extra_info": {"split": split, "index": i, "task": task_name, "task_params": params_json,
                           "seed": int(seed)},
        } for i, ex in enumerate(examples)]
    return out


def _schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("task", pa.string()),
                                  ("task_params", pa.string()), ("seed", pa.int64())])),
    ])


def _check_out(text: str) -> Path:
    """``--out``: a folder we may write into (``preflight.check_out``: not empty, not a file, writable) that holds
    nothing but the two files this command writes."""
    from entropy_rft.training import preflight

    out = preflight.check_out(text, file_hint="")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in FILES)
        if other:
            shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
            raise UserError(f"--out {str(out)!r} holds other files ({shown}); choose a new or empty folder")
    return out


def write(out: Path, data: dict[str, list[dict[str, Any]]]) -> None:
    """Write ``train.parquet`` and ``val.parquet`` (each through a temporary file, then renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    schema = _schema()
    for split, name in zip(("train", "val"), FILES):
        tmp = out / f".{name}.tmp"
        pq.write_table(pa.Table.from_pylist(data[split], schema=schema), tmp)
        os.replace(tmp, out / name)


def reward_path() -> str:
    """The file to pass as ``reward.custom_reward_function.path``."""
    from entropy_rft.integrations import verl_reward

    return os.path.abspath(verl_reward.__file__)


def run(args: argparse.Namespace) -> int:
    from entropy_rft.training import preflight

    params = parse_task_params(args.task_param)
    try:
        json.dumps(params)
    except (TypeError, ValueError) as e:
        raise UserError(f"--task-param values must be plain values (numbers, text, lists, mappings): {e}") from None
    preflight.check_min("--seed", args.seed, 0)
    out = _check_out(args.out)
    task = preflight.build_task(args.task, params, flag="--task", params_flag="--task-param")
    data = rows(args.task, task, params, args.seed)
    if not data["train"]:
        raise UserError(f"task {args.task!r} has no training examples with these parameters")
    write(out, data)
    train, val = (out / f for f in FILES)
    print(f"wrote {len(data['train'])} train rows to {train} and {len(data['val'])} val rows to {val}")
    from entropy_rft.tasks import code_references

    code = sorted({path for _, path in code_references(args.task, params)})
    allow = (" +reward.custom_reward_function.reward_kwargs.import_paths='" + ",".join(code) + "'") if code else ""
    print("verl: data.train_files=" + str(train.resolve()) + " data.val_files=" + str(val.resolve()) +
          " reward.custom_reward_function.path=" + reward_path() +
          " reward.custom_reward_function.name=compute_score" + allow)
    return 0
