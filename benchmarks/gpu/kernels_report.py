"""benchmarks/gpu/kernels.py's results as a table: the rows with their targets and verdicts, the markdown the lease
kit commits (``render_markdown``, read by ``benchmarks/lease/collect.py``), and the files a run writes. No torch:
the kit renders merged parts on any machine."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from benchmarks.gpu.kernels_trl import TRL_ORDER
from benchmarks.gpu.timing_math import median


def ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.0f} MiB"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "MISS"


def table_rows(res: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in res.get("stats", []):
        label = f"token_stats {r['dtype']} {r['shape'][0]}x{r['shape'][1]} T={r['temperature']}"
        rows.append((f"{label} / logsumexp", f"{r['ratio']:.2f}x ({ms(r['t']['token_stats'])} / "
                     f"{ms(r['t']['logsumexp'])})", "<= 1.0x", verdict(r["ratio"] <= 1.0)))
        rows.append(("  bandwidth / device copy", f"{r['copy_bw_fraction']:.0%}", ">= 60% (moonshot)",
                     verdict(r["copy_bw_fraction"] >= 0.6)))
        if "trl_logp_entropy" in r["t"]:
            ratio = r["t"]["token_stats"] / r["t"]["trl_logp_entropy"]
            rows.append(("  token_stats / TRL selective_log_softmax_and_entropy", f"{ratio:.2f}x "
                         f"({ms(r['t']['token_stats'])} / {ms(r['t']['trl_logp_entropy'])})", "<= 1.1x",
                         verdict(ratio <= 1.1)))
        elif "trl_logp_entropy" in r.get("errors", {}):
            rows.append(("  token_stats / TRL selective_log_softmax_and_entropy", r["errors"]["trl_logp_entropy"],
                         "<= 1.1x", "n/a"))
        if "token_stats_torch" in r["t"]:
            rows.append(("  torch path / logsumexp", f"{r['t']['token_stats_torch'] / r['t']['logsumexp']:.1f}x",
                         "", "info"))
        if r["extra_peak"] is not None:
            rows.append(("  extra peak / logits", f"{r['extra_peak'] / r['bytes']:.3%} ({mib(r['extra_peak'])})",
                         "<= 1%", verdict(r["extra_peak"] <= 0.01 * r["bytes"])))
            rows.append(("  host syncs | kernel launches per call (logsumexp's launches)",
                         f"{r['syncs']} | {r['launches']} ({r['launches_logsumexp']})", "<= 1 sync",
                         verdict(r["syncs"] <= 1)))
        worst = max(r["error_over_bound"].values())
        rows.append(("  worst error / bound vs float64 (H, S*, E_p[S])", f"{worst:.3f}", "<= 1", verdict(worst <= 1)))
    sweep = res.get("stats_sweep")
    if sweep:
        n, v = sweep["shape"]
        for cfg, sec in sweep["t"].items():
            if cfg == "trl":
                continue
            vs = f" = {sec / sweep['t']['trl']:.2f}x TRL's kernel" if "trl" in sweep["t"] else ""
            rows.append((f"  token_stats bf16 {n}x{v} T=0.7, block x warps {cfg}", f"{ms(sec)}{vs}, "
                         f"{sweep['bytes'] / sec / 1e12:.2f} TB/s", "", "info"))
    for r in res.get("head", []):
        n, d, v = r["shape"]
        t, p = r["t"], r["peak"]
        for other, target in (("trl", 1.1), ("liger", 1.1), ("liger_entropy", 1.1), ("baseline", None)):
            if other not in t:
                rows.append((f"head N{n} D{d} V{v}: ours / {other}", r["errors"].get(other, "not installed"), "",
                             "n/a"))
                continue
            ratio = t["ours"] / t[other]
            rows.append((f"head N{n} D{d} V{v}: ours / {other} (fwd+bwd)",
                         f"{ratio:.2f}x ({ms(t['ours'])} / {ms(t[other])})",
                         f"<= {target}x" if target else "", verdict(ratio <= target) if target else "info"))
            if p.get("ours") is not None and p.get(other):
                pr = p["ours"] / p[other]
                rows.append((f"  peak ours / {other}", f"{pr:.2f}x ({mib(p['ours'])} / {mib(p[other])})",
                             "<= 1.05x" if target else "", verdict(pr <= 1.05) if target else "info"))
        rows.append(("  max |log p - materialised|", f"{r['max_abs_logp_err']:.1e}", "", "info"))
    if "verl" in res:
        r = res["verl"]
        rows.append((f"verl micro-batch {r['shape'][0]}x{r['shape'][1]} bf16, T 0.7 per token: ours / verl-style",
                     f"{r['ratio']:.2f}x ({ms(r['t']['ours'])} / {ms(r['t']['verl_entropy'])})", "<= 1.1x",
                     verdict(r["ratio"] <= 1.1)))
    for model, runs in res.get("trl", {}).items():
        rows += trl_rows(model, runs)
    return rows


def trl_rows(model: str, runs: dict) -> list[tuple[str, str, str, str]]:
    """The TRL part's rows for one model: each trainer's pooled s/step, then none and clip_v against stock."""
    rows = []
    for trainer in ("stock", "none", "clip_v"):
        r = runs.get(trainer)
        if r and r.get("s_step") is not None:
            k = sum("error" not in x for x in r["runs"])
            rows.append((f"TRL {model}: {trainer} s/step (median of {r['n']} steps, {k} runs pooled)",
                         f"{r['s_step']:.3f} s ({r['min']:.3f} to {r['max']:.3f}), peak {mib(r['peak'])}", "",
                         "info"))
    stock = runs.get("stock")
    own = [median(x["steps"][1:] or x["steps"]) for x in (stock or {}).get("runs", []) if "error" not in x]
    if len(own) >= 2:  # the first and last run of the A-B-C-C-B-A order: the noise floor of the ratios below
        spread = (max(own) - min(own)) / (sum(own) / len(own))
        rows.append((f"TRL {model}: stock against itself (runs 1 and {len(TRL_ORDER)})", f"{spread:.1%} "
                     f"({' / '.join(f'{x:.3f}' for x in own)} s)", "< 5%", verdict(spread < 0.05)))
    for method, target in (("none", 1.05), ("clip_v", 1.15)):
        r = runs.get(method)
        if r is None or stock is None:  # a part killed before these runs
            rows.append((f"TRL {model}: {method} / stock", "not run", f"<= {target}x", "n/a"))
            continue
        if "error" in r or "error" in stock:
            rows.append((f"TRL {model}: {method} / stock", "FAILED", f"<= {target}x", "MISS"))
            continue
        ratio = r["s_step"] / stock["s_step"]
        rows.append((f"TRL {model}: {method} / stock s/step", f"{ratio:.2f}x ({r['s_step']:.3f} / "
                     f"{stock['s_step']:.3f} s)", f"<= {target}x", verdict(ratio <= target)))
        if r.get("peak") and stock.get("peak"):
            pr = r["peak"] / stock["peak"]
            rows.append((f"  peak {method} / stock", f"{pr:.2f}x ({mib(r['peak'])})", "<= 1.05x",
                         verdict(pr <= 1.05)))
    return rows


def md_cell(x: object) -> str:
    """A table cell: one line, its pipes escaped."""
    return str(x).replace("\r", " ").replace("\n", " ").replace("|", "\\|")


def render_markdown(res: dict) -> str:
    """The results' markdown: a title line, the table of ``table_rows`` and the wall time (where recorded).
    Works on one run's dict, a partial one (a killed part) or several parts' entries merged into one dict."""
    title = f"# {res.get('device', '?')}, {res.get('date', '?')} (torch {res.get('torch', '?')}, " \
            f"triton {res.get('triton', '?')})"
    md = [title, "", "| measure | measured | target | result |", "|---|---|---|---|"]
    md += ["| " + " | ".join(md_cell(c) for c in row) + " |" for row in table_rows(res)]
    if res.get("wall_s") is not None:
        md += ["", f"Wall time {res['wall_s']:.0f} s."]
    return "\n".join(md) + "\n"


def write_json_atomic(path: Path, res: dict) -> None:
    """Write ``res`` to ``path`` through a temporary file in the same folder and ``os.replace``: a reader (or a
    process killed mid-write) never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from the kit's other readers
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def result_stem(res: dict) -> str:
    """``<device>-<date>[-quick]``: the name of a results' JSON and markdown (the device lower-cased, every other
    character than a letter or digit a ``-``; the date today's when the results have none)."""
    import time

    device = "".join(c if c.isalnum() else "-" for c in str(res.get("device", "device")).lower()).strip("-")
    return f"{device}-{res.get('date') or time.strftime('%Y-%m-%d')}" + ("-quick" if res.get("quick") else "")


def write_report(res: dict, out: Path) -> Path:
    """Without --json: ``<device>-<date>[-quick].json`` and ``.md`` in ``out``; returns the path without suffix."""
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(res)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{stem}.md").write_text(render_markdown(res))
    return out / stem

