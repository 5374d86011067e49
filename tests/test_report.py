"""``erft report``: figures, the computed summary, run-dir expansion, and rendering in headless Chromium."""

from __future__ import annotations

import base64
import io
import itertools
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from entropy_rft.analysis import runs as runs_mod
from entropy_rft.analysis.findings import law_fits
from entropy_rft.analysis.runs import RunData, assign_labels, expand_run_dirs, load_run
from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError
from entropy_rft.report import plots
from entropy_rft.report.page import build_report
from micro import make_micro_policy, micro_overrides

CHROMIUM = "/usr/bin/chromium"
IMG_RE = re.compile(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


# ----------------------------------------------------------------------------- pure helpers


def test_pass_curve_matches_enumeration_over_subsets():
    # hist[c] = problems with c of K=4 correct; the naive Pass@k enumerates all k-subsets of 4 samples.
    hist = [3, 1, 0, 2, 1]
    K = 4
    naive = []
    for k in range(1, K + 1):
        tot = 0.0
        for c, h in enumerate(hist):
            outcomes = [1] * c + [0] * (K - c)
            subsets = list(itertools.combinations(range(K), k))
            tot += h * sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        naive.append(tot / sum(hist))
    assert runs_mod.pass_curve(hist) == pytest.approx(naive, abs=1e-12)
    assert runs_mod.pass_curve([0, 1, 0]) == pytest.approx([0.5, 1.0])  # by hand: one of two right
    assert runs_mod.pass_curve([]) == []


# ----------------------------------------------------------------------------- synthetic runs


def _write_synthetic(d: Path, method: str, ent_end: float, *, seed=0, drop=0.0, pass_k_final=0.5, engine=None,
                     model=None, label=None, records=True, target=None):
    """20 steps, entropy 1.0 -> ent_end; evals at 0, 10, 20 following R = 0.8 - 0.2*exp(H). With ``target``, an
    autopilot run (its setpoint in the config, the controller's rows) that also logs the batch predictions of the
    entropy change and the measured change."""
    d.mkdir(parents=True)
    cfg = {"method": {"name": method, "params": {}}, "train": {"seed": seed}}
    if target:
        cfg["method"]["entropy_target"] = target
    if engine:
        cfg["engine"] = engine
    if model:
        cfg["model"] = {"name": model}
    if label:
        cfg["method"]["label"] = label
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for s in range(0, 21):
        h = 1.0 + (ent_end - 1.0) * s / 20
        row = {"step": s}
        if s >= 1:
            row.update({"entropy/mean": h, "reward/mean": 0.1 + 0.01 * s, "probe/sign_agreement": 0.55,
                        "probe/sign_agreement_weighted": 0.7, "probe/batch_sign_agree": 0.75,
                        "control/kept_frac": 1 - drop, "lens/drop_frac": drop,
                        "lens/dH_dropped": -1e-3 if drop else 0.0,
                        "lens_ppo/drop_frac": 0.01, "lens_ppo/drop_frac/pos_sneg": 0.01,
                        "lens_ppo/dH_dropped/pos_sneg": 2e-4, "lens_ppo/dH_dropped": 2e-4})
            if target:
                row.update({"control/entropy_target": 0.6, "control/entropy_smoothed": h, "control/knob": 2.0,
                            "dynamics/cov_logp_adv": 0.01 * (1 + s % 3), "dynamics/cov_adv_s_centered": 0.02,
                            "dynamics/pred_dH": -0.001 * s, "probe/dH_actual": -0.002 * (s % 4)})
            for q in ("pos_spos", "pos_sneg", "neg_spos", "neg_sneg", "zero"):
                row[f"lens/drop_frac/{q}"] = drop if q == "neg_sneg" else 0.0
                row[f"lens/dH_dropped/{q}"] = (-1e-3 if drop else 0.0) if q == "neg_sneg" else 0.0
        if s % 10 == 0:
            acc = 0.8 - 0.2 * math.exp(h)
            row.update({"eval/pass@1": acc, "eval/avg@4": acc, "eval/entropy": h,
                        "eval/pass@4": 0.55 if s == 0 else pass_k_final,
                        "eval/pass_rate_hist": [4, 2, 1, 1, 0] if s == 0 else [3, 3, 1, 0, 1]})
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if records:
        recs = [{"step": 10, "pred_dH": x, "actual_dH": 2 * x, "s_centered": x, "adv": 1.0, "kept": True}
                for x in np.linspace(-1, 1, 11).tolist()]
        (d / "token_records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def _decoded_images(html_text: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(b))) for b in IMG_RE.findall(html_text)]


def test_synthetic_report_summary_is_computed_from_the_numbers(tmp_path):
    cmp = tmp_path / "cmp"
    _write_synthetic(cmp / "none-s0", "none", 0.2, pass_k_final=0.45)
    _write_synthetic(cmp / "clip_v-s0", "clip_v", 0.8, drop=0.02, pass_k_final=0.65)
    (cmp / "summary.md").write_text("not a run dir\n")
    nums = build_report([cmp], tmp_path / "rep")
    text = nums["summary"]
    # Entropy: step 1 is 1 + (end - 1)/20; step 20 is the end value.
    assert "fell from 0.960 to 0.200 nats (-79%) under none" in text
    assert "fell from 0.990 to 0.800 nats (-19%) under clip_v" in text
    assert "clip_v kept the most entropy (0.800 at the last step against 0.200 for none)" in text
    assert "Pass@4 fell below the base model's under none" in text  # 0.45 < 0.55, clip_v's 0.65 is not
    assert "Best pass@4: clip_v (0.650)" in text
    assert "55% of tokens" in text and "weak per-token signal" in text and "75% of steps" in text
    assert "clip_v removed 2.00% of tokens per step, most in A<0, S_c≤0" in text
    assert "lowered entropy" in text
    assert "a=0.200, b=0.800, ceiling 0.600, R²=1.00" in text
    assert nums["figures"] == ["entropy", "accuracy", "probe", "sc", "lens", "passk", "passrate", "law"]
    page = (tmp_path / "rep" / "report.html").read_text()
    imgs = _decoded_images(page)
    assert len(imgs) == 8 and all(im.format == "PNG" and im.size[0] > 300 for im in imgs)
    # each figure also as its own file, the very image the page embeds
    import base64
    import re

    embedded = [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]
    files = [(tmp_path / "rep" / f"{key}.png").read_bytes() for key in nums["figures"]]
    assert files == embedded
    assert "http://" not in page and "https://" not in page and "<script" not in page  # offline, static
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["summary"] == text


def test_expand_run_dirs_and_errors(tmp_path, capsys):
    a = _write_synthetic(tmp_path / "cmp" / "none-s0", "none", 0.5)
    b = _write_synthetic(tmp_path / "cmp" / "clip_v-s1", "clip_v", 0.5)
    assert expand_run_dirs([tmp_path / "cmp"]) == [b, a]
    assert expand_run_dirs([a, tmp_path / "cmp"]) == [a, b]  # duplicates dropped, order kept
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="not a run directory"):
        expand_run_dirs([tmp_path / "empty"])
    assert main(["report", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("")
    assert main(["report", str(tmp_path / "blank"), "--out", str(tmp_path / "r")]) == 2
    assert "empty" in capsys.readouterr().err


# ----------------------------------------------------------------------------- series: runs keyed by label


def _fake_run(name, variant="clip_v", *, method=None, engine="native", model="default", seed=0) -> RunData:
    return RunData(path=Path("/runs") / name, name=name, method=method or variant.split(":")[0].split("@")[0],
                   label=variant, seed=seed, cfg={}, rows=[], records=[], variant=variant, engine=engine,
                   model=model)


def test_labels_name_only_what_differs():
    # Same engine and model everywhere: the labels are the variants, as a plain GRPO-vs-ClipV report says.
    runs = [_fake_run("a", "none"), _fake_run("b", "clip_v"), _fake_run("c", "clip_v:mu=3")]
    assign_labels(runs)
    assert [r.label for r in runs] == ["none", "clip_v", "clip_v:mu=3"]
    # Engines differ: the engine joins every label; the model still does not.
    runs = [_fake_run("a", engine="native"), _fake_run("b", engine="trl")]
    assign_labels(runs)
    assert [r.label for r in runs] == ["clip_v · native", "clip_v · trl"]
    # Models differ: local folders by their last component, hub ids as they are.
    runs = [_fake_run("a", model="/m/smollm2"), _fake_run("b", model="Qwen/Qwen2.5-0.5B", engine="trl")]
    assign_labels(runs)
    assert [r.label for r in runs] == ["clip_v · native · smollm2", "clip_v · trl · Qwen/Qwen2.5-0.5B"]
    # Two folders of one name: the full paths, so the two stay apart.
    runs = [_fake_run("a", model="/x/m"), _fake_run("b", model="/y/m")]
    assign_labels(runs)
    assert [r.label for r in runs] == ["clip_v · /x/m", "clip_v · /y/m"]
    # Seeds (distinct train.seed) share a label; the same seed twice is not two seeds.
    runs = [_fake_run("s0", seed=0), _fake_run("s1", seed=1), _fake_run("n-a", "none"), _fake_run("n-b", "none")]
    assign_labels(runs)
    assert [r.label for r in runs] == ["clip_v", "clip_v", "none [n-a]", "none [n-b]"]
    assert runs_mod.methods_in_order(runs) == ["none [n-a]", "none [n-b]", "clip_v"]  # the baseline first


def test_native_and_trl_runs_of_one_method_are_two_labelled_series(tmp_path):
    # The acceptance test of issue 16: one native and one TRL ClipV run, same seed, are two series.
    cmp = tmp_path / "cmp"
    _write_synthetic(cmp / "clip_v-native", "clip_v", 0.8, engine="native", pass_k_final=0.45)
    _write_synthetic(cmp / "clip_v-trl", "clip_v", 0.6, engine="trl", pass_k_final=0.65)
    nums = build_report([cmp], tmp_path / "rep")
    assert [x["label"] for x in nums["series"]] == ["clip_v · native", "clip_v · trl"]
    assert [x["engine"] for x in nums["series"]] == ["native", "trl"] and all(x["n"] == 1 for x in nums["series"])
    # Not averaged: each series keeps its own run's numbers (final eval entropy 0.8 and 0.6, pass@4 0.45, 0.65).
    m = nums["methods"]
    assert list(m) == ["clip_v · native", "clip_v · trl"]
    assert m["clip_v · native"]["final/entropy"] == {"mean": pytest.approx(0.8), "std": 0.0}
    assert m["clip_v · trl"]["final/entropy"] == {"mean": pytest.approx(0.6), "std": 0.0}
    assert m["clip_v · trl"]["final/pass@4"]["mean"] == pytest.approx(0.65)
    assert "2 runs of 2 series (clip_v · native ×1 and clip_v · trl ×1)" in nums["summary"]
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<td>clip_v · native</td>" in page and "<td>clip_v · trl</td>" in page
    # The engine is also read from run.json when config.yaml has none (older TRL runs).
    (cmp / "clip_v-trl" / "config.yaml").write_text(yaml.safe_dump({"method": {"name": "clip_v"},
                                                                    "train": {"seed": 0}}))
    (cmp / "clip_v-trl" / "run.json").write_text(json.dumps({"status": "finished", "engine": "trl"}))
    assert load_run(cmp / "clip_v-trl").engine == "trl"


def test_seeds_of_one_label_are_averaged_into_one_series(tmp_path):
    cmp = tmp_path / "cmp"
    _write_synthetic(cmp / "none-s0", "none", 0.2)
    a = _write_synthetic(cmp / "clip_v-s0", "clip_v", 0.8, seed=0, pass_k_final=0.4)
    b = _write_synthetic(cmp / "clip_v-s1", "clip_v", 0.6, seed=1, pass_k_final=0.7)
    nums = build_report([cmp], tmp_path / "rep")
    assert [(x["label"], x["n"], sorted(x["seeds"])) for x in nums["series"]] == [("none", 1, [0]),
                                                                                  ("clip_v", 2, [0, 1])]
    c = nums["methods"]["clip_v"]
    assert c["n"] == 2
    # By hand: final eval entropy 0.8 and 0.6 -> mean 0.7, population std 0.1; pass@4 0.4, 0.7 -> 0.55, 0.15.
    assert c["final/entropy"]["mean"] == pytest.approx(0.7) and c["final/entropy"]["std"] == pytest.approx(0.1)
    assert c["final/pass@4"]["mean"] == pytest.approx(0.55) and c["final/pass@4"]["std"] == pytest.approx(0.15)
    assert "clip_v ×2" in nums["summary"]
    # The plotted curve is the mean over seeds: step 10 is halfway, 1 + (0.8-1)/2 = 0.9 and 0.8 -> 0.85.
    runs = [load_run(a), load_run(b)]
    xs, ys = runs_mod.mean_series(runs, "entropy/mean")
    assert xs == list(range(1, 21))
    assert ys[9] == pytest.approx(0.85) and ys[-1] == pytest.approx(0.7)
    ex, ey = runs_mod.mean_series(runs, "eval/entropy", "eval_rows")
    assert ex == [0, 10, 20] and ey == pytest.approx([1.0, 0.85, 0.7])
    # A seed that stopped early ends the mean instead of making it jump.
    runs[1].train_rows = runs[1].train_rows[:5]
    assert runs_mod.mean_series(runs, "entropy/mean")[0] == [1, 2, 3, 4, 5]
    page = (tmp_path / "rep" / "report.html").read_text()
    assert '0.700 <span class="sd">± 0.100</span>' in page


def test_figures_without_data_are_left_out_and_named(tmp_path):
    # No token records: the probe scatter and the S_c histogram have nothing to plot.
    _write_synthetic(tmp_path / "run", "clip_v", 0.8, records=False)
    nums = build_report([tmp_path / "run"], tmp_path / "rep")
    left = {o["figure"]: o["reason"] for o in nums["omitted"]}
    assert {"probe", "sc", "autopilot", "probe_levels", "counterfactual"} == set(left)
    assert not set(left) & set(nums["figures"])
    assert "no token records" in left["sc"]
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<h2>Figures left out</h2>" in page
    assert "Not shown: Distribution of S_c: no token records" in page
    assert "<h2>Distribution of S_c</h2>" not in page  # no heading, no empty panel
    assert len(IMG_RE.findall(page)) == len(nums["figures"]) == 6


def test_law_with_few_points_warns_in_panel_json_and_page(tmp_path):
    run = _write_synthetic(tmp_path / "run", "clip_v", 0.8)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # a fourth evaluation at step 5 (R = 0.8 - 0.2 exp(H), H = 0.95)
        if row["step"] == 5:
            row.update({"eval/pass@1": 0.8 - 0.2 * math.exp(0.95), "eval/entropy": 0.95})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    nums = build_report([run], tmp_path / "rep")
    (fit,) = nums["law"]
    assert fit["fit"]["n"] == 4 and fit["fit"]["a"] == pytest.approx(0.2) and fit["fit"]["b"] == pytest.approx(0.8)
    assert fit["warning"].startswith("fit on 4 points: not reliable")
    page = (tmp_path / "rep" / "report.html").read_text()
    assert '<p class="warn">run: fit on 4 points: not reliable' in page
    assert "fit on 4 points: not reliable" in nums["summary"]
    # Enough evaluations: no warning.
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "entropy/mean": 1 - s / 40, "eval/pass@1": 0.8 - 0.2 * math.exp(1 - s / 40),
                    "eval/entropy": 1 - s / 40}) + "\n" for s in range(0, 9)))
    (f8,) = law_fits([load_run(dense)])
    assert f8["fit"]["n"] == 9 and f8["warning"] is None


