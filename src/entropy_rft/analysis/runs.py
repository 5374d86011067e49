"""Run directories as data: ``load_run`` reads a run's config, metrics, token records and evaluation
histograms into a ``RunData``, with what the reading left out or could not tell (``RunData.gaps``);
``assign_labels`` groups runs into series (the method with its variant, then the engine and the model, each only
where the runs given differ in it, then the settings in which runs of one label differ; seeds of one series are
averaged); ``incomplete`` says, one line each, what of the runs given a report leaves out.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from entropy_rft.analysis.engine_logs import EngineLog
from entropy_rft.analysis.summary import read_run_config
from entropy_rft.common.errors import UserError
from entropy_rft.common.streams import LineCounts
from entropy_rft.config.loading import config_from_dict
from entropy_rft.config.schema import Config, changed_fields
from entropy_rft.control.lens import QUADRANTS
from entropy_rft.policy.evaluation import pass_at_k_from_hist
from entropy_rft.rundir.files import has_metrics, read_jsonl, read_status, read_step_log


@dataclass
class RunData:
    path: Path
    name: str
    method: str
    label: str  # the series this run belongs to (assign_labels); the variant until then
    seed: int | str | None  # a damaged recorded seed is kept as text: only compared
    cfg: dict
    rows: list[dict]
    records: list[dict]
    train_rows: list[dict] = field(default_factory=list)
    eval_rows: list[dict] = field(default_factory=list)
    k: int | None = None
    base_hist: list[int] | None = None
    final_hist: list[int] | None = None
    variant: str = ""  # the method with its variant: clip_v, clip_v:mu=3, clip_v@target=0.43
    engine: str = "native"
    model: str = "default"
    law_entropy: str = "eval"  # the law's H (analysis.law.law_points): "train" for runs without eval/entropy
    settings: dict[str, str] = field(default_factory=dict)  # the settings its label names (assign_labels)
    gaps: list[str] = field(default_factory=list)  # what reading it left out or could not tell (_reading_gaps)
    engine_log: EngineLog | None = None  # another engine's run: the log it was read from (byo.engine_run)


UNKNOWN = "unknown"  # the method and model of a run without config.yaml: shown apart, never as a default


def expand_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Run directories as given; a folder that is not one contributes its run-directory children (sorted)."""
    if not paths:
        raise UserError("give at least one RUN_DIR (a run directory or an erft compare folder)")
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise UserError(f"{p}: no such directory; give a run directory or an erft compare --out folder")
        if has_metrics(p):
            out.append(p)
            continue
        kids = sorted(c for c in p.iterdir() if has_metrics(c)) if p.is_dir() else []
        if not kids:
            raise UserError(f"{p}: not a run directory (no metrics.jsonl) and holds none; give the --out "
                            "folder of erft train or erft compare")
        out.extend(kids)
    seen: set[Path] = set()
    unique: list[Path] = []
    for p in out:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def _label(cfg: dict) -> tuple[str, str]:
    m = cfg.get("method") or {}
    name = str(m.get("name") or "none")
    if m.get("label"):  # erft compare names its variants (clip_v:mu=1.5, clip_v@target=0.43)
        return name, str(m["label"])
    if m.get("entropy_target") is not None:
        return name, f"{name}@target={m['entropy_target']}"
    params = {**((m.get("presets") or {}).get(name) or {}), **(m.get("params") or {})}
    if name == "grad_mask":
        a = ">" if params.get("sample_sign", "positive") == "positive" else "<"
        s = ">" if params.get("s_sign", "positive") == "positive" else "<"
        field_ = "S_c" if params.get("s_field") == "s_centered" else "S"
        return name, f"grad_mask A{a}0 {field_}{s}0"
    return name, name


def _hist(v: Any) -> list[int] | None:
    """A pass-rate histogram (counts of prompts by correct samples), or None when the logged value is not one."""
    if isinstance(v, list) and len(v) >= 2 and all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0 and c == int(c)
            for c in v):
        return [int(c) for c in v]
    return None


