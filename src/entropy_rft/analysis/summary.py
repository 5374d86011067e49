"""Summaries of run directories: final and best figures per run, mean ± std across seeds per method."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from entropy_rft.rundir import read_jsonl


def _last(rows: list[dict], key: str) -> Any:
    for r in reversed(rows):
        if r.get(key) is not None:
            return r[key]
    return None


def _mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return float(np.mean(vals)) if vals else None


def _k(rows: list[dict]) -> int | None:
    for r in rows:
        for key in r:
            if key.startswith("eval/avg@"):  # K = samples per problem; avg@K is logged whatever K is
                return int(key.split("@")[1])
    return None


def run_summary(run_dir: str | Path) -> dict[str, Any]:
    """Figures of one run: final/best accuracy, Pass@K, diversity, entropy path, probe and control."""
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    train_rows = [r for r in rows if r.get("step", 0) >= 1]
    evals = [r for r in rows if "eval/pass@1" in r]
    k = _k(rows)
    base = evals[0] if evals and evals[0].get("step") == 0 else None
    final = evals[-1] if evals else None
    out: dict[str, Any] = {
        "run": run_dir.name,
        "method": (cfg.get("method") or {}).get("name"),
        "seed": (cfg.get("train") or {}).get("seed"),
        "steps": train_rows[-1]["step"] if train_rows else 0,
        "k": k,
        "final/pass@1": final.get("eval/pass@1") if final else None,
        "best/pass@1": max((r["eval/pass@1"] for r in evals if r.get("eval/pass@1") is not None), default=None),
        f"final/pass@{k}": final.get(f"eval/pass@{k}") if final and k else None,
        f"best/pass@{k}": max((r[f"eval/pass@{k}"] for r in evals if r.get(f"eval/pass@{k}") is not None),
                              default=None) if k else None,
        f"final/avg@{k}": final.get(f"eval/avg@{k}") if final and k else None,
        f"best/avg@{k}": max((r[f"eval/avg@{k}"] for r in evals if r.get(f"eval/avg@{k}") is not None),
                             default=None) if k else None,
        f"final/maj@{k}": final.get(f"eval/maj@{k}") if final and k else None,
        "base/pass@1": base.get("eval/pass@1") if base else None,
        f"base/pass@{k}": base.get(f"eval/pass@{k}") if base and k else None,
        "final/distinct_correct": final.get("eval/distinct_correct") if final else None,
        "base/entropy": base.get("eval/entropy") if base else None,
        "final/entropy": final.get("eval/entropy") if final else None,
        "train/entropy_first": train_rows[0].get("entropy/mean") if train_rows else None,
        "train/entropy_last": _last(train_rows, "entropy/mean"),
        "probe/sign_agreement": _mean_of(train_rows, "probe/sign_agreement"),
        "probe/sign_agreement_weighted": _mean_of(train_rows, "probe/sign_agreement_weighted"),
        "probe/corr": _mean_of(train_rows, "probe/corr"),
        "probe/batch_sign_agree": _mean_of(train_rows, "probe/batch_sign_agree"),
        "control/kept_frac": _mean_of(train_rows, "control/kept_frac"),
        "time/step": _mean_of(train_rows, "time/step"),
    }
    if out["base/entropy"] is not None and out["final/entropy"] is not None:
        out["entropy_drop"] = out["base/entropy"] - out["final/entropy"]
    else:
        out["entropy_drop"] = None
    for s in ENTROPY_STEPS:
        row = next((r for r in train_rows if r["step"] == s), None)
        if row is not None:
            out[f"entropy@{s}"] = row.get("entropy/mean")
    return out


# Training steps at which the batch entropy is reported (those the run reached).
ENTROPY_STEPS = (1, 10, 25, 50, 100, 200, 300, 500, 800)


def aggregate(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Group run summaries by method: mean and std (population) of every numeric figure, and n seeds."""
    by: dict[str, list[dict]] = {}
    for s in summaries:
        by.setdefault(str(s["method"]), []).append(s)
    out = {}
    for method, runs in by.items():
        keys = [k for k in runs[0] if k not in ("run", "method", "seed")]
        agg: dict[str, Any] = {"n": len(runs)}
        for key in keys:
            vals = [r.get(key) for r in runs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            agg[key] = {"mean": float(np.mean(vals)), "std": float(np.std(vals))} if vals else None
        out[method] = agg
    return out


DEFAULT_COLUMNS = ("final/pass@1", "best/pass@1", "final/avg@K", "final/pass@K", "best/pass@K",
                   "final/distinct_correct", "final/entropy", "entropy_drop", "entropy@*",
                   "probe/sign_agreement", "probe/sign_agreement_weighted", "probe/batch_sign_agree",
                   "control/kept_frac")


# What `erft compare` prints (the full DEFAULT_COLUMNS table goes to summary.md).
SHORT_COLUMNS = ("final/pass@1", "final/pass@K", "final/distinct_correct", "final/entropy", "entropy_drop",
                 "probe/sign_agreement", "probe/sign_agreement_weighted", "probe/batch_sign_agree",
                 "control/kept_frac")


def expand_columns(agg: dict[str, dict[str, Any]], columns: Sequence[str]) -> list[str]:
    """'entropy@*' becomes one column per fixed step that some method reached."""
    out: list[str] = []
    for c in columns:
        if c == "entropy@*":
            steps = sorted({int(k.split("@")[1]) for a in agg.values() for k in a
                            if k.startswith("entropy@") and a[k] is not None})
            out += [f"entropy@{s}" for s in steps]
        else:
            out.append(c)
    return out


def markdown_table(agg: dict[str, dict[str, Any]], columns: Sequence[str] = DEFAULT_COLUMNS,
                   first: str = "method") -> str:
    """A markdown table, one row per method (``first`` names that column), cells 'mean ± std' (std omitted
    for one seed).

    A column name with '@K' stands for the run's own K (e.g. final/pass@K -> final/pass@8).
    """
    def key_for(method_agg: dict, col: str) -> str:
        if col.endswith("@K"):
            prefix = col[:-1]
            return next((k for k in method_agg if k.startswith(prefix) and k != prefix + "1"), col)
        return col

    columns = expand_columns(agg, columns)
    head = f"| {first} | seeds | " + " | ".join(columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 2)]
    for method, a in agg.items():
        cells = []
        for c in columns:
            v = a.get(key_for(a, c))
            if v is None:
                cells.append("–")
            elif a["n"] > 1:
                cells.append(f"{v['mean']:.3f} ± {v['std']:.3f}")
            else:
                cells.append(f"{v['mean']:.3f}")
        lines.append(f"| {method} | {a['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
