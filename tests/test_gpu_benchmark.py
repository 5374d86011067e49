"""benchmarks/gpu/kernels.py (issue 23 item 5) stays runnable: its CPU smoke run (kernels under the Triton
interpreter, tiny sizes) writes the JSON and markdown table, and its accuracy rows hold against float64; with
``--json FILE`` (the lease kit's way, one part per process) it writes FILE alone, TRL's own kernel timed beside
ours; the TRL part's A-B-C-C-B-A runs pool as computed by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["-m", "benchmarks.gpu.kernels"]  # run from ROOT, as the lease kit runs it


@pytest.fixture(scope="module")
def kernels():
    """benchmarks/gpu/kernels.py imported as a module (as the lease kit imports render_markdown)."""
    from benchmarks.gpu import kernels as mod

    return mod


def test_gpu_benchmark_smoke_run_writes_json_and_table(tmp_path):
    r = subprocess.run([sys.executable, *SCRIPT, "--device", "cpu", "--quick", "--parts", "stats,head,verl",
                        "--reps", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    (js,) = tmp_path.glob("cpu-*-quick.json")
    res = json.loads(js.read_text())
    assert [s["temperature"] for s in res["stats"]] == [1.0, 0.7, "per_row", 1.0]
    for s in res["stats"]:  # the kernel's statistics within issue 23's bounds of float64
        assert max(s["error_over_bound"].values()) <= 1.0, s["error_over_bound"]
        if isinstance(s["temperature"], float):  # TRL's kernel takes one float temperature
            assert "trl_logp_entropy" in s["t"] or "trl_logp_entropy" in s["errors"], s
        else:
            assert "trl_logp_entropy" not in s["t"]
    assert set(res["head"][0]["t"]) >= {"ours", "baseline", "trl"}  # TRL 1.16's own fused head ran beside ours
    assert res["head"][0]["max_abs_logp_err"] < 1e-4
    assert res["verl"]["ratio"] > 0
    md = js.with_suffix(".md").read_text()
    assert md.startswith("# cpu, ")
    assert "| token_stats bfloat16 64x1000 T=0.7 / logsumexp |" in md
    assert "| head N64 D64 V1000: ours / trl (fwd+bwd) |" in md
    assert "Wall time " in md


def test_gpu_benchmark_json_part_writes_only_that_file(tmp_path, kernels):
    """One part with --json, as the lease kit runs each (the cheapest part: the file's handling is the point)."""
    out, f = tmp_path / "out", tmp_path / "kit" / "kernels-verl.json"
    r = subprocess.run([sys.executable, *SCRIPT, "--device", "cpu", "--quick", "--parts", "verl", "--reps", "1",
                        "--json", str(f), "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.name for p in f.parent.iterdir()] == [f.name]  # no temporary file left beside it
    assert not out.exists()  # with --json: no <stem>.json nor .md
    res = json.loads(f.read_text())
    assert {"device", "torch", "cuda", "triton", "date", "quick", "args", "wall_s"} <= set(res)
    assert "stats" not in res and "head" not in res and "trl" not in res
    assert res["verl"]["ratio"] > 0
    md = kernels.render_markdown(res)  # the kit renders the (merged) parts later
    assert "ours / verl-style" in md


def child(steps: list[float], peak: int | None = None) -> dict:
    """A hand-made child result: ``steps`` starts with the warm-up step."""
    return {"s_step": None, "steps": steps, "peak": peak, "peak_rss": 1}


def test_trl_runs_pool_in_abccba_order(kernels):
    assert kernels.TRL_ORDER == ("stock", "none", "clip_v", "clip_v", "none", "stock")
    runs = [("stock", child([9.0, 1.0, 1.0, 1.0, 1.0], 100)), ("none", child([9.0, 1.1, 1.1, 1.1, 1.1], 105)),
            ("clip_v", child([9.0, 1.3, 1.3, 1.3, 1.3], 110)), ("clip_v", child([9.0, 1.5, 1.5, 1.5, 1.5], 120)),
            ("none", child([9.0, 1.3, 1.3, 1.3, 1.3], 104)), ("stock", child([9.0, 1.2, 1.2, 1.2, 1.2], 101))]
    pooled = kernels.pool_trl_runs(runs)
    assert list(pooled) == ["stock", "none", "clip_v"]
    stock, none, clip_v = pooled["stock"], pooled["none"], pooled["clip_v"]
    assert stock["n"] == none["n"] == clip_v["n"] == 8  # 4 timed steps of each of two runs; warm-ups dropped
    assert stock["steps"] == [1.0] * 4 + [1.2] * 4
    assert stock["s_step"] == pytest.approx(1.1)  # the median of 8: the mean of the middle two
    assert (stock["min"], stock["max"]) == (1.0, 1.2)
    assert none["s_step"] == pytest.approx(1.2) and clip_v["s_step"] == pytest.approx(1.4)
    assert (stock["peak"], none["peak"], clip_v["peak"]) == (101, 105, 120)  # the larger of the two runs
    assert stock["runs"] == [runs[0][1], runs[5][1]] and "error" not in stock
    rows = {m: v for m, v, _t, _r in kernels.trl_rows("q", pooled)}
    assert rows["TRL q: none / stock s/step"].startswith("1.09x")
    assert rows["TRL q: clip_v / stock s/step"].startswith("1.27x")
    assert rows["TRL q: stock against itself (runs 1 and 6)"].startswith("18.2%")  # (1.2 - 1.0) / 1.1


def test_trl_pooling_keeps_a_failed_run_and_a_killed_part(kernels):
    runs = [("stock", child([9.0, 1.0, 3.0])), ("none", {"error": "CUDA out of memory"}),
            ("clip_v", child([9.0, 2.0]))]
    pooled = kernels.pool_trl_runs(runs)
    assert pooled["none"]["error"] == "CUDA out of memory" and pooled["none"]["n"] == 0
    assert pooled["stock"]["s_step"] == 2.0 and pooled["stock"]["peak"] is None
    rows = {m: (v, r) for m, v, _t, r in kernels.trl_rows("q", pooled)}
    assert rows["TRL q: none / stock"] == ("FAILED", "MISS")
    assert rows["TRL q: clip_v / stock s/step"][0].startswith("1.00x")
    rows = {m: v for m, v, _t, _r in kernels.trl_rows("q", kernels.pool_trl_runs(runs[:1]))}
    assert rows["TRL q: none / stock"] == rows["TRL q: clip_v / stock"] == "not run"  # killed after one run


def test_gpu_benchmark_refuses_an_unknown_part(tmp_path):
    r = subprocess.run([sys.executable, *SCRIPT, "--device", "cpu", "--parts", "stats,nope",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "--parts: unknown part(s) nope; choose from stats, head, verl, trl"
    assert not list(tmp_path.iterdir())