def _reading_gaps(path: Path, counts: dict[str, LineCounts], status: dict, has_config: bool) -> list[str]:
    """One line for each thing that reading the run ``path`` left out or could not tell: a log's unfinished last
    line (``counts``, by file name), no ``run.json`` (or one that does not read), no ``config.yaml``."""
    gaps = [f"{path / name}: its last line is unfinished (no newline at its end: a write cut by a kill, or a copy "
            "still under way) and is left out; copy the run again once its writer has finished"
            for name, c in counts.items() if c.unfinished]
    if not os.path.lexists(path / "run.json"):
        gaps.append(f"{path}: no run.json, so whether the run finished is unknown; its rows are read as they are: "
                    "copy the whole run folder")
    elif not status:
        gaps.append(f"{path / 'run.json'}: not a JSON object, so whether the run finished is unknown; its rows are "
                    "read as they are: copy the run's run.json again")
    if not has_config:
        gaps.append(f"{path}: no config.yaml, so its method, model and seed are unknown; shown as the series "
                    f"'{UNKNOWN}', a run of no method: copy the run's config.yaml beside its metrics.jsonl")
    return gaps


def load_run(path: Path) -> RunData:
    """A run directory as ``RunData``: a run without ``config.yaml`` has the method and model ``UNKNOWN``; what
    the reading left out or could not tell is in ``gaps``."""
    cfg = read_run_config(path)  # {} without config.yaml
    has_config = (path / "config.yaml").is_file()
    counts = {"metrics.jsonl": LineCounts(), "token_records.jsonl": LineCounts()}
    rows = read_step_log(path / "metrics.jsonl", counts["metrics.jsonl"])
    if not rows:
        raise UserError(f"{path / 'metrics.jsonl'}: empty; the run has not logged a step yet")
    method, label = _label(cfg) if has_config else (UNKNOWN, UNKNOWN)
    status = read_status(path)  # run.json: the TRL engine records engine="trl" there too
    engine = str(cfg.get("engine") or status.get("engine") or "native")
    model = str((cfg.get("model") or {}).get("name") or "default") if has_config else UNKNOWN
    seed = (cfg.get("train") or {}).get("seed")
    if seed is not None and not isinstance(seed, (int, str)):
        seed = str(seed)  # only compared: a damaged value must not stop the report
    r = RunData(path=path, name=path.name, method=method, label=label, seed=seed, cfg=cfg, rows=rows,
                records=read_jsonl(path / "token_records.jsonl", counts["token_records.jsonl"]), variant=label,
                engine=engine, model=model)
    r.gaps = _reading_gaps(path, counts, status, has_config)
    r.train_rows = [x for x in rows if x["step"] >= 1]  # read_step_log: every step is an integer >= 0
    r.eval_rows = [x for x in rows if isinstance(x.get("eval/pass@1"), (int, float))]
    for x in r.eval_rows:
        ks = [int(k[9:]) for k in x if k.startswith("eval/avg@") and k[9:].isdigit()]
        if ks:
            r.k = ks[0]
            break
    hists = [(x["step"], h) for x in r.eval_rows if (h := _hist(x.get("eval/pass_rate_hist"))) is not None]
    if hists:
        if hists[0][0] == 0:
            r.base_hist = hists[0][1]
        r.final_hist = hists[-1][1]
    return r


def _model_short(name: str) -> str:
    """A local model folder by its last component (a hub id such as Qwen/Qwen2.5-7B as it is)."""
    if name.startswith(("/", "./", "../", "~")) or (os.sep in name and Path(name).exists()):
        return Path(name).name or name
    return name


SEED_FIELDS = ("train.seed", "train.max_steps")  # all that seeds of one series may differ in (as erft compare)


def _dir_names(rs: Sequence[RunData]) -> list[str]:
    """The runs' directory names, or their full paths where two of them share a name."""
    names = [r.name for r in rs]
    return names if len(set(names)) == len(names) else [str(r.path) for r in rs]


def _settings(r: RunData) -> Config | str:
    """The run's recorded settings as a ``Config`` (``config_from_dict``, the method's registry check left out),
    or why they do not read as one (a hand-written config, another version's)."""
    try:
        return config_from_dict(r.cfg, check_method=False)
    except UserError as e:
        return str(e)


def _value_words(v: Any) -> str:
    """A setting's value as ``--set`` takes it: text as it is, anything else as JSON (0.0002, null, true)."""
    return v if isinstance(v, str) else json.dumps(v, default=str)