def test_legends_sit_outside_every_plotting_area(tmp_path, monkeypatch):
    cmp = tmp_path / "cmp"
    _write_synthetic(cmp / "none-s0", "none", 0.2)
    _write_synthetic(cmp / "clip_v-s0", "clip_v", 0.8, drop=0.02, seed=0)
    _write_synthetic(cmp / "clip_v-s1", "clip_v", 0.7, drop=0.02, seed=1)
    real = plots.figure_png
    checked: list[int] = []

    def spy(fig):
        fig.canvas.draw()
        rend = fig.canvas.get_renderer()
        legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        for leg in legends:
            box = leg.get_window_extent(rend)
            for ax in fig.axes:  # neither the curves' area nor the axis' ticks and label
                assert not box.overlaps(ax.get_window_extent(rend)), fig.axes[0].get_title()
                assert not box.overlaps(ax.xaxis.get_tightbbox(rend)), fig.axes[0].get_title()
        checked.append(len(legends))
        return real(fig)

    monkeypatch.setattr(plots, "figure_png", spy)
    nums = build_report([cmp], tmp_path / "rep")
    assert len(checked) == len(nums["figures"]) == 8 and all(n >= 1 for n in checked)


CHECK_WIDTH = ('<script>window.addEventListener("load",()=>{const w=[...document.querySelectorAll(".tablewrap")];'
               'document.body.setAttribute("data-width",w.length+":"+w.filter(e=>e.scrollWidth>e.clientWidth+1)'
               '.length+":"+document.documentElement.scrollWidth+":"+window.innerWidth)});</script></body>')


