"""Any reasoning-gym dataset as a task: ``--task rg:<name>`` (for example ``rg:basic_arithmetic``).

reasoning-gym (an offline pip package) generates verifiable problems procedurally from a seed and scores
an answer with each dataset's own verifier, ``dataset.score_answer(answer, entry)``. This module turns one of
its datasets into a :class:`~entropy_rft.tasks.base.Task`:

- **Problems.** ``size + val_size`` problems are generated once with ``gen_seed`` and the dataset's own
  parameters (``params``, passed to ``reasoning_gym.create_dataset``); repeated questions are dropped; a
  shuffle by ``holdout_seed`` puts ``val_size`` of them in the validation set. The validation set is the
  same for every run seed; the run seed only orders the training problems.
- **Prompts.** The question and a short answer instruction (``template``), sent through the model's chat
  template (``prompt_format="chat"``) when the tokenizer has one. No system prompt unless ``system`` is set:
  a short prompt keeps a small model's steps cheap.
- **Answers.** ``answer_format`` says where the answer is read from: ``"tag"`` (the last
  ``<answer>...</answer>``, reasoning-gym's own convention), ``"boxed"`` (the last ``\\boxed{}``) or
  ``"line"`` (the text after the last ``Answer:``, up to the end of its line) or ``"number"`` (the last
  number in the response, thousands separators ignored: for numeric answers and models that do not follow
  a format instruction; the prompt is then the question alone).
- **Reward.** reasoning-gym's ``score_answer`` on the extracted answer. Some datasets give partial credit
  (0.01 for a wrong answer in the right form, say); by default the reward is 1.0 when the score is 1.0 and
  0.0 otherwise (``partial_credit=True`` keeps the dataset's score), so ``reward`` means *correct*, as for
  every other task.
"""

from __future__ import annotations

import random
import re
from typing import Any

from entropy_rft.common.errors import UserError
from entropy_rft.tasks.base import Example, Task, int_param
from entropy_rft.tasks.prompts import PROMPT_FORMATS, make_prompt

PREFIX = "rg:"
ANSWER_FORMATS = ("tag", "boxed", "line", "number")
INSTRUCTIONS = {
    "tag": "Give your final answer inside <answer></answer> tags.",
    "boxed": "Put your final answer within \\boxed{{}}.",
    "line": "End your response with a line of the form 'Answer: <your answer>'.",
    "number": "",
}
_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_LINE = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def available_datasets() -> list[str]:
    """The dataset names this reasoning-gym install provides, sorted."""
    return sorted(_factory_module().DATASETS)


def _factory_module():
    try:
        from reasoning_gym import factory
    except ImportError:
        raise UserError("rg:<name> tasks need reasoning-gym: pip install reasoning-gym") from None
    return factory


def extract_answer(response: str, answer_format: str) -> str | None:
    """The answer written in ``response``, read as ``answer_format`` says; ``None`` when there is none."""
    if answer_format == "tag":
        found = _TAG.findall(response)
        text = found[-1] if found else None
    elif answer_format == "boxed":
        from entropy_rft.tasks.rewards import last_boxed

        text = last_boxed(response)
    elif answer_format == "line":
        found = _LINE.findall(response)
        text = found[-1] if found else None
    elif answer_format == "number":
        found = _NUMBER.findall(response.replace(",", ""))
        text = found[-1] if found else None
    else:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    if text is None:
        return None
    text = " ".join(text.split())
    return text or None


def _expected(hint: Any) -> tuple[tuple[type, ...], str] | None:
    """(the types a value may have, their description) for a config field's annotation; None: not told."""
    import types
    import typing

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        found = _expected(inner[0]) if len(inner) == 1 else None
        return None if found is None else ((*found[0], type(None)), found[1] + " or null")
    simple = {int: ((int,), "an integer"), float: ((int, float), "a number"), bool: ((bool,), "true or false"),
              str: ((str,), "text")}
    return simple.get(hint)


def _rejected(factory: Any, dataset: str, params: dict[str, Any], err: Exception) -> str:
    """One line for reasoning-gym refusing ``task.params.params``: the parameter at fault when it can be told
    (an unknown name, or a value of the wrong type for the dataset's config field), else its message and the
    parameters given."""
    import dataclasses
    import typing

    where = f"task '{PREFIX}{dataset}':"
    config_cls = factory.DATASETS[dataset][1]
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - annotations it cannot resolve: fall back to the message
        hints = {}
    fields = [f.name for f in dataclasses.fields(config_cls)] if dataclasses.is_dataclass(config_cls) else []
    unknown = [k for k in params if fields and k not in fields]
    if unknown:
        return (f"{where} reasoning-gym's {dataset} has no parameter {', '.join(map(repr, unknown))} (task param "
                f"'params'); valid: {', '.join(fields)}")
    for key, value in params.items():
        want = _expected(hints.get(key))
        if want is None:
            continue
        types_ok, what = want
        if not isinstance(value, types_ok) or (isinstance(value, bool) and bool not in types_ok):
            return f"{where} param 'params.{key}' must be {what}, got {value!r}"
    return f"{where} reasoning-gym rejected param 'params' ({err}); given: {params!r}"