def _differing_settings(read: Sequence[Config | str]) -> list[dict[str, str]]:
    """Per run, the values (``_value_words``) of the fields in which the runs read differ, but the seed and
    ``train.max_steps`` (``changed_fields`` against the first run read, as erft compare's check); ``{}`` for a
    run whose settings did not read."""
    cfgs = [(i, c) for i, c in enumerate(read) if not isinstance(c, str)]
    if len(cfgs) < 2:
        return [{} for _ in read]
    i0, c0 = cfgs[0]
    per: list[dict[str, Any]] = [{} for _ in read]  # per run: the fields in which it and the first run read differ
    for i, c in cfgs[1:]:
        for key, first, this in changed_fields(c0, c, ignore=SEED_FIELDS):
            per[i0][key], per[i][key] = first, this
    return [{} if isinstance(c, str) else {k: _value_words(per[i].get(k, v0)) for k, v0 in sorted(per[i0].items())}
            for i, c in enumerate(read)]


def _split_by_settings(label: str, rs: Sequence[RunData]) -> list[str]:
    """Runs of one label (with a recorded seed) whose settings differ become one series per setting, labelled
    with the differing fields (``none (optim.lr=0.05)``); a run whose settings do not read is a series of its
    own (``none [run dir]``). Returns the notes that say so."""
    read = [_settings(r) for r in rs]
    differing = _differing_settings(read)
    notes: list[str] = []
    for r, c, d, name in zip(rs, read, differing, _dir_names(rs)):
        if isinstance(c, str):
            r.label = f"{label} [{name}]"
            notes.append(f"{name}: settings not compared ({c}); a series of its own, not a seed of {label}")
        elif d:
            r.settings = d
            r.label = f"{label} ({', '.join(f'{k}={v}' for k, v in d.items())})"
    if any(differing):
        keys = next(d for d in differing if d)
        values = {k: list(dict.fromkeys(d[k] for d in differing if d)) for k in keys}
        notes.append(f"the runs of {label} differ in settings other than the seed: "
                     + "; ".join(f"{k} ({', '.join(v)})" for k, v in values.items())
                     + "; each setting is a series of its own, not averaged as seeds")
    return notes


def _by_label(runs: Sequence[RunData]) -> dict[str, list[RunData]]:
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.label, []).append(r)
    return groups


def assign_labels(runs: Sequence[RunData]) -> list[str]:
    """Set each run's series label: its variant, then its engine and model where the runs differ in them, then
    the settings in which runs of one label differ (all fields but ``train.seed`` and ``train.max_steps``:
    erft compare refuses to mix other settings in one table; ``_split_by_settings``). Returns the notes that
    name those settings.

    Runs of one label are seeds only when their ``train.seed`` values are distinct; otherwise (the same seed
    twice, or a seed missing) each of them is its own series, labelled with its run directory's name.
    """
    parts = [lambda r: r.variant]
    if len({r.engine for r in runs}) > 1:
        parts.append(lambda r: r.engine)
    models = {r.model for r in runs if r.model != UNKNOWN}  # a run of unknown model is a series apart already
    if len(models) > 1:
        short = {m: _model_short(m) for m in models}
        if len(set(short.values())) < len(short):  # two folders of one name: keep the full names
            short = {m: m for m in models}
        parts.append(lambda r: short.get(r.model, r.model))
    for r in runs:
        r.label = " · ".join(f(r) for f in parts)
        r.settings = {}
    notes: list[str] = []
    for label, rs in _by_label(runs).items():
        seeded = [r for r in rs if r.seed is not None]  # another engine's run records no settings of erft's
        if len(seeded) > 1:
            notes += _split_by_settings(label, seeded)
    for label, rs in _by_label(runs).items():
        seeds = [r.seed for r in rs]
        if len(rs) > 1 and (None in seeds or len(set(seeds)) < len(seeds)):
            for r, n in zip(rs, _dir_names(rs)):
                r.label = f"{label} [{n}]"
    return notes


def _last_step(r: RunData) -> int:
    return max((int(x.get("step", 0)) for x in r.rows), default=0)


def fewer_steps(runs: Sequence[RunData]) -> list[str]:
    """One line for each run whose last step is earlier than its siblings': the other runs given with its engine
    and its recorded ``train.max_steps`` (for a run that records none, the other runs of its series)."""
    def sibling_key(r: RunData) -> tuple[str, str, Any]:
        planned = (r.cfg.get("train") or {}).get("max_steps")
        if isinstance(planned, int) and not isinstance(planned, bool):
            return r.engine, "train.max_steps", planned
        return r.engine, "the series", r.label

    groups: dict[tuple[str, str, Any], list[RunData]] = {}
    for r in runs:
        groups.setdefault(sibling_key(r), []).append(r)
    notes = []
    for r in runs:
        (_, kind, value), rs = sibling_key(r), groups[sibling_key(r)]
        most = max(_last_step(x) for x in rs)
        if _last_step(r) < most:
            longest = [n for x, n in zip(rs, _dir_names(rs)) if _last_step(x) == most]
            who = ", ".join(longest[:3]) + (f" and {len(longest) - 3} more" if len(longest) > 3 else "")
            notes.append(f"{r.path}: it ends at step {_last_step(r)}, its siblings at step {most} (the runs of {kind} "
                         f"{value}: {who}); its last steps are missing (a run still training, stopped, or copied in "
                         "part): resume it, or copy it again once it has finished")
    return notes