def test_summary_table_fits_a_1000px_window(tmp_path):
    cmp = tmp_path / "cmp"
    long = "clip_v:mu=3:eps_high=0.28:window=12345@target=linear:0.6:0.3"
    _write_synthetic(cmp / "a", "clip_v", 0.8, label=long, model="/models/a-rather-long-model-folder-name-v2")
    _write_synthetic(cmp / "b", "none", 0.3, model="HuggingFaceTB/SmolLM2-135M-Instruct", engine="trl")
    _write_synthetic(cmp / "c", "high_entropy", 0.6, target="0.65x", model="/models/a-rather-long-model-folder-name-v2")
    build_report([cmp], tmp_path / "rep")
    page = tmp_path / "rep" / "report.html"
    probe = page.with_name("width.html")
    probe.write_text(page.read_text().replace("</body>", CHECK_WIDTH))
    res = _chromium("--window-size=1000,2000", "--virtual-time-budget=5000", "--dump-dom",
                    probe.resolve().as_uri(), tmp=tmp_path)
    m = re.search(r'data-width="(\d+):(\d+):(\d+):(\d+)"', res.stdout)
    assert m, f"chromium did not report the widths: rc={res.returncode} {res.stderr[-500:]}"
    tables, overflowing, page_w, window_w = map(int, m.groups())
    # summary, entropy at fixed steps; equal entropy; the law and agreement per setpoint; the law and its forecasts;
    # the methods through the lens (issue 28); the doctor's findings and where each run is heading (issue 75)
    assert tables == 10
    assert overflowing == 0 and page_w <= window_w


