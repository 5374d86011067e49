"""Issue 76: the token view. Records (token_view.jsonl) from the native engine and from the TRL engine, checked
against the run's own token_records.jsonl and by hand; the report's section in headless Chromium (tokens and marks
drawn, a response holding markup and a script shown as text, nothing of it run), its size bound, the comparison of
one prompt under two methods, and the dropped shares by token class and position."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from entropy_rft.analysis.report_data import read_views, token_views
from entropy_rft.cli.main import main
from entropy_rft.report import token_view_page as tvp
from entropy_rft.report.page import build_report
from entropy_rft.training.token_view import MARKS, clipped_after, token_marks
from micro import make_micro_policy, micro_overrides
from test_report import _chromium


def test_marks_by_hand():
    mask = torch.tensor([[True, True, True, True, False]])
    keep = torch.tensor([[True, False, True, True, True]])
    zeroed = torch.tensor([[False, True, True, False, False]])
    clipped = torch.tensor([[True, False, False, True, True]])
    got = token_marks(mask, keep, zeroed, None, clipped).tolist()[0]
    # 0: clipped only; 1: dropped beats zeroed; 2: zeroed; 3: clipped; 4: padding
    assert [MARKS[i] if i >= 0 else None for i in got] == ["clipped", "dropped", "zeroed", "clipped", None]
    ratio = torch.tensor([1.3, 1.3, 0.7, 0.7, 1.1], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    # A > 0 and r > 1.2: 0 only; A < 0 and r < 0.8: 2 only; eps_high None: never on that side
    assert clipped_after(ratio, adv, 0.2, 0.2).tolist() == [True, False, True, False, False]
    assert clipped_after(ratio, adv, 0.2, None).tolist() == [False, False, True, False, False]


def test_token_classes_and_dropped_shares_by_hand():
    assert [tvp.token_class(t) for t in ("12", " the", ".", "  ", "<|im_end|>", "x1")] == [
        "digit", "word", "punctuation", "space", "special", "digit"]
    first = {"tokens": ["4", " +", " 9", "<eos>"], "mark": ["kept", "dropped", "zeroed", "kept"]}
    row = {"step": 1, "responses": [first, {"tokens": ["7"] * 9, "mark": ["kept"] * 8 + ["dropped"]}]}
    sh = tvp.dropped_shares([row])
    # digits: "4", " 9", nine "7": 11 tokens, dropped/zeroed " 9" and the ninth "7": 2
    assert sh["class"]["digit"] == [2, 11] and sh["class"]["punctuation"] == [1, 1] and sh["class"]["special"] == [0, 1]
    # positions 0-7: 4 + 8 tokens, out " +", " 9"; 8-15: the ninth "7", out
    assert sh["position"]["0-7"] == [2, 12] and sh["position"]["8-15"] == [1, 1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tv")
    model = make_micro_policy(root / "policy")
    sets = [a for s in micro_overrides(model, **{"train.max_steps": 2, "probe.view_every": 2,
                                                 "probe.records_every": 2, "probe.records_per_step": 4096,
                                                 "method.presets.clip_v.mu": 0.5}) for a in ("--set", s)]
    assert main(["compare", "--methods", "none,clip_v", "--out", str(root / "cmp"), *sets]) == 0
    return root


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_native_view_agrees_with_the_runs_own_token_records(runs):
    for name in ("none-s0", "clip_v-s0"):
        run = runs / "cmp" / name
        view = _rows(run / "token_view.jsonl")
        assert [(r["step"], r["group"]) for r in view] == [(2, 0), (2, 1)]  # probe.view_groups 2, at step 2
        g = 4  # micro_overrides' group size
        flat = [resp for r in view for resp in r["responses"]]
        assert all(len(r["responses"]) == g for r in view)
        recs = [x for x in _rows(run / "token_records.jsonl") if x["step"] == 2 and x["seq"] < 2 * g]
        assert len(recs) > 20
        for x in recs:  # every token of the first 2 groups is in the records (4096 of a 16 x 6 batch)
            resp = flat[x["seq"]]
            assert resp["h"][x["pos"]] == pytest.approx(x["entropy"], abs=1e-5)
            assert resp["sc"][x["pos"]] == pytest.approx(x["s_centered"], abs=1e-5)
            assert resp["logp"][x["pos"]] == pytest.approx(x["logp"], abs=1e-5)
            assert (resp["mark"][x["pos"]] in ("dropped", "zeroed")) == (not x["kept"])
        marks = {m for resp in flat for m in resp["mark"]}
        assert ("dropped" in marks) == (name == "clip_v-s0")  # ClipV at mu 0.5 drops; GRPO never
        samples = [s for s in _rows(run / "samples.jsonl") if s["step"] == 2][: 2 * g]
        assert [resp["reward"] for resp in flat] == [s["reward"] for s in samples]
        assert [r["prompt"] for r in view] == [samples[0]["prompt"], samples[g]["prompt"]]


def test_trl_engine_records_its_rollout_view(tmp_path):
    model = make_micro_policy(tmp_path / "policy")
    sets = [a for s in micro_overrides(model, **{"train.max_steps": 1, "probe.view_every": 1, "eval.every": 0,
                                                 "method.name": "clip_v", "method.presets.clip_v.mu": 0.5,
                                                 "probe.enabled": "false", "probe.records_every": 0,
                                                 "probe.jvp_every": 0, "probe.counterfactual_every": 0,
                                                 "train.tensorboard": "false"}) for a in ("--set", s)]
    assert main(["train", "--engine", "trl", "--no-doctor", "--out", str(tmp_path / "run"), *sets]) == 0
    view = _rows(tmp_path / "run" / "token_view.jsonl")
    assert [(r["step"], r["group"], r["engine"]) for r in view] == [(1, 0, "trl"), (1, 1, "trl")]
    flat = [resp for r in view for resp in r["responses"]]
    assert all(resp["reward"] is None and set(resp["mark"]) <= {"kept", "dropped"} for resp in flat)
    assert any("dropped" in resp["mark"] for resp in flat)
    for resp in flat:  # S_c = S* - E_p[S] <= S*: E_p[S] >= -0.2239 ... both from one TokenStats; lengths agree
        assert len(resp["tokens"]) == len(resp["h"]) == len(resp["sc"]) == len(resp["mark"])


def test_the_report_draws_the_tokens_and_compares_one_prompt_under_two_methods(runs, tmp_path):
    nums = build_report([runs / "cmp"], tmp_path / "rep")
    tv = nums["token_view"]
    assert set(tv["runs"]) == {"none-s0", "clip_v-s0"} and tv["groups_drawn"] == 4 and tv["left_out"] == 0
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "The same prompt under two runs" in page  # one seed: the same prompts at step 2
    res = _chromium("--virtual-time-budget=3000", "--dump-dom", (tmp_path / "rep" / "report.html").resolve().as_uri(),
                    tmp=tmp_path)
    dom = res.stdout
    # the comparison repeats each shared group's responses: count the tokens of the run sections only
    body = dom[dom.index('id="tokens"'):dom.index("The same prompt under two runs")]
    assert len(re.findall(r'<span class="t m-', body)) == tv["tokens_drawn"] + len(tvp.MARK_STYLE)  # + legend
    assert 'class="t m-dropped"' in body
    dropped = sum(v[0] for v in tv["dropped_shares"]["clip_v-s0"]["position"].values())
    assert body.count('class="t m-dropped"') == dropped + 1  # + the legend's sample


def _hand_view(folder: Path, groups: int, token: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"schema": "erft.run/1", "status": "finished", "step": 1}))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "entropy/mean": 1.0}) + "\n")
    rows = [{"step": 1 + i // 2, "group": i % 2, "engine": "native", "prompt": "<b>bold prompt</b>",
             "responses": [{"reward": 1.0, "adv": 0.5, "tokens": [token, "x"] * 20, "logp": [-1.0] * 40,
                            "h": [0.5] * 40, "s": [0.1] * 40, "sc": [0.05] * 40, "mark": ["dropped", "kept"] * 20}]}
            for i in range(groups)]
    (folder / "token_view.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_markup_in_a_token_is_text_and_the_page_is_bounded(tmp_path):
    evil = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned2'\">"
    run = _hand_view(tmp_path / "evil", 200, evil)
    nums = build_report([run], tmp_path / "rep")
    tv = nums["token_view"]
    # 200 groups at steps 1..100; the newest 2 steps hold 4 groups; 196 left out
    assert tv["groups_drawn"] == 4 and tv["left_out"] == 196
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "Left out: 196 of 200 recorded groups" in page
    assert "&lt;script&gt;" in page and "<script>document" not in page and "&lt;b&gt;bold prompt" in page
    res = _chromium("--virtual-time-budget=3000", "--dump-dom", (tmp_path / "rep" / "report.html").resolve().as_uri(),
                    tmp=tmp_path)
    head = res.stdout.split("</title>")[0]
    assert "pwned" not in head and '<img src="x"' not in res.stdout and "<b>bold" not in res.stdout
    assert res.stdout.count("&lt;script&gt;") >= 4 * 20


def test_the_token_bound_holds_with_long_responses(tmp_path, monkeypatch):
    monkeypatch.setattr(tvp, "STEPS_PER_RUN", 1000)
    run = _hand_view(tmp_path / "long", 1000, "t")
    tv = build_report([run], tmp_path / "rep")["token_view"]
    # 40 tokens a group: the group cap (24) binds before the token cap (12,000)
    assert tv["groups_drawn"] == tvp.MAX_GROUPS and tv["left_out"] == 1000 - tvp.MAX_GROUPS
    monkeypatch.setattr(tvp, "MAX_TOKENS", 100)
    tv = build_report([run], tmp_path / "rep2")["token_view"]
    assert tv["groups_drawn"] == 3 and tv["tokens_drawn"] == 120  # drawing stops once 100 tokens are reached


def test_no_view_no_section(tmp_path):
    assert read_views(tmp_path) == [] and token_views([SimpleNamespace(path=tmp_path, name="x", label="x")]) == ()
    assert tvp.token_view_section(()) == ("", {"runs": [], "left_out": 0})