def incomplete(runs: Sequence[RunData]) -> list[str]:
    """What a report of ``runs`` leaves out or cannot tell, one line each: each run's ``gaps``, then the runs that
    stop short of their siblings (``fewer_steps``; call it after ``assign_labels``)."""
    return [g for r in runs for g in r.gaps] + fewer_steps(runs)


def series_info(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """Per series (in report order): label, method, variant, engine, model, the settings its label names, and its
    runs and seeds."""
    out = []
    for label, rs in by_label(runs):
        out.append({"label": label, "method": rs[0].method, "variant": rs[0].variant, "engine": rs[0].engine,
                    "model": rs[0].model, "settings": rs[0].settings, "n": len(rs), "runs": [str(r.path) for r in rs],
                    "seeds": [r.seed for r in rs]})
    return out


QUADRANT_LABELS = {
    "pos_spos": "A>0, S_c>0",
    "pos_sneg": "A>0, S_c≤0",
    "neg_spos": "A<0, S_c>0",
    "neg_sneg": "A<0, S_c≤0",
    "zero": "A=0",
}


def methods_in_order(runs: Sequence[RunData]) -> list[str]:
    """Series labels in order of first appearance, those of the vanilla baseline (method 'none') first."""
    labels = list(dict.fromkeys(r.label for r in runs))
    base = {r.label for r in runs if r.method == "none"}
    return sorted(labels, key=lambda lab: lab not in base)


def by_label(runs: Sequence[RunData]) -> list[tuple[str, list[RunData]]]:
    """(label, its runs) in ``methods_in_order``: a series and its seeds."""
    return [(lab, [r for r in runs if r.label == lab]) for lab in methods_in_order(runs)]


def series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where ``key`` is a finite number."""
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(row.get("step", 0)))
            ys.append(float(v))
    return xs, ys


def mean_series(runs: Sequence[RunData], key: str, rows: str = "train_rows") -> tuple[list[int], list[float]]:
    """The mean over seeds of ``key``: at the steps that every run which logged ``key`` has (so a shorter
    seed ends the mean curve rather than making it jump), the mean of those runs' values."""
    per = [dict(zip(*series(getattr(r, rows), key))) for r in runs]
    per = [p for p in per if p]
    if not per:
        return [], []
    steps = sorted(set.intersection(*(set(p) for p in per)))
    return steps, [float(np.mean([p[s] for p in per])) for s in steps]


def logged(runs: Sequence[RunData], key: str) -> bool:
    """True when some run's training rows hold ``key`` as a finite number."""
    return any(series(r.train_rows, key)[0] for r in runs)


def lens_means(runs: Sequence[RunData], prefix: str = "lens") -> dict[str, dict[str, float | None]]:
    """Per method label: mean over training steps (and seeds) of drop_frac/<q> and dH_dropped/<q>."""
    out: dict[str, dict[str, float | None]] = {}
    for label in methods_in_order(runs):
        rows = [row for r in runs if r.label == label for row in r.train_rows]
        d: dict[str, float | None] = {}
        for key in ["drop_frac", "dH_dropped", "dH_kept", "dH_total"] + \
                   [f"{m}/{q}" for m in ("drop_frac", "dH_dropped") for q in QUADRANTS]:
            _, ys = series(rows, f"{prefix}/{key}")
            d[key] = float(np.mean(ys)) if ys else None
        out[label] = d
    return out


def pass_curve(hist: Sequence[int]) -> list[float]:
    """Mean unbiased Pass@k for k = 1..K from a pass-rate histogram (hist[c] = #problems with c of K right)."""
    n = len(hist) - 1
    total = sum(hist)
    if n < 1 or total == 0:
        return []
    return list(pass_at_k_from_hist(hist, range(1, n + 1)).values())


def rolling(ys: Sequence[float], n: int) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > n:
            acc.pop(0)
        out.append(float(np.mean(acc)))
    return out