# ----------------------------------------------------------------------------- real micro runs


def _sets(model, **extra):
    return [a for s in micro_overrides(model, **extra) for a in ("--set", s)]


@pytest.fixture(scope="module")
def micro_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rep")
    model = make_micro_policy(root / "model")
    assert main(["compare", "--methods", "none,clip_v", "--max-steps", "4", "--out", str(root / "cmp"),
                 *_sets(model, **{"method.presets.clip_v.mu": 0.5})]) == 0
    assert main(["compare", "--methods", "none", "--max-steps", "2", "--out", str(root / "noeval"),
                 *_sets(model, **{"eval.every": 0})]) == 0
    return root


def test_two_step_run_without_evaluation_still_has_its_figures(micro_runs, tmp_path):
    nums = build_report([micro_runs / "noeval" / "none-s0"], tmp_path)
    assert {"entropy", "accuracy", "sc", "lens"} <= set(nums["figures"])
    assert not {"passk", "passrate", "law"} & set(nums["figures"])
    page = (tmp_path / "report.html").read_text()
    if "probe" not in nums["figures"]:  # the micro run's first steps may all have A = 0; the page says so
        assert "no recorded token had both a non-zero predicted" in page
    assert len(IMG_RE.findall(page)) == len(nums["figures"])
    assert "Not shown: Pass@k curves: no evaluation" in page
    assert {o["figure"] for o in nums["omitted"]} >= {"passk", "passrate", "law"}
    assert "No evaluation was logged" in nums["summary"]


