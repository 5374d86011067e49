"""Paper A's four-condition gradient-masking ablation (Wang et al. 2026, arXiv 2602.03392, Sec. 4).

Each condition trains only the tokens of one advantage sign (A > 0 or A < 0 samples) whose discriminator S
has one sign; every other token is dropped from the loss (method ``grad_mask``). By Lemma 3.1 / Theorem 3.3
one step on a token moves the entropy by dH ≈ −α·S with α ∝ A, so the predicted direction is
sign(dH) = −sign(A)·sign(S):

=========  ==========================================  =================
condition  what trains                                 predicted entropy
=========  ==========================================  =================
A>0, S>0   rewarding likely tokens (sharpens)          falls
A>0, S<0   rewarding unlikely tokens                   rises
A<0, S>0   penalising likely tokens                    rises
A<0, S<0   penalising unlikely tokens (sharpens)       falls
=========  ==========================================  =================

A vanilla GRPO run on the same config and seed is the baseline. The observed direction of a condition is
the sign of its entropy change: mean training-batch entropy over the last ``window`` steps minus that over
the first ``window`` steps (``entropy/mean``). A change smaller than ``tol`` (relative to the start) counts
as flat. We also report the mean per-step entropy change the probe measured on each step's batch
(``probe/dH_actual``), and the change relative to the vanilla run.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from entropy_rft.common.errors import UserError
from entropy_rft.rundir.files import read_jsonl


@dataclass(frozen=True)
class Condition:
    name: str
    sample_sign: str  # "positive" (A > 0) or "negative" (A < 0)
    s_sign: str  # "positive" (S > 0) or "negative" (S < 0)

    @property
    def expected(self) -> int:
        """Predicted sign of the entropy change: −sign(A)·sign(S)."""
        a = 1 if self.sample_sign == "positive" else -1
        s = 1 if self.s_sign == "positive" else -1
        return -a * s

    @property
    def label(self) -> str:
        return f"A{'>' if self.sample_sign == 'positive' else '<'}0, S{'>' if self.s_sign == 'positive' else '<'}0"


CONDITIONS = (
    Condition("grad_mask-Apos-Spos", "positive", "positive"),
    Condition("grad_mask-Apos-Sneg", "positive", "negative"),
    Condition("grad_mask-Aneg-Spos", "negative", "positive"),
    Condition("grad_mask-Aneg-Sneg", "negative", "negative"),
)
BASELINE = "vanilla"
DIRECTION = {1: "rises", -1: "falls", 0: "flat"}


def method_extra(cond: Condition | None, s_field: str = "s_star") -> dict:
    """The config ``method`` section of one condition (None: the vanilla baseline)."""
    if cond is None:
        return {"method": {"name": "none", "params": {}}}
    return {"method": {"name": "grad_mask", "params": {"sample_sign": cond.sample_sign, "s_sign": cond.s_sign,
                                                       "s_field": s_field, "drop_other_samples": True}}}


def _vals(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows
            if int(r.get("step", 0)) >= 1 and isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def entropy_change(rows: Sequence[dict], window: int) -> dict[str, Any]:
    """First/last-window means of ``entropy/mean`` and their difference; mean per-step probe ΔH."""
    ent = _vals(rows, "entropy/mean")
    if len(ent) < 2:
        raise UserError(f"need at least 2 training steps with entropy/mean, found {len(ent)}; raise --steps")
    w = max(1, min(window, len(ent) // 2))
    first = float(np.mean([v for _, v in ent[:w]]))
    last = float(np.mean([v for _, v in ent[-w:]]))
    probe = [v for _, v in _vals(rows, "probe/dH_actual")]
    kept = [v for _, v in _vals(rows, "control/kept_frac")]
    return {"steps": ent[-1][0], "window": w, "first": first, "last": last, "change": last - first,
            "probe_dH_mean": float(np.mean(probe)) if probe else None,
            "kept_frac": float(np.mean(kept)) if kept else None}


def _sign(x: float, scale: float, tol: float) -> int:
    if abs(x) <= tol * max(abs(scale), 1e-12):
        return 0
    return 1 if x > 0 else -1


def analyse(out: str | Path, *, window: int = 5, tol: float = 0.01) -> dict[str, Any]:
    """Read ``out/<vanilla|condition>/metrics.jsonl`` and judge each condition against the prediction."""
    out = Path(out)
    paths = {BASELINE: out / BASELINE, **{c.name: out / c.name for c in CONDITIONS}}
    missing = [str(p / "metrics.jsonl") for p in paths.values() if not (p / "metrics.jsonl").is_file()]
    if missing:
        raise UserError(f"{missing[0]}: not found; run erft experiment masking --out {out} first")
    base = entropy_change(read_jsonl(paths[BASELINE] / "metrics.jsonl"), window)
    results = []
    for c in CONDITIONS:
        ch = entropy_change(read_jsonl(paths[c.name] / "metrics.jsonl"), window)
        observed = _sign(ch["change"], ch["first"], tol)
        rel = ch["change"] - base["change"]
        probe_sign = None if ch["probe_dH_mean"] is None else _sign(ch["probe_dH_mean"], 1.0, 0.0)
        results.append({
            "condition": c.label, "run": c.name, "sample_sign": c.sample_sign, "s_sign": c.s_sign,
            "expected": DIRECTION[c.expected], "observed": DIRECTION[observed],
            "agrees": observed == c.expected,
            "vs_vanilla": rel, "agrees_vs_vanilla": _sign(rel, ch["first"], tol) == c.expected,
            "probe_agrees": None if probe_sign is None else probe_sign == c.expected,
            **ch,
        })
    n_ok = sum(r["agrees"] for r in results)
    return {"baseline": base, "conditions": results, "agree": n_ok, "window": window, "tol": tol,
            "verdict": f"entropy moved in the predicted direction in {n_ok} of 4 conditions"}


def markdown(res: dict[str, Any]) -> str:
    b = res["baseline"]
    lines = [
        "# Gradient-masking ablation (Paper A, four conditions)",
        "",
        f"Entropy change = mean `entropy/mean` over the last {res['window']} steps minus the first "
        f"{res['window']}; |change| <= {res['tol']:.0%} of the start counts as flat.",
        "",
        "| condition | predicted | observed | agrees | H first → last | change | vs vanilla | agrees vs vanilla "
        "| mean per-step probe ΔH | kept tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["conditions"]:
        p = "–" if r["probe_dH_mean"] is None else f"{r['probe_dH_mean']:+.2e}"
        k = "–" if r["kept_frac"] is None else f"{100 * r['kept_frac']:.1f}%"
        lines.append(f"| {r['condition']} | {r['expected']} | {r['observed']} | {'yes' if r['agrees'] else 'NO'} | "
                     f"{r['first']:.3f} → {r['last']:.3f} | {r['change']:+.3f} | {r['vs_vanilla']:+.3f} | "
                     f"{'yes' if r['agrees_vs_vanilla'] else 'NO'} | {p} | {k} |")
    lines += ["", f"Vanilla GRPO: {b['first']:.3f} → {b['last']:.3f} ({b['change']:+.3f}) over {b['steps']} steps.",
              "", f"**Verdict:** {res['verdict']}.", ""]
    return "\n".join(lines)


def plot(out: str | Path, res: dict[str, Any]) -> bytes:
    """Left: entropy per step for the vanilla run and the four conditions. Right: change per condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.3), gridspec_kw={"width_ratios": [1.6, 1]})
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    steps, vals = zip(*_vals(read_jsonl(out / BASELINE / "metrics.jsonl"), "entropy/mean"), strict=True)
    ax1.plot(steps, vals, color="k", lw=1.6, label="vanilla GRPO")
    for r, col in zip(res["conditions"], colors):
        s, v = zip(*_vals(read_jsonl(out / r["run"] / "metrics.jsonl"), "entropy/mean"), strict=True)
        ax1.plot(s, v, color=col, lw=1.3, label=f"{r['condition']} (predicted: {r['expected']})")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training-batch entropy")
    ax1.set_title("Entropy under each masking condition")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    labels = [f"{r['condition']}\npredicted {'↑' if r['expected'] == 'rises' else '↓'}" for r in res["conditions"]]
    changes = [r["change"] for r in res["conditions"]]
    bars = ax2.bar(range(4), changes, color=colors, edgecolor="k")
    for b, r in zip(bars, res["conditions"]):
        ax2.annotate("✓" if r["agrees"] else "✗", (b.get_x() + b.get_width() / 2, b.get_height()),
                     ha="center", va="bottom" if b.get_height() >= 0 else "top", fontsize=14,
                     color="green" if r["agrees"] else "red")
    ax2.axhline(res["baseline"]["change"], color="k", ls="--", lw=1, label="vanilla")
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set_xticks(range(4), labels, fontsize=8)
    ax2.set_ylabel("entropy change (last − first window)")
    ax2.set_title(f"Observed change (✓ = predicted sign); {res['agree']}/4 agree")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, axis="y")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def run_experiment(out: str | Path, *, steps: int, config: str | None = None, model: str | None = None,
                   sets: Sequence[str] = (), s_field: str = "s_star", overwrite: bool = False,
                   log=print) -> list[Path]:
    """Train the vanilla baseline and the four conditions (resuming finished or interrupted runs)."""
    from entropy_rft.config.loading import load_config
    from entropy_rft.launch import run as launch

    if steps < 2:
        raise UserError(f"--steps must be >= 2, got {steps}")
    out = Path(out)
    # Evaluation is not needed to see entropy move; the user's --set (later) can turn it back on.
    base_sets = ["eval.every=0"]
    extra: dict = {"train": {"max_steps": steps}}
    if model:
        extra["model"] = {"name": model}
    plans = []
    for cond in (None, *CONDITIONS):
        cfg = load_config(config, [*base_sets, *sets], extra={**extra, **method_extra(cond, s_field)})
        plans.append((BASELINE if cond is None else cond.name, cfg))
    out.mkdir(parents=True, exist_ok=True)
    dirs = []
    for i, (name, cfg) in enumerate(plans, 1):
        log(f"[{i}/{len(plans)}] {name}")
        launch.start_or_resume(cfg, out / name, overwrite=overwrite)
        dirs.append(out / name)
    return dirs
