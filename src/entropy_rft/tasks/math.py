"""Math tasks: DAPO-Math-17k (with the DAPO500 held-out split), AIME24, AIME25, AMC23, MATH-500, and the
offline built-ins CHAMP (from the ``champ-dataset`` wheel) and reasoning-gym's ``gsm_symbolic``.

Every dataset is rows with a question and a gold answer. A row source is either

- a Hugging Face hub id, read with ``datasets.load_dataset(id, config, split=split)`` (needs a network or
  a warm hub cache), or
- a local ``.parquet``, ``.jsonl`` or ``.json`` file;

and a declared column mapping (``prompt_key``, ``answer_key``: dotted paths with list indices, e.g.
``"prompt[0].content"``, ``"reward_model.ground_truth"``) picks the two fields. :data:`DATASETS` holds the
mapping of each named benchmark; every field can be overridden in ``task.params``.

Bad rows (missing or empty answer, empty prompt, wrong types) are counted, and the count with the first
row index is reported on stderr at load time; ``on_bad_rows="skip"`` (default) drops them,
``"error"`` refuses the dataset with a :class:`~entropy_rft.common.errors.UserError`. Loading happens when the
task is built, before any training step, so a bad file never stops a run midway. A local UTF-8 JSONL file is
read line by line and only the byte offsets of its usable rows are kept: a split reads back the rows it names
(``erft eval`` the held-out ones; the training examples when first read, before a run's first step), and a file
changed since it was loaded is refused. Reading and checking rows: :mod:`entropy_rft.tasks.rows`.

The reward is :func:`entropy_rft.tasks.rewards.math_reward` (last ``\\boxed{}`` vs the gold answer, math-verify in
worker processes with a hard time limit), or any ``"pkg.mod:fn"`` with ``fn(response, answer) -> float``
run in the same kind of worker pool. An optional format penalty: ``format_penalty=p`` gives a response
with no complete ``\\boxed{}`` the reward ``-p`` (so ``reward > 0`` still means correct).
"""

from __future__ import annotations

import json
import random
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

from entropy_rft.common.errors import UserError
from entropy_rft.tasks.base import Example, Task
from entropy_rft.tasks.prompts import MATH_TEMPLATE, PROMPT_FORMATS, make_prompt
from entropy_rft.tasks.rows import (  # noqa: F401  (DAPO_*, BadRows, get_path: re-exported, importable from here)
    BAD_ROW_POLICIES,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    BadRows,
    LazyList,
    Pair,
    get_path,
    load_pairs,
    load_rows,
    rows_to_pairs,
)

if TYPE_CHECKING:
    from entropy_rft.tasks.rewards import RewardPool


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives and how its columns map to {prompt, answer}."""

    source: str  # hub id or local file
    split: str = "train"
    config: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    clean: str | None = None  # "dapo": strip DAPO's own answer-format instructions from the question
    val_size: int | str = "all"  # held-out questions: an int (seeded split) or "all" (an eval benchmark)
    help: str = ""


DATASETS: dict[str, DatasetSpec] = {
    "dapo_math_17k": DatasetSpec("BytedTsinghua-SIA/DAPO-Math-17k", "train", None, "prompt[0].content",
                                 "reward_model.ground_truth", "dapo", 500,
                                 "DAPO-Math-17k training set; 500 seeded held-out questions form DAPO500"),
    "aime24": DatasetSpec("HuggingFaceH4/aime_2024", "train", None, "problem", "answer",
                          help="AIME 2024, 30 problems"),
    "aime25": DatasetSpec("math-ai/aime25", "test", None, "problem", "answer", help="AIME 2025, 30 problems"),
    "amc23": DatasetSpec("math-ai/amc23", "test", None, "question", "answer", help="AMC 2023, 40 problems"),
    "math500": DatasetSpec("HuggingFaceH4/MATH-500", "test", None, "problem", "answer",
                           help="MATH-500 (Lightman et al.'s subset of MATH test)"),
}


# ----------------------------------------------------------------------------- built-in offline sets


def champ_answer(raw: str) -> str | None:
    """A machine-checkable answer from CHAMP's free-text answer, or None (yes/no, prose, several values)."""
    s = raw.strip().rstrip(".")
    m = re.search(r"or equivalently (.+)$", s)
    if m:
        s = m.group(1).strip()
    for pat in (r"^(.+?) is the only possible value$", r"^The limit exists and is equal to (.+)$",
                r"^The only possible value for the limit is (.+)$", r"^(\S+) \((?:i\.e\.,|no |none ).*\)$"):
        m = re.match(pat, s)
        if m:
            s = m.group(1).strip()
            break
    if re.fullmatch(r"[0-9a-z+\-*/^().!√ ]+", s) and not re.search(r"[a-z]{3,}", s.replace("sqrt", "")):
        return s.replace(" ", "")
    return None