class ReasoningGymTask(Task):
    """One reasoning-gym dataset as a task (see the module docstring).

    Args:
        dataset: the reasoning-gym dataset name (``basic_arithmetic``, ``chain_sum``, ``leg_counting``, ...).
        size: training problems to generate (fewer remain if the generator repeats questions).
        val_size: held-out problems (the validation set), the same for every run seed.
        gen_seed: the generator's seed.
        holdout_seed: the seed of the train/validation shuffle.
        params: the dataset's own parameters, passed to ``reasoning_gym.create_dataset`` (for
            ``basic_arithmetic``: ``min_terms``, ``max_terms``, ``min_digits``, ...).
        answer_format: ``"tag"``, ``"boxed"`` or ``"line"``: where the answer is read from.
        template: the prompt, with ``{question}`` (default: the question and the answer instruction).
        prompt_format: ``"chat"`` (chat template when the tokenizer has one) or ``"plain"``.
        system: an optional system message.
        partial_credit: keep the dataset's fractional scores instead of 1.0-or-0.0.
        max_response_tokens: the longest response the task's answers need (a hint for the settings check).
    """

    def __init__(self, dataset: str, *, size: int = 2000, val_size: int = 64, gen_seed: int = 0,
                 holdout_seed: int = 0, params: dict | None = None, answer_format: str = "tag",
                 template: str | None = None, prompt_format: str = "chat", system: str | None = None,
                 partial_credit: bool = False, max_response_tokens: int = 64) -> None:
        factory = _factory_module()
        if dataset not in factory.DATASETS:
            raise UserError(f"unknown reasoning-gym dataset {dataset!r} (task 'rg:{dataset}'); available: "
                            f"{', '.join(available_datasets())}")
        if answer_format not in ANSWER_FORMATS:
            raise UserError(f"task param 'answer_format' must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        if prompt_format not in PROMPT_FORMATS:
            raise UserError(f"task param 'prompt_format' must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        task = f"{PREFIX}{dataset}"
        size, val_size, gen_seed, holdout_seed, max_response_tokens = (
            int_param(task, k, v) for k, v in (("size", size), ("val_size", val_size), ("gen_seed", gen_seed),
                                               ("holdout_seed", holdout_seed),
                                               ("max_response_tokens", max_response_tokens)))
        if int(size) < 1 or int(val_size) < 0:
            raise UserError(f"task params 'size' must be >= 1 and 'val_size' >= 0, got {size} and {val_size}")
        template = template if template is not None else ("{question}\n" + INSTRUCTIONS[answer_format]).strip()
        if "{question}" not in template:
            raise UserError("task param 'template' must contain '{question}'")
        if not isinstance(params or {}, dict):
            raise UserError(f"task param 'params' must be a mapping of {dataset}'s parameters, got {params!r}")
        self.name = f"{PREFIX}{dataset}"
        self.dataset_name, self.answer_format, self.partial_credit = dataset, answer_format, bool(partial_credit)
        self.template, self.prompt_format, self.system = template, prompt_format, system
        self.max_response_tokens = int(max_response_tokens)
        try:
            self.dataset = factory.create_dataset(dataset, size=int(size) + int(val_size), seed=int(gen_seed),
                                                  **dict(params or {}))
            entries = list(self.dataset)
        except (TypeError, ValueError, AssertionError) as e:
            raise UserError(_rejected(factory, dataset, dict(params or {}), e)) from None
        seen: set[str] = set()
        unique = []
        for entry in entries:
            if entry["question"] not in seen:
                seen.add(entry["question"])
                unique.append(entry)
        if int(val_size) >= len(unique):
            raise UserError(f"task param 'val_size' ({val_size}) must be smaller than the {len(unique)} distinct "
                            f"problems generated; raise 'size'")
        order = list(range(len(unique)))
        random.Random(int(holdout_seed)).shuffle(order)
        val_idx = set(order[: int(val_size)])
        self.val_entries = [e for i, e in enumerate(unique) if i in val_idx]
        self.train_entries = [e for i, e in enumerate(unique) if i not in val_idx]

    def example(self, entry: dict[str, Any]) -> Example:
        prompt = make_prompt(entry["question"], template=self.template, prompt_format=self.prompt_format,
                             system=self.system)
        return Example(prompt=prompt, answer=str(entry["answer"]), meta={"entry": entry, "source": self.name})

    def split(self, seed: int) -> tuple[list[Example], list[Example]]:
        """Train (shuffled by ``seed``) and validation (fixed, independent of ``seed``) examples."""
        train = list(self.train_entries)
        random.Random(seed).shuffle(train)
        return [self.example(e) for e in train], [self.example(e) for e in self.val_entries]

    def score(self, response: str, example: Example) -> float:
        """reasoning-gym's own score of the answer written in ``response`` (0.0 when there is none)."""
        answer = extract_answer(str(response), self.answer_format)
        if answer is None:
            return 0.0
        try:
            value = float(self.dataset.score_answer(answer, example.meta["entry"]))
        except Exception:  # noqa: BLE001 - a verifier never raises on garbage
            return 0.0
        return value if value == value else 0.0

    def reward(self, response: str, example: Example) -> float:
        """1.0 when reasoning-gym scores the answer 1.0, else 0.0 (its own score with ``partial_credit``)."""
        value = self.score(response, example)
        if self.partial_credit:
            return min(max(value, 0.0), 1.0)
        return 1.0 if value >= 1.0 else 0.0

    def canonical(self, response: str, example: Example) -> str | None:
        """The extracted answer with whitespace collapsed (``None`` when the response has none)."""
        return extract_answer(str(response), self.answer_format)


def rg_task(dataset: str, **params: Any) -> ReasoningGymTask:
    """The factory behind ``rg:<dataset>``."""
    return ReasoningGymTask(dataset, **params)
