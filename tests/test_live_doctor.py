"""Issue 75 (item 2): erft doctor live. The announcements (new or worse only), ``erft train`` printing and
recording findings as they arise (doctor.jsonl, kept across a resume), ``erft doctor --follow`` on a verl log
another process is writing, a TRL ``TrainerCallback`` in a real stock ``GRPOTrainer`` run that halts on a
collapse it was driven into and runs on where there is none, and the score at H = 0 with its interval."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scipy import stats

from entropy_rft.analysis import doctor as d
from entropy_rft.analysis.live_doctor import Announcer, RowDoctor, doctor_callback, reaches
from entropy_rft.cli.main import main
from micro import make_micro_policy, micro_overrides
from test_byo import console_line
from test_doctor import EVAL_STEPS, SICK_R, STEPS, erft_run, sick_h

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "results" / "smollm2-cpu"


def finding(fid: str, level: str) -> d.Finding:
    return d.Finding(fid, level, "t", "e", ("k",), "r", None)


def test_only_new_or_worse_findings_are_announced():
    a = Announcer()
    assert [f.id for f in a.news([finding("x", "warn"), finding("y", "info")])] == ["x", "y"]
    assert a.news([finding("x", "warn"), finding("y", "info")]) == []  # the same again: nothing
    assert a.news([finding("x", "info")]) == []  # better: nothing
    assert [(f.id, f.level) for f in a.news([finding("x", "error"), finding("y", "info")])] == [("x", "error")]
    assert reaches([finding("a", "info"), finding("b", "warn")], "warn").id == "b"
    assert reaches([finding("a", "info")], "warn") is None and reaches([finding("a", "error")], None) is None


# ----------------------------------------------------------------------------- erft train's live doctor


def test_row_doctor_announces_at_the_step_each_rule_first_holds_and_keeps_them_over_a_resume(tmp_path):
    # test_doctor's sick erft run fed row by row (every=1): truncation 0.5 on every step fires once its 5-step
    # window is full (step 5); the collapse and the plateau need 5 evaluations (steps 0, 2, 4, 6, 8: the stall
    # of the last 3 - 0.45, 0.44 at 6, 8 and 0.45 at 4 against 0.30 before - gains 0.15, not yet) and fire at
    # step 10 (0.45, 0.44, 0.45 vs best before 0.45: gain 0); kept 0.999 >= 0.995 on clip_b: barely acts.
    run = erft_run(tmp_path, True)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("")
    cfg = __import__("yaml").safe_load((run / "config.yaml").read_text())
    printed = []

    class Out:
        def write(self, s):
            printed.append(s)

        def flush(self):
            pass

    doc = RowDoctor(run, cfg, every=1, file=Out())
    said = {}
    for row in rows:
        said[row["step"]] = [(f.id, f.level) for f in doc.row(row)]
    doc.close()
    first = {fid: step for step, got in said.items() for fid, _ in got}
    assert first["barely_acts"] == 1  # kept 0.999 from the first step: the mean over what is logged
    assert first["truncation"] == 5
    assert first["entropy_collapse"] == 10 and first["plateau"] == 10
    assert sum(len(v) for v in said.values()) == len(first)  # each announced once
    recorded = [json.loads(x) for x in (run / "doctor.jsonl").read_text().splitlines()]
    assert [(r["step"], r["id"]) for r in recorded] == [(s, fid) for s, got in said.items() for fid, _ in got]
    assert "doctor, step 5: [warn] truncation" in "".join(printed)
    # a resume at step 6 (its logs truncated to step 5 by the run directory): what was announced is not repeated
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 5))
    from entropy_rft.rundir.files import truncate_jsonl

    truncate_jsonl(run / "doctor.jsonl", 5)
    again = RowDoctor(run, cfg, every=1, file=Out())
    news = [(r["step"], f.id) for r in rows if r["step"] >= 6 for f in again.row(r)]
    again.close()
    assert ("truncation" not in {fid for _, fid in news}) and (10, "entropy_collapse") in news


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("live") / "policy")


def _sets(model, **extra):
    return [a for s in micro_overrides(model, **extra) for a in ("--set", s)]


def test_erft_train_prints_and_records_findings_as_they_arise(micro_model, tmp_path, capsys):
    # The random micro policy rarely ends a response within 6 tokens: the truncation rule holds from step 1, and
    # is announced once its 5-step window is full, at the first check after it (every 3 steps: step 6).
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--doctor-every", "3", *_sets(micro_model, **{"train.max_steps": 6})]) == 0
    err = capsys.readouterr().err
    rows = [json.loads(x) for x in (out / "doctor.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    trunc = [m["response/truncated_frac"] for m in metrics if m["step"] >= 2]  # steps 2-6: the window at step 6
    assert [(r["step"], r["id"]) for r in rows] == [(6, "truncation")]
    assert rows[0]["evidence"] == f"truncated share {sum(trunc) / 5:.4f} over steps 2-6"
    assert "doctor, step 6: [warn] truncation: responses hit the length cap" in err
    quiet = tmp_path / "quiet"
    assert main(["train", "--out", str(quiet), "--no-doctor", *_sets(micro_model, **{"train.max_steps": 6})]) == 0
    assert not (quiet / "doctor.jsonl").exists() and "doctor," not in capsys.readouterr().err
    def numbers(rows):  # every number but the clocks'
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]

    quiet_rows = [json.loads(x) for x in (quiet / "metrics.jsonl").read_text().splitlines()]
    assert numbers(quiet_rows) == numbers(metrics)  # the doctor moves no number


def test_erft_train_on_the_trl_engine_records_findings_too(micro_model, tmp_path, capsys):
    # erft's EntropyControlGRPOTrainer logs the native rows (trl_logging.ErftLog); the doctor reads them the same
    # way: the truncated micro policy again, its window full at step 5, checked every 5 steps.
    out = tmp_path / "trl"
    assert main(["train", "--engine", "trl", "--out", str(out), "--doctor-every", "5",
                 *_sets(micro_model, **{"train.max_steps": 5, "eval.every": 5, "train.tensorboard": "false"})]) == 0
    rows = [json.loads(x) for x in (out / "doctor.jsonl").read_text().splitlines()]
    assert ("truncation", 5) in [(r["id"], r["step"]) for r in rows]
    assert "doctor, step 5: [warn] truncation" in capsys.readouterr().err


def test_doctor_every_below_one_is_one_line(capsys):
    assert main(["train", "--doctor-every", "0"]) == 2
    assert "--doctor-every must be >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --follow


WRITER = """
import sys, time
lines = open(sys.argv[1]).read().splitlines(keepends=True)
with open(sys.argv[2], "a") as f:
    for line in lines:
        f.write(line); f.flush(); time.sleep(float(sys.argv[3]))