def _chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    assert Path(CHROMIUM).is_file() or shutil.which("chromium"), (
        "headless Chromium is required: apt-get install -y chromium (the Makefile's setup installs it)")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp / 'chrome-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


CHECK = ('<script>window.addEventListener("load",()=>{const im=[...document.images];'
         'document.body.setAttribute("data-check",im.length+":"+'
         'im.filter(i=>i.complete&&i.naturalWidth>0).length)});</script></body>')


def _loaded_images(html_file: Path, tmp: Path) -> tuple[int, int]:
    probe = html_file.with_name("check_" + html_file.name)
    probe.write_text(html_file.read_text().replace("</body>", CHECK))
    res = _chromium("--virtual-time-budget=5000", "--dump-dom", probe.resolve().as_uri(), tmp=tmp)
    m = re.search(r'<body[^>]*data-check="(\d+):(\d+)"', res.stdout)
    assert m, f"chromium did not report the image check: rc={res.returncode} {res.stderr[-500:]}"
    return int(m.group(1)), int(m.group(2))


def test_report_renders_in_headless_chromium_with_all_images(micro_runs, tmp_path):
    out = tmp_path / "rep"
    assert main(["report", str(micro_runs / "cmp"), "--out", str(out)]) == 0
    nums = json.loads((out / "report.json").read_text())
    assert nums["figures"] == ["entropy", "accuracy", "probe", "sc", "lens", "passk", "passrate", "law"]
    total, loaded = _loaded_images(out / "report.html", tmp_path)
    assert total == 8 and loaded == 8
    # The check can fail: a corrupt image is counted as not loaded.
    broken = out / "broken.html"
    broken.write_text((out / "report.html").read_text().replace(
        "</body>", '<img alt="x" src="data:image/png;base64,AAAA"></body>'))
    assert _loaded_images(broken, tmp_path) == (9, 8)
    # A screenshot of the page: it is drawn, and not blank.
    shot = tmp_path / "shot.png"
    res = _chromium(f"--screenshot={shot}", "--window-size=1200,4000", (out / "report.html").resolve().as_uri(),
                    tmp=tmp_path)
    assert shot.is_file(), res.stderr[-500:]
    im = Image.open(shot).convert("L")
    assert im.size == (1200, 4000)
    dark = np.asarray(im) < 200
    assert dark.mean() > 0.01  # text, axes and curves, not an empty white page