def champ_rows() -> list[dict]:
    """CHAMP's 270 problems from the champ-dataset wheel, with machine-checkable answers (others: None)."""
    from importlib import resources

    try:
        path = resources.files("champ_dataset") / "dataset_files" / "v0.json"
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ModuleNotFoundError, FileNotFoundError):
        raise UserError("task 'champ' needs the champ-dataset wheel: pip install champ-dataset") from None
    rows = []
    for pid, p in sorted(data["problems"].items()):
        rows.append({"id": pid, "prompt": p.get("_text") or p.get("problem_text") or "",
                     "answer": champ_answer(str(p.get("_answer", ""))), "category": p.get("category")})
    return rows


def gsm_symbolic_rows(size: int, seed: int) -> list[dict]:
    """GSM8K-style problems from reasoning-gym's ``gsm_symbolic`` generator (offline, seeded)."""
    try:
        import reasoning_gym
    except ImportError:
        raise UserError("task 'gsm_symbolic' needs reasoning-gym: pip install reasoning-gym") from None
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=int(size), seed=int(seed))
    return [{"prompt": x["question"], "answer": x["answer"]} for x in ds]


def default_holdout(rows: int) -> int:
    """Held-out questions of a dataset file given without ``val_size``: a tenth of its rows, at least one and at
    most 500 (DAPO500's size), and none when it has a single row (that row trains)."""
    return 0 if rows < 2 else min(500, max(1, rows // 10))


# ----------------------------------------------------------------------------- the task


class MathTask(Task):
    """Questions with gold answers, a step-by-step prompt with ``\\boxed{}``, and the math-verify reward.

    Args:
        dataset: a name in :data:`DATASETS` (sets the defaults below), ``"champ"``, ``"gsm_symbolic"``, or
            ``None`` with ``source`` set.
        source: hub id or local ``.parquet``/``.jsonl``/``.json`` file (overrides the dataset's).
        split, config: hub split and config name.
        prompt_key, answer_key: the column mapping (dotted paths, list indices allowed).
        clean: ``"dapo"`` strips DAPO's answer-format instruction from each question.
        val_size: held-out questions: an int (a split seeded by ``holdout_seed``, the same for every run
            seed, so DAPO500 is one fixed set) or ``"all"`` (every row is validation, no training rows: an
            evaluation benchmark).
        holdout_seed: the seed of the held-out split.
        part: ``"all"`` (train and validation as above), ``"val"`` (validation rows only, as both: for
            ``dapo500``) or ``"train"``.
        limit: keep at most this many training rows (after the split).
        prompt_format: ``"chat"`` (chat template at tokenisation when the tokenizer has one) or ``"plain"``.
        template: the prompt template, with ``{question}``.
        system: an optional system message (chat format).
        on_bad_rows: ``"skip"`` or ``"error"``.
        reward: ``"math"`` (math-verify) or ``"pkg.mod:fn"``.
        format_penalty: reward of a response with no complete ``\\boxed{}`` is ``-format_penalty``.
        reward_timeout: hard limit per answer, seconds (at most 2 by default).
        val_task, val_task_params: take the validation set from another task (e.g. train on a filtered
            JSONL and validate on ``dapo500``).
        size, gen_seed: ``gsm_symbolic`` only: how many problems to generate, and the generator seed.
    """

    max_response_tokens = 1024

    def __init__(self, dataset: str | None = None, *, source: str | None = None, split: str | None = None,
                 config: str | None = None, prompt_key: str | None = None, answer_key: str | None = None,
                 clean: str | None = None, val_size: int | str | None = None, holdout_seed: int = 0,
                 part: str = "all", limit: int | None = None, prompt_format: str = "chat",
                 template: str = MATH_TEMPLATE, system: str | None = None, on_bad_rows: str = "skip",
                 reward: str = "math", format_penalty: float = 0.0, reward_timeout: float = 2.0,
                 val_task: str | None = None, val_task_params: dict | None = None, dedupe: bool = True,
                 size: int = 300, gen_seed: int = 0, name: str | None = None) -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise UserError(f"task param 'prompt_format' must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        if "{question}" not in template:
            raise UserError("task param 'template' must contain '{question}'")
        if part not in ("all", "train", "val"):
            raise UserError(f"task param 'part' must be all, train or val; got {part!r}")
        if on_bad_rows not in BAD_ROW_POLICIES:
            raise UserError(f"task param 'on_bad_rows' must be one of {BAD_ROW_POLICIES}, got {on_bad_rows!r}")
        if format_penalty < 0:
            raise UserError(f"task param 'format_penalty' must be >= 0, got {format_penalty}")
        if not 0 < reward_timeout <= 60:
            raise UserError(f"task param 'reward_timeout' must be in (0, 60] seconds, got {reward_timeout}")
        self.prompt_format, self.template, self.system = prompt_format, template, system
        self.format_penalty, self.reward_timeout = float(format_penalty), float(reward_timeout)
        self.holdout_seed, self.part, self.limit = int(holdout_seed), part, limit
        self.val_task, self.val_task_params = val_task, dict(val_task_params or {})
        self.reward_name = reward
        self._pool: RewardPool | None = None
        self._cache: OrderedDict[tuple[str, str], tuple[float, str | None]] = OrderedDict()
        if reward != "math":
            if ":" not in str(reward):
                raise UserError(f"task param 'reward' must be 'math' or 'pkg.module:function', got {reward!r}")
            from entropy_rft.tasks.rewards import resolve_callable

            try:
                resolve_callable(reward)
            except (ImportError, AttributeError, ValueError) as e:
                raise UserError(f"task param 'reward' {reward!r} cannot be imported ({e}); fix the path") from None

        # rows (of a local JSONL file: their offsets only, the rows read again when a split needs them)
        loaded: tuple[Sequence[Pair], BadRows] | None = None
        if dataset == "champ":
            # Problems whose answers are prose (yes/no, descriptions) are not machine-checkable: left out.
            rows = [r for r in champ_rows() if r["answer"] is not None]
            spec = DatasetSpec("champ-dataset", val_size=50)
        elif dataset == "gsm_symbolic":
            rows, spec = gsm_symbolic_rows(size, gen_seed), DatasetSpec("reasoning-gym:gsm_symbolic", val_size=50)
        elif dataset is None or dataset in DATASETS:
            spec = DATASETS[dataset] if dataset else DatasetSpec(source or "", val_size=0)
            if dataset is None and not source:
                raise UserError("task 'math' needs task.params.dataset (one of "
                                f"{', '.join(sorted(DATASETS))}, champ, gsm_symbolic) or task.params.source")
            spec = replace(spec, **{k: v for k, v in dict(source=source, split=split, config=config,
                                                           prompt_key=prompt_key, answer_key=answer_key,
                                                           clean=clean).items() if v is not None})
            loaded = load_pairs(spec.source, split=spec.split, config=spec.config, prompt_key=spec.prompt_key,
                                answer_key=spec.answer_key, clean=spec.clean, on_bad_rows=on_bad_rows, dedupe=dedupe)
        else:
            raise UserError(f"task param 'dataset' {dataset!r} is unknown; known: "
                            f"{', '.join(sorted(DATASETS))}, champ, gsm_symbolic (or set 'source')")
        if val_size is not None:
            spec = replace(spec, val_size=val_size)
        if not (spec.val_size == "all" or (isinstance(spec.val_size, int) and spec.val_size >= 0)):
            raise UserError(f"task param 'val_size' must be an int >= 0 or 'all', got {spec.val_size!r}")
        self.spec = spec
        self.name = name or dataset or Path(str(spec.source)).stem or "math"
        if loaded is None:
            loaded = rows_to_pairs(rows, source=str(spec.source), prompt_key=spec.prompt_key,
                                   answer_key=spec.answer_key, clean=spec.clean, on_bad_rows=on_bad_rows,
                                   dedupe=dedupe)
        self.pairs: Sequence[Pair] = loaded[0]
        self.bad_rows: BadRows = loaded[1]
        if val_size is None and dataset is None:  # a file of one's own: hold out a tenth of it for evaluation
            spec = self.spec = replace(spec, val_size=default_holdout(len(self.pairs)))
            self.notes = (f"task '{self.name}': {spec.val_size} of the {len(self.pairs)} usable rows of "
                          f"'{spec.source}' are held out for evaluation (no val_size given); set "
                          "task.params.val_size to choose (an int, or 'all' for an evaluation set)",)
        if isinstance(spec.val_size, int) and spec.val_size >= len(self.pairs) and part != "val":
            raise UserError(f"task param 'val_size' ({spec.val_size}) must be smaller than the "
                            f"{len(self.pairs)} usable rows of '{spec.source}'")

    # -- data
    def example(self, question: str, answer: str, row: int) -> Example:
        prompt = make_prompt(question, template=self.template, prompt_format=self.prompt_format, system=self.system)
        return Example(prompt=prompt, answer=answer, meta={"question": question, "row": row, "source": self.name})

    def held_out_index(self) -> tuple[list[int], list[int]]:
        """(train, held-out) indices into ``pairs`` by ``holdout_seed``, independent of the run seed: the
        ``val_size`` first of ``range(len(pairs))`` shuffled by ``random.Random(holdout_seed)``, in increasing
        order, are held out; the rest train, in increasing order."""
        if self.spec.val_size == "all":
            return [], list(range(len(self.pairs)))
        idx = list(range(len(self.pairs)))
        random.Random(self.holdout_seed).shuffle(idx)
        n = min(int(self.spec.val_size), len(idx))
        val_idx = sorted(idx[:n])
        val_set = set(val_idx)
        return [i for i in range(len(self.pairs)) if i not in val_set], val_idx

    def _pick(self, indices: list[int]) -> list[Pair]:
        take = getattr(self.pairs, "take", None)  # a JSONL file's pairs read only the rows named
        return take(indices) if take is not None else [self.pairs[i] for i in indices]

    def held_out(self) -> tuple[list[Pair], list[Pair]]:
        """(train pairs, held-out pairs) by ``holdout_seed`` (:meth:`held_out_index`)."""
        train, val = self.held_out_index()
        return self._pick(train), self._pick(val)

    def split(self, seed: int) -> tuple[list[Example], list[Example]]:
        """Train (shuffled by ``seed``, capped by ``limit``) and validation (fixed order) examples.

        The training examples are made when first read (:class:`~entropy_rft.tasks.rows.LazyList`; a list in
        all but its type), so a command that only evaluates reads no training row of a JSONL file."""
        train, val = self.held_out_index()
        if self.part == "val":
            train = list(val)
        elif self.part == "train":
            val = []
        random.Random(seed).shuffle(train)  # the permutation depends on the length only: as shuffling the pairs
        if self.limit is not None:
            train = train[: int(self.limit)]
        val_ex = [self.example(*p) for p in self._pick(val)]
        if self.val_task:
            from entropy_rft.tasks import build_task

            val_ex = build_task(self.val_task, **self.val_task_params).split(seed)[1]
        train_ex = LazyList(len(train), lambda: [self.example(*p) for p in self._pick(train)])
        return cast(list[Example], train_ex), val_ex

    # -- verifier
    def _pool_for_custom(self):
        if self._pool is None:
            from entropy_rft.tasks.rewards import RewardPool

            self._pool = RewardPool(self.reward_name, workers=1, timeout=self.reward_timeout, default=0.0)
        return self._pool

    def check_many(self, responses: list[str], examples: list[Example]) -> list[tuple[float, str | None]]:
        """(reward, canonical) for many responses at once (spread over the worker pool), cached."""
        from entropy_rft.tasks.rewards import format_reward, last_boxed, math_check

        keys = [(str(r), str(ex.answer)) for r, ex in zip(responses, examples)]
        todo = [k for k in dict.fromkeys(keys) if k not in self._cache]
        if todo:
            if self.reward_name == "math":
                res = math_check([k[0] for k in todo], [k[1] for k in todo])
            else:
                vals = self._pool_for_custom().map(todo)
                res = []
                for (r, _), v in zip(todo, vals):
                    b = last_boxed(r)
                    try:
                        score = float(v)
                    except (TypeError, ValueError):
                        score = 0.0
                    res.append((score if score == score else 0.0, " ".join(b.split()) if b else None))
            for k, (score, canon) in zip(todo, res):
                if score <= 0 and self.format_penalty and not format_reward(k[0]):
                    score = -self.format_penalty
                self._cache[k] = (score, canon)
                if len(self._cache) > 50_000:
                    self._cache.popitem(last=False)
        return [self._cache[k] for k in keys]

    def rewards(self, responses: list[str], examples: list[Example]) -> list[float]:
        """Batched rewards: one round over the worker pool for the whole list."""
        try:
            return [r for r, _ in self.check_many(list(responses), list(examples))]
        except Exception:  # noqa: BLE001 - the verifier never raises
            return [self.reward(r, ex) for r, ex in zip(responses, examples)]

    def reward(self, response: str, example: Example) -> float:
        """1.0 when the last ``\\boxed{}`` equals the gold answer; 0.0 (or ``-format_penalty`` without a box)."""
        try:
            return self.check_many([response], [example])[0][0]
        except Exception:  # noqa: BLE001 - the verifier never raises
            return 0.0

    def canonical(self, response: str, example: Example) -> str | None:
        """math-verify's reading of the last ``\\boxed{}`` (for Maj@K), ``None`` without a box."""
        try:
            return self.check_many([response], [example])[0][1]
        except Exception:  # noqa: BLE001
            return None


# ----------------------------------------------------------------------------- registry factories


def _named(dataset: str, **defaults):
    def factory(**params) -> MathTask:
        return MathTask(dataset, **{**defaults, **params})

    factory.__name__ = f"{dataset}_task"
    return factory


dapo_math_17k = _named("dapo_math_17k")
dapo500 = _named("dapo_math_17k", part="val", name="dapo500")
aime24 = _named("aime24")
aime25 = _named("aime25")
amc23 = _named("amc23")
math500 = _named("math500")
champ = _named("champ")
gsm_symbolic = _named("gsm_symbolic")


def math_task(**params) -> MathTask:
    """The generic math task (``--task math``): set ``source`` (and the column mapping) in task.params."""
    return MathTask(params.pop("dataset", None), **params)
