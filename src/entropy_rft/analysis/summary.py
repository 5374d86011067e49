"""Summaries of run directories: final and best figures per run, mean ± std across seeds per method."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from entropy_rft.analysis.agreement import run_agreement
from entropy_rft.analysis.equal_entropy import compare_markdown
from entropy_rft.analysis.law import run_law
from entropy_rft.common.text import table_cell
from entropy_rft.control.autopilot import tracking
from entropy_rft.rundir.files import read_step_log


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
            # K = samples per problem; avg@K is logged whatever K is
            if key.startswith("eval/avg@") and key[9:].isdigit():
                return int(key[9:])
    return None


OWN_LAW = " (own law)"  # the method_name suffix of a method's own control law at a setpoint


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's ``config.yaml`` as a dict for reading (``{}`` when it has none); a damaged one is
    refused in one line with the ``cp`` that restores it (``checkpoints.read_config_dict``)."""
    from entropy_rft.rundir.checkpoints import read_config_dict

    return read_config_dict(run_dir) if (Path(run_dir) / "config.yaml").is_file() else {}


def run_summary(run_dir: str | Path, *, rows: list[dict] | None = None,
                cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Figures of one run: final/best accuracy, Pass@K, diversity, entropy path, probe and control.

    ``rows`` and ``cfg``: the run's metrics rows and config when the caller has read them already (else read
    here, with :func:`read_step_log` and :func:`read_run_config`)."""
    run_dir = Path(run_dir)
    if rows is None:
        rows = read_step_log(run_dir / "metrics.jsonl")
    if cfg is None:
        cfg = read_run_config(run_dir)
    train_rows = [r for r in rows if r["step"] >= 1]
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
    out["method_name"] = out["method"]  # erft compare and the report overwrite "method" with the series label
    out.update(prompt_standard_errors(final.get("eval/pass_rate_hist") if final else None))
    method = cfg.get("method") or {}
    target = method.get("entropy_target")
    out["setpoint"] = "preset" if target is None else str(target)
    own = (method.get("params") or {}).get("target") if isinstance(method.get("params"), dict) else None
    out["controller/target_spec"] = str(target) if target is not None else (None if own is None else str(own))
    out["train/entropy_held"] = _mean_of(train_rows[len(train_rows) // 2:], "entropy/mean")
    out["time/step_train"] = train_step_time(train_rows)
    out["control/touched_frac"] = touched_frac(out["method"], train_rows)
    out.update(setpoint_tracking(train_rows))
    out.update(controller_tracking(train_rows))
    own_variant = method.get("label") not in (None, method.get("name"))  # e.g. entropic:target=0.5x
    if out["controller/kind"] == "own" and target is None and own_variant and out["controller/target_spec"]:
        # a method's own law at a setpoint: its own row in that setpoint's block, next to the autopilot's
        out["setpoint"] = out["controller/target_spec"]
        out["method_name"] = out["method"] + OWN_LAW
    out.update(run_agreement(train_rows))
    out.update(run_law(rows))
    return out


def prompt_standard_errors(hist: Any) -> dict[str, float | None]:
    """Standard errors of the final pass@1 and pass@K over the validation prompts, from the pass-rate histogram
    (``hist[c]`` prompts had c of K samples correct): per prompt pass@1 = c/K and pass@K = [c > 0]; the standard
    error is their sample standard deviation over the P prompts divided by √P."""
    out: dict[str, float | None] = {"final/pass@1_se": None, "final/pass@K_se": None}
    if not isinstance(hist, list) or len(hist) < 2 or sum(hist) < 2:
        return out
    k = len(hist) - 1
    counts = np.repeat(np.arange(k + 1), np.asarray(hist, dtype=np.int64))
    n = counts.size
    out["final/pass@1_se"] = float(np.std(counts / k, ddof=1) / math.sqrt(n))
    out["final/pass@K_se"] = float(np.std((counts > 0).astype(np.float64), ddof=1) / math.sqrt(n))
    return out


# Per-step times that measure rather than train: left out of a method's step-time overhead.
MEASUREMENT_TIMES = ("time/eval", "time/probe", "time/counterfactual")


def train_step_time(train_rows: list[dict]) -> float | None:
    """The median over steps of the training part of a step: ``time/step`` less its evaluation and probes
    (``MEASUREMENT_TIMES``). The median, because a run that shares the CPU has slow outliers."""
    vals = [float(r["time/step"]) - sum(float(r.get(k) or 0.0) for k in MEASUREMENT_TIMES)
            for r in train_rows if isinstance(r.get("time/step"), (int, float))]
    return float(np.median(vals)) if vals else None


def touched_frac(method: str | None, train_rows: list[dict]) -> float | None:
    """Share of response tokens whose loss the method changed, mean over steps.

    Masking methods (ClipB, ClipV, Clip-Cov, 80/20, grad_mask): the tokens they kept out of the gradient,
    1 − ``control/kept_frac``. KL-Cov: the tokens it penalised (``control/kl_cov_selected_frac``). The entropy
    bonus changes every token's loss (1). Clip-higher and Flexible Entropy Control move the ratio bounds and select
    no token (None). Entrocraft changes every token's advantage on the steps it leaves GRPO (RAFT++ or NSR: the
    share of steps with ``control/own_output`` ≠ 0); AEPO the tokens of the rollouts it swaps in
    (``control/spliced_frac``, per rollout).
    """
    if method in ("clip_higher", "fec"):
        return None
    if method == "entrocraft":
        modes = [r["control/own_output"] for r in train_rows if isinstance(r.get("control/own_output"), (int, float))]
        return float(np.mean([m != 0 for m in modes])) if modes else None
    if method == "aepo":
        return _mean_of(train_rows, "control/spliced_frac")
    if method == "entropy_bonus":
        return 1.0
    if method == "kl_cov":
        return _mean_of(train_rows, "control/kl_cov_selected_frac")
    kept = _mean_of(train_rows, "control/kept_frac")
    return None if kept is None else 1.0 - kept


def setpoint_tracking(train_rows: list[dict], band: float = 0.15) -> dict[str, Any]:
    """How an autopilot run held its setpoint: ``autopilot/reach_step`` (None: never reached) and the share of
    the steps after it with the smoothed entropy the controller reads (``autopilot/in_band``) and the raw
    batch entropy (``autopilot/in_band_raw``) within ±band of the target; of the smoothed entropy's steps outside
    the band, ``autopilot/out_of_band`` counts them all and ``autopilot/out_with_room`` those at which the knob
    was not pushing as hard as it could toward the correction (``control/saturated``; None in runs that predate
    it). All None without a target."""
    out: dict[str, Any] = {"autopilot/reach_step": None, "autopilot/in_band": None, "autopilot/in_band_raw": None,
                           "autopilot/out_of_band": None, "autopilot/out_with_room": None}
    rows = [r for r in train_rows if isinstance(r.get("control/entropy_target"), (int, float))
            and isinstance(r.get("control/entropy_smoothed"), (int, float))
            and isinstance(r.get("entropy/mean"), (int, float))]
    if not rows:
        return out
    steps = [int(r["step"]) for r in rows]
    target = [float(r["control/entropy_target"]) for r in rows]
    logged = "control/saturated" in rows[0]
    smooth = tracking(steps, [float(r["control/entropy_smoothed"]) for r in rows], target, band,
                      [r.get("control/saturated") for r in rows] if logged else None)
    raw = tracking(steps, [float(r["entropy/mean"]) for r in rows], target, band)
    out["autopilot/reach_step"] = smooth["reach_step"]
    out["autopilot/in_band"] = smooth["in_band_frac_after"]
    out["autopilot/out_of_band"] = smooth["out_of_band"]
    out["autopilot/out_with_room"] = smooth["out_with_room"]
    out["autopilot/in_band_raw"] = raw["in_band_frac_after"]
    return out


def controller_tracking(train_rows: list[dict], band: float = 0.15) -> dict[str, Any]:
    """How the run's entropy controller held its target, the same figures for either kind so the two can be
    compared at equal setpoints: ``controller/kind`` ("autopilot": ``control/entropy_target``; "own": a controller
    method's own law, ``control/own_target``; None: no controller), and over the training batch entropy
    (``entropy/mean``) after it first reached the target, ``controller/in_band`` (share of steps within ±band) and
    ``controller/max_dev`` (the worst relative excursion |H − H*|/H*); ``controller/reach_step``."""
    out: dict[str, Any] = {"controller/kind": None, "controller/reach_step": None, "controller/in_band": None,
                           "controller/max_dev": None}
    for kind, key in (("autopilot", "control/entropy_target"), ("own", "control/own_target")):
        rows = [r for r in train_rows if isinstance(r.get(key), (int, float))
                and isinstance(r.get("entropy/mean"), (int, float))]
        if rows:
            t = tracking([int(r["step"]) for r in rows], [float(r["entropy/mean"]) for r in rows],
                         [float(r[key]) for r in rows], band)
            out.update({"controller/kind": kind, "controller/reach_step": t["reach_step"],
                        "controller/in_band": t["in_band_frac_after"], "controller/max_dev": t["max_rel_dev_after"]})
            break
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
            vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
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
        lines.append(f"| {table_cell(method)} | {a['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def knob_last(rows: Sequence[dict[str, Any]]) -> float | None:
    """The last ``control/knob`` of a run's rows (the strength the autopilot ended at), None when it logged none."""
    vals = [r["control/knob"] for r in rows if isinstance(r.get("control/knob"), (int, float))]
    return vals[-1] if vals else None


def compare_summary(runs: Sequence[tuple[str, Path]], *, knob: bool, equal_entropy: bool
                    ) -> tuple[dict[str, Any], str, str]:
    """What ``erft compare`` writes for its runs (``(label, run_dir)``, in table order): summary.json's numbers,
    summary.md's text and the shorter table it prints. ``knob``: add each run's last knob value (the sweep has
    autopilot variants); ``equal_entropy``: add the comparison at equal entropy (``equal_entropy.compare_markdown``)."""
    summaries = []
    for label, run_dir in runs:
        rows = read_step_log(Path(run_dir) / "metrics.jsonl")  # once, for the summary and the last knob
        summ = run_summary(run_dir, rows=rows)
        summ["method"] = label
        summ["control/knob_last"] = knob_last(rows)
        summaries.append(summ)
    agg = aggregate(summaries)
    columns: tuple[str, ...] = DEFAULT_COLUMNS
    short: tuple[str, ...] = SHORT_COLUMNS
    if knob:
        columns, short = (*DEFAULT_COLUMNS, "control/knob_last"), (*SHORT_COLUMNS, "control/knob_last")
    table = markdown_table(agg, columns)
    numbers: dict[str, Any] = {"runs": summaries, "methods": agg}
    if equal_entropy:
        table, short_table = compare_markdown(summaries, numbers, table)
    else:
        short_table = markdown_table(agg, short)  # the full table is in summary.md
    return numbers, table, short_table
