"""Bring your own run: a verl or TRL run (or a table export) read as entropy-rft's analysis reads its own runs.

``engine_logs`` reads the engine's log by the engine's key names; this module picks the policy-entropy series
and the validation score (``ENTROPY_KEYS``, ``choose_metric``: the engines' defaults, across their versions,
or the user's ``--entropy-key`` / ``--metric``), pairs each validation score with the entropy logged at the
same step, and gives what ``erft fit-law`` (``fit_engine_log``) and ``erft report`` (``engine_run``) need.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from entropy_rft.analysis.engine_logs import EngineLog, is_erft_path, read_engine_log
from entropy_rft.analysis.law import fit_and_forecast
from entropy_rft.analysis.runs import RunData, expand_run_dirs, load_run
from entropy_rft.common.errors import UserError

# The policy entropy, by engine and version: verl's actor/entropy (actor/entropy_loss in its early releases),
# TRL's log_history "entropy" (its TensorBoard and W&B tag "train/entropy"), an erft table's entropy/mean.
ENTROPY_KEYS = ("actor/entropy", "actor/entropy_loss", "entropy", "train/entropy", "entropy/mean")
# The training reward, drawn next to the validation score where logged.
REWARD_KEYS = ("critic/score/mean", "reward", "train/reward", "reward/mean")
# Validation scores, best first: verl's val-core/<data source>/<acc|reward>/mean@N (acc before reward, the
# smallest N first), its earlier val/test_score/<data source>; TRL's eval_reward (TensorBoard: eval/reward);
# an erft table's eval/pass@1.
_METRIC_PATTERNS = (
    re.compile(r"^val-core/.+/acc/mean@(\d+)$"),
    re.compile(r"^val-core/.+/reward/mean@(\d+)$"),
    re.compile(r"^val/test_score/.+$"),
    re.compile(r"^(eval_reward|eval/reward|eval/pass@1)$"),
)
KEYS_SHOWN = 8


@dataclass
class Choice:
    """The keys used for a foreign run and what the user should know about them."""

    entropy_key: str
    metric_key: str
    others: list[str]  # other validation keys of the same kind (several validation sets)


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:KEYS_SHOWN]) + (f", ... ({len(keys)} keys)" if len(keys) > KEYS_SHOWN else "")


def _n_of(key: str) -> int:
    m = re.search(r"@(\d+)$", key)
    return int(m.group(1)) if m else 0


def choose_keys(log: EngineLog, entropy_key: str | None = None, metric: str | None = None) -> Choice:
    """The entropy and validation keys of ``log``: the given ones (each must be logged), else the engines'
    defaults. Refuses in one line naming the file, the keys found and the flag to use."""
    keys = log.keys()
    if entropy_key is not None:
        if entropy_key not in keys:
            raise UserError(f"{log.path}: --entropy-key {entropy_key!r} is not logged; keys found: {_shown(keys)}")
        ent = entropy_key
    else:
        default = next((k for k in ENTROPY_KEYS if k in keys), None)
        if default is None:
            raise UserError(f"{log.path}: no policy entropy series (looked for {', '.join(ENTROPY_KEYS)}; keys "
                            f"found: {_shown(keys) or 'none'}); name it with --entropy-key KEY")
        ent = default
    if metric is not None:
        if metric not in keys:
            raise UserError(f"{log.path}: --metric {metric!r} is not logged; keys found: {_shown(keys)}")
        return Choice(ent, metric, [])
    for pattern in _METRIC_PATTERNS:
        found = sorted((k for k in keys if pattern.match(k)), key=lambda k: (_n_of(k), k))
        if found:
            return Choice(ent, found[0], found[1:])
    raise UserError(f"{log.path}: no validation score (looked for val-core/<data>/acc|reward/mean@N, "
                    f"val/test_score/<data>, eval_reward; keys found: {_shown(keys) or 'none'}); name it with "
                    "--metric KEY")


def paired_points(log: EngineLog, choice: Choice) -> tuple[list[int], list[float], list[float]]:
    """(steps, entropies, scores): each validation score with the policy entropy logged at the same step (a
    validation before training, with no entropy at its step, is left out)."""
    steps, hs, rs = [], [], []
    for step in sorted(log.rows):
        row = log.rows[step]
        if choice.metric_key in row and choice.entropy_key in row:
            steps.append(step)
            hs.append(row[choice.entropy_key])
            rs.append(row[choice.metric_key])
    return steps, hs, rs


def choice_note(log: EngineLog, choice: Choice) -> str:
    """What was read, in one line: the source, the keys, other validation sets and skipped lines."""
    note = f"{log.source} log {log.path}: H = {choice.entropy_key}, R = {choice.metric_key}"
    if choice.others:
        note += f" (also logged: {_shown(choice.others)}; pick one with --metric KEY)"
    if log.skipped:
        note += f"; {log.skipped} damaged line(s) or value(s) skipped"
    if log.unfinished:
        note += "; its unfinished last line (no newline: still being written) left out"
    return note


def fit_engine_log(path: str | Path, *, source: str | None = None, entropy_key: str | None = None,
                   metric: str | None = None, fit_frac: float = 0.2) -> dict[str, Any]:
    """``analysis.law.fit_run`` for a foreign run: the law fitted to its (H, R) pairs, its reliability, the
    forecast test at ``fit_frac`` and the last score forecast from the first 10/20/40% of the steps."""
    log = read_engine_log(path, source)
    choice = choose_keys(log, entropy_key, metric)
    steps, hs, rs = paired_points(log, choice)
    what = f"{log.path} ({choice.entropy_key} and {choice.metric_key} at the same steps)"
    if not steps:
        raise UserError(f"{what}: no step logs both; name the keys with --entropy-key and --metric")
    return {"run": str(path), "source": log.source, "entropy": choice.entropy_key, "metric": choice.metric_key,
            "other_metrics": choice.others, "skipped": log.skipped, "unfinished": log.unfinished,
            "note": choice_note(log, choice),
            **fit_and_forecast(steps, hs, rs, fit_frac, what)}


def engine_run(path: str | Path, *, source: str | None = None, entropy_key: str | None = None,
               metric: str | None = None) -> RunData:
    """A foreign run as the report's ``RunData``: per step ``entropy/mean`` (the policy entropy),
    ``reward/mean`` (the training reward, where logged) and, at validation steps, ``eval/pass@1`` holding the
    chosen validation score (``cfg["byo"]`` names the keys); its law pairs the score with the training
    entropy of the same step (``law_entropy="train"``)."""
    log = read_engine_log(path, source)
    choice = choose_keys(log, entropy_key, metric)
    keys = log.keys()
    reward = next((k for k in REWARD_KEYS if k in keys), None)
    rows: list[dict] = []
    for step in sorted(log.rows):
        src = log.rows[step]
        row: dict[str, Any] = {"step": step}
        if choice.entropy_key in src:
            row["entropy/mean"] = src[choice.entropy_key]
        if reward is not None and reward in src:
            row["reward/mean"] = src[reward]
        if choice.metric_key in src:
            row["eval/pass@1"] = src[choice.metric_key]
        if len(row) > 1:
            rows.append(row)
    p = Path(path)
    name = p.parent.name if p.name == "trainer_state.json" else p.name
    engine = log.source.split("-")[0]
    cfg = {"byo": {"source": log.source, "entropy_key": choice.entropy_key, "metric_key": choice.metric_key,
                   "reward_key": reward, "other_metrics": choice.others, "skipped": log.skipped,
                   "unfinished": log.unfinished,
                   "note": choice_note(log, choice)}}
    run = RunData(path=p, name=name, method=engine, label=name, seed=None, cfg=cfg, rows=rows, records=[],
                  variant=name, engine=engine, model="?", law_entropy="train", engine_log=log)
    run.train_rows = [x for x in rows if x["step"] >= 1 and ("entropy/mean" in x or "reward/mean" in x)]
    run.eval_rows = [x for x in rows if "eval/pass@1" in x]
    return run


def load_runs(paths: Sequence[str | Path], *, source: str | None = None, entropy_key: str | None = None,
              metric: str | None = None) -> list[RunData]:
    """The runs of ``paths`` for the report: erft run directories (and folders of them) by ``load_run``, any
    other path as another engine's run (``engine_run``; ``source`` forces the reader for those)."""
    if not paths:
        raise UserError("give at least one RUN_DIR (a run directory, an erft compare folder, or another engine's "
                        "log)")
    runs: list[RunData] = []
    for raw in paths:
        p = Path(raw)
        if source is None and is_erft_path(p):
            runs.extend(load_run(d) for d in expand_run_dirs([p]))
        else:
            runs.append(engine_run(p, source=source, entropy_key=entropy_key, metric=metric))
    seen: set[Path] = set()
    unique: list[RunData] = []
    for r in runs:
        key = r.path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return unique