"""


def _verl_lines(sick: bool) -> str:
    out = []
    for s in STEPS:
        data = {"actor/entropy": sick_h(s) if sick else 1.0 - 0.02 * (s - 1), "actor/pg_clipfrac": 0.01,
                "response_length/clip_ratio": 0.5 if sick else 0.0}
        if s in SICK_R:
            data["val-core/gsm8k/acc/mean@1"] = SICK_R[s] if sick else 0.1 * s
        out.append(console_line(s, data))
    return "".join(out)


def _follow(tmp: Path, sick: bool, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """``erft doctor --follow`` on a log that a second process writes a line at a time (0.3 s apart), starting
    once the follower says it is watching."""
    src, log = tmp / "all.log", tmp / "verl.log"
    src.write_text(_verl_lines(sick))
    log.write_text("")
    cmd = [sys.executable, "-m", "entropy_rft.cli", "doctor", str(log), "--follow", "--poll-s", "0.1",
           "--idle-exit-s", "4", *extra]
    follower = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    first = follower.stdout.readline()
    assert first.startswith("following"), first + follower.stderr.read()
    t0 = time.monotonic()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(src), str(log), "0.3"])
    try:
        out, err = follower.communicate(timeout=120)
    finally:
        writer.wait(timeout=60)
    return subprocess.CompletedProcess(cmd, follower.returncode, first + out, err), time.monotonic() - t0


def test_follow_reports_findings_as_another_process_writes_a_verl_log(tmp_path):
    res, _ = _follow(tmp_path, True)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    # truncation 0.5 from step 1: announced once 5 steps are in; the collapse and the plateau when step 10 (the
    # fifth evaluation) is in, each once, in that order
    lines = [x for x in out.splitlines() if x.startswith("step ")]
    got = [(int(x.split(":")[0].split()[1]), x.split("] ")[1].split(":")[0]) for x in lines]
    assert got[0][1] == "truncation" and 5 <= got[0][0] < 10  # while the log was still being written
    assert {fid for s, fid in got if s == 10} == {"entropy_collapse", "plateau"}
    assert len(got) == len({fid for _, fid in got})  # none repeated while the log grew
    assert "worst level seen: warn" in out


def test_follow_is_quiet_on_a_healthy_log_and_stops_at_once_with_fail_on(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    res, _ = _follow(a, False)
    assert res.returncode == 0 and "no findings" in res.stdout
    assert not [x for x in res.stdout.splitlines() if x.startswith("step ")]
    b = tmp_path / "b"
    b.mkdir()
    res, took = _follow(b, True, "--fail-on", "warn")
    assert res.returncode == 1 and "stopping" in res.stdout
    assert took < 0.3 * 10 + 4  # stopped at step 5's finding, before the writer's last line and the idle wait


def test_follow_refuses_what_it_cannot_watch(tmp_path, capsys):
    assert main(["doctor", str(SMOL / "none-s0"), "--follow"]) == 2
    assert "erft train prints its findings" in capsys.readouterr().err
    assert main(["doctor", str(SMOL / "none-s0"), str(SMOL / "clip_v-s0"), "--follow"]) == 2
    assert "--follow watches one log" in capsys.readouterr().err
    assert main(["doctor", str(SMOL / "none-s0"), "--idle-exit-s", "3"]) == 2
    assert "--idle-exit-s is for --follow" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a real TRL run


def _grpo(policy: Path, out: Path, lr: float, steps: int, cb):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from entropy_rft.models.loading import load_policy

    model, tok = load_policy(str(policy))
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, max_steps=steps, report_to=[], logging_steps=1,
                      save_strategy="no", disable_tqdm=True, seed=3, learning_rate=lr)

    def sevens(completions, **kw):  # the share of 7s: the policy can collapse onto "77777777"
        return [c.count("7") / max(1, len(c)) for c in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=sevens, args=args, processing_class=tok, callbacks=[cb],
                          train_dataset=Dataset.from_dict({"prompt": ["123>7:"] * 8 * steps}))
    trainer.train()
    return trainer


def test_the_callback_halts_a_stock_grpo_run_driven_into_collapse_and_saves_its_checkpoint(micro_model, tmp_path):
    # lr 0.05 on the share of 7s: every completion becomes 7s, the reward sits at 1.0 (no evaluation: the
    # training reward stands in) and the entropy falls below the 0.05-nat floor: an error; halt_on="error".
    cb = doctor_callback(every=1, halt_on="error")
    trainer = _grpo(micro_model, tmp_path / "trl", 0.05, 40, cb)
    assert cb.halted is not None and cb.halted.id == "entropy_collapse" and cb.halted.level == "error"
    step = trainer.state.global_step
    assert step < 40 and (tmp_path / "trl" / f"checkpoint-{step}").is_dir()  # TRL's own save, then stop
    hist = [h for h in trainer.state.log_history if "entropy" in h]
    assert hist[-1]["entropy"] <= d.ENTROPY_FLOOR and hist[-1]["reward"] == 1.0
    assert ("keys: entropy, reward" in d.describe(cb.halted)[1])


def test_the_callback_lets_a_run_without_collapse_finish(micro_model, tmp_path):
    # lr 1e-6: the policy barely moves, its entropy stays near its start (~2.5 nats): no collapse, no halt. (The
    # random policy's truncated answers and one-answer groups are real findings: warn, below halt_on.)
    cb = doctor_callback(every=1, halt_on="error")
    trainer = _grpo(micro_model, tmp_path / "trl", 1e-6, 8, cb)
    assert cb.halted is None and trainer.state.global_step == 8
    assert "entropy_collapse" not in {f.id for _, f in cb.found}
    assert all(f.level != "error" for _, f in cb.found)


def test_the_callback_refuses_a_bad_level():
    from entropy_rft.common.errors import UserError

    with pytest.raises(UserError, match="halt_on must be one of info, warn, error"):
        doctor_callback(halt_on="fatal")


# ----------------------------------------------------------------------------- the score at H = 0


def test_the_heading_is_the_ols_prediction_at_zero_entropy(capsys, tmp_path):
    run = d.load_series(SMOL / "none-s0")
    hs, rs = d.score_pairs(run)
    ahead = d.heading(run, 0.9)
    import numpy as np

    for form, x, x0 in (("law", np.exp(hs), 1.0), ("linear", np.asarray(hs), 0.0)):
        res = stats.linregress(x, rs)  # scipy's own least squares, then the textbook interval by hand
        n = len(rs)
        s = np.sqrt(np.sum((np.asarray(rs) - (res.intercept + res.slope * x)) ** 2) / (n - 2))
        half = stats.t.ppf(0.95, n - 2) * s * np.sqrt(1 + 1 / n + (x0 - x.mean()) ** 2 / np.sum((x - x.mean()) ** 2))
        pred = res.intercept + res.slope * x0
        assert ahead[form]["predicted"] == pytest.approx(pred, abs=1e-9)
        assert (ahead[form]["low"], ahead[form]["high"]) == pytest.approx((pred - half, pred + half), abs=1e-9)
    fit = __import__("entropy_rft.analysis.law", fromlist=["fit_law"]).fit_law(hs, rs)
    assert ahead["law"]["predicted"] == pytest.approx(fit.ceiling, abs=1e-9)  # the law at H = 0 is b - a
    out = tmp_path / "d.json"
    assert main(["doctor", str(SMOL / "none-s0"), "--json", str(out), "--level", "0.8"]) == 0
    said = capsys.readouterr().out
    assert "the score at H = 0 by the law" in said and "80% prediction intervals from 8 scored steps" in said
    assert json.loads(out.read_text())["runs"][0]["heading"]["level"] == 0.8
    assert main(["doctor", str(SMOL / "none-s0"), "--level", "1"]) == 2


# ----------------------------------------------------------------------------- the report's section


HOSTILE = "val-core/<img src=x onerror=\"document.title='pwned'\"><script>document.title='pwned2'</script>/acc/mean@1"


def test_the_report_shows_the_doctor_and_no_markup_from_a_log_acts(tmp_path):
    # A verl file log (sick: truncation off, pg_clipfrac 0.4 >= 0.2, the collapse and the plateau) whose
    # validation key carries markup and a script: the page shows it as text, in headless Chromium nothing of it runs.
    from entropy_rft.report.page import build_report
    from test_report import _chromium

    rows = []
    for s in STEPS:
        data = {"actor/entropy": sick_h(s), "actor/pg_clipfrac": 0.4}
        if s in SICK_R:
            data[HOSTILE] = SICK_R[s]
        rows.append({"step": s, "data": data})
    log = tmp_path / "exp.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in rows))
    nums = build_report([log], tmp_path / "rep")
    (diag,) = nums["doctor"]
    assert {f["id"] for f in diag["findings"]} == {"entropy_collapse", "plateau", "clip_saturation"}
    assert diag["heading"]["n"] == len(EVAL_STEPS)
    page = (tmp_path / "rep" / "report.html").read_text()
    assert '<h2 id="doctor">Doctor</h2>' in page and "&lt;img src=x" in page and "<img src=x" not in page
    res = _chromium("--virtual-time-budget=3000", "--dump-dom", (tmp_path / "rep" / "report.html").resolve().as_uri(),
                    tmp=tmp_path)
    assert "<h2 id=\"doctor\">Doctor</h2>" in res.stdout, res.stderr[-500:]
    assert "pwned" not in res.stdout.split("</title>")[0]  # no handler or script of the log's ran
    assert '<img src="x"' not in res.stdout and "&lt;script&gt;" in res.stdout
