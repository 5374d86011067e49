"""Extreme values and stops (issue 65, items 8, 9, 11): each ends in one line naming the field, flag or variable,
with a bound or a fix, and an exit status; nothing is written before it.

- 8: ``algo.eps_high`` / ``algo.eps_low`` = 1e308, ``algo.grad_accum`` / ``train.threads`` = 2**63, ``--threads``
  2**63, ``erft compare --jobs 2147483647``, and a path ``~nouser/...`` in ``--model``, ``ERFT_CACHE`` or
  ``HF_HOME`` were internal errors (after the run folder or ``--out`` was made, for some).
- 9: ``erft compare --seeds N`` loaded and validated every run's config (~18 ms a run); a variant's configs are
  now validated once per variant (at its lowest and highest seed) and copied per seed, which the tests count,
  not time. A stop signal during the preparation ends in one line and 128 + its number.
- 11: the words of a run whose worker pool a killed worker broke (``sweep.outcome``), and a stop signal after the
  runs, while the summary is computed.

Everything runs in this process through ``entropy_rft.cli.main.main``; nothing trains.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures.process import BrokenProcessPool

import pytest

from entropy_rft.cli.main import build_parser, main
from entropy_rft.config.loading import load_config
from entropy_rft.config.schema import config_to_dict
from entropy_rft.launch import sweep

BIG = str(2**63)  # 9223372036854775808: one past a C long long
NO_USER = "erft-no-such-user-65"
MICRO_TASK = ["--set", "task.name=micro:DigitTask"]


def refused(capsys, argv: list[str], rc: int = 2) -> str:
    """``erft ARGV`` exits ``rc`` with one stderr line and no traceback; returns the line."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == rc
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- 8. bounds on config fields


@pytest.mark.parametrize("setting, line", [
    ("algo.eps_high=1e308", "config field 'algo.eps_high' must be in [0, 10] or null, got 1e+308"),
    ("algo.eps_low=1e308", "config field 'algo.eps_low' must be in [0, 1] or null, got 1e+308"),
    (f"algo.grad_accum={BIG}", f"config field 'algo.grad_accum' ({BIG}) must not exceed a minibatch's 64 sequences "
     "(the rollout batch's 128 / algo.minibatches 2): a micro-batch holds at least one sequence"),
    (f"train.threads={BIG}",
     f"config field 'train.threads' must be in 0..1024 (0: automatic, see train.threads), got {BIG}"),
])
def test_a_value_past_a_fields_bound_is_refused_before_the_run_folder(setting, line, tmp_path, capsys):
    out = tmp_path / "run"
    assert refused(capsys, ["train", "--set", setting, "--out", out]) == f"erft train: error: {line}"
    assert not out.exists()


@pytest.mark.parametrize("setting", ["algo.eps_high=10", "algo.eps_low=1", "algo.grad_accum=64", "train.threads=1024"])
def test_the_bounds_themselves_are_accepted(setting):
    load_config(None, [setting], check_method=False)


def test_threads_flag_has_the_same_bound(tmp_path, capsys):
    out = tmp_path / "eval"
    line = refused(capsys, ["eval", "--model", "default", "--threads", BIG, "--out", out])
    assert line == f"erft eval: error: --threads must be in 0..1024 (0: automatic), got {BIG}"
    assert not out.exists()


def test_compare_jobs_past_its_bound_is_refused_before_out(tmp_path, capsys):
    out = tmp_path / "cmp"
    line = refused(capsys, ["compare", "--methods", "none", "--jobs", "2147483647", "--out", out])
    assert line == ("erft compare: error: --jobs must be in 1..256 (runs trained at a time, each a process), "
                    "got 2147483647")
    assert not out.exists()


def test_compare_seeds_past_train_seeds_maximum_are_refused(tmp_path, capsys):
    out = tmp_path / "cmp"
    line = refused(capsys, ["compare", "--methods", "none", "--seed", "4294967290", "--seeds", "10", "--out", out])
    assert line == ("erft compare: error: --seeds 10 from seed 4294967290 ends at seed 4294967299, above "
                    "train.seed's maximum 4294967295; lower --seeds or --seed")
    assert not out.exists()


# ----------------------------------------------------------------------------- 8. ~user in paths


def test_model_under_a_user_that_does_not_exist(tmp_path, capsys):
    out = tmp_path / "run"
    line = refused(capsys, ["train", "--model", f"~{NO_USER}/m", *MICRO_TASK, "--out", out])
    assert line == (f"erft train: error: --model '~{NO_USER}/m': user '{NO_USER}' does not exist here, so "
                    f"'~{NO_USER}' cannot be expanded; write the path in full (e.g. /home/<user>/...)")
    assert not out.exists()


@pytest.mark.parametrize("variable, model", [("ERFT_CACHE", "default"), ("HF_HOME", "some-org/some-model")])
def test_cache_variable_under_a_user_that_does_not_exist(variable, model, tmp_path, monkeypatch, capsys):
    for name in ("ERFT_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, f"~{NO_USER}/cache")
    out = tmp_path / "run"
    line = refused(capsys, ["train", "--model", model, *MICRO_TASK, "--out", out])
    assert line == (f"erft train: error: {variable} '~{NO_USER}/cache': user '{NO_USER}' does not exist here, so "
                    f"'~{NO_USER}' cannot be expanded; write the path in full (e.g. /home/<user>/...)")
    assert not out.exists()


# ----------------------------------------------------------------------------- 9. preparing many seeds


def _compare_args(tmp_path, *extra: str):
    return build_parser().parse_args(["compare", "--methods", "none,clip_v", "--model", "default", *MICRO_TASK,
                                      "--max-steps", "1", "--out", str(tmp_path / "cmp"), *extra])


def test_many_seeds_validate_each_variants_config_once_not_each_runs(tmp_path, monkeypatch, capsys):
    """2,000 seeds x 2 variants: the old preparation validated 4,000 configs and built 4,000 methods."""
    from entropy_rft.cli import compare
    from entropy_rft.config import loading, validation

    counts = {"validate": 0, "method": 0}
    validate, validate_method = loading.validate, validation.validate_method

    def counted_validate(*a, **k):
        counts["validate"] += 1
        return validate(*a, **k)

    def counted_method(*a, **k):
        counts["method"] += 1
        return validate_method(*a, **k)

    monkeypatch.setattr(loading, "validate", counted_validate)
    monkeypatch.setattr(validation, "validate_method", counted_method)
    out, variants, plans = compare._prepare(_compare_args(tmp_path, "--seed", "5", "--seeds", "2000"))
    assert counts == {"validate": 4, "method": 2}  # each variant at its lowest and highest seed; one method each
    assert not out.exists()
    assert [(v.dirname, seed) for v, seed, _ in plans[:3]] == [("none", 5), ("clip_v", 5), ("none", 6)]
    assert len(plans) == 4000 and plans[-1][1] == 2004
    monkeypatch.setattr(loading, "validate", validate)
    for k in (0, 1, 2001, 3999):  # each plan's config is the one loading it with its seed gives, and its own
        v, seed, cfg = plans[k]
        assert cfg.train.seed == seed
        loaded = load_config(None, MICRO_TASK[1:], check_method=False,
                             extra={"model": {"name": "default"}, "method": v.method_extra(),
                                    "train": {"max_steps": 1, "seed": seed}})
        assert config_to_dict(cfg) == config_to_dict(loaded)
    assert plans[0][2].train is not plans[2][2].train and plans[0][2].method is not plans[2][2].method


def _in_main_thread() -> None:
    """Signal handlers are installed from the main thread only: pytest runs tests there (xdist's workers too)."""
    assert threading.current_thread() is threading.main_thread()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_preparing_ends_in_one_line(sig, tmp_path, monkeypatch, capsys):
    _in_main_thread()
    make_plans = sweep.make_plans

    def signalled(*a, **k):
        signal.raise_signal(sig)  # as `kill` from outside, while the configs are checked (handled at once)
        return make_plans(*a, **k)

    monkeypatch.setattr(sweep, "make_plans", signalled)
    before = signal.getsignal(sig)
    out = tmp_path / "cmp"
    line = refused(capsys, ["compare", "--methods", "none", *MICRO_TASK, "--seeds", "3", "--out", out],
                   rc=128 + sig)
    assert line == f"erft compare: stopped by {sig.name} before any run started; nothing was written"
    assert not out.exists()
    assert signal.getsignal(sig) is before  # the handlers are put back


# ----------------------------------------------------------------------------- 11. how a run ended


def test_a_run_stopped_by_a_broken_pool_is_stopped_and_only_the_killed_one_failed():
    broken = BrokenProcessPool("A process in the process pool was terminated abruptly")
    assert sweep.outcome(broken, False, {"status": "stopped", "step": 22}) == (
        "stopped", "stopped at step 22 when another run's process was killed (checkpoint saved; rerun the same "
        "command to resume it)")
    assert sweep.outcome(broken, False, {"status": "stopped", "step": 4}, checkpoints=False)[1].endswith(
        "(no checkpoint, train.checkpoints is false: a rerun starts it again)")
    for status in ({"status": "running", "step": 16}, {}):  # the killed one: it recorded no stop
        kind, words = sweep.outcome(broken, False, status)
        assert kind == "failed" and words.startswith("FAILED: its process was killed"), words
        assert "BrokenProcessPool" not in words
    assert sweep.outcome(broken, False, {"status": "finished", "step": 9}) == ("done", "done")


def test_the_other_outcomes_keep_their_words():
    assert sweep.outcome(None, False, {}) == ("done", "done")
    assert sweep.outcome(SystemExit(143), True, {}) == ("stopped", "stopped")
    assert sweep.outcome(RuntimeError("boom\nmore"), False, {}) == ("failed", "FAILED: RuntimeError: boom")
    assert sweep.outcome(SystemExit(143), False, {})[0] == "failed"  # no stop was asked for


def test_a_status_older_than_the_run_is_not_its_outcome(tmp_path):
    (tmp_path / "run.json").write_text('{"schema": "erft.run/1", "status": "stopped", "step": 3}')
    os.utime(tmp_path / "run.json", (1000.0, 1000.0))
    assert sweep.status_since(tmp_path, 1003.0) == {}  # left by an earlier session
    assert sweep.status_since(tmp_path, 1001.0)["status"] == "stopped"  # whole seconds on some file systems
    assert sweep.status_since(tmp_path, 999.0)["status"] == "stopped"
    assert sweep.status_since(tmp_path / "missing", 0.0) == {}


def test_a_signal_after_the_runs_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """The runs ended (``train_all`` stands in for them); a SIGTERM while the summary is computed."""
    _in_main_thread()
    from entropy_rft.analysis import summary

    monkeypatch.setattr(sweep, "train_all", lambda *a, **k: None)

    def signalled(*a, **k):
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("the signal ends the summary")

    monkeypatch.setattr(summary, "compare_summary", signalled)
    out = tmp_path / "cmp"
    line = refused(capsys, ["compare", "--methods", "none", *MICRO_TASK, "--out", out], rc=143)
    assert line == ("erft compare: stopped by SIGTERM after the runs ended, before the summary was written; rerun "
                    "the same command to write it (the runs are kept)")
    assert not (out / "summary.md").exists()


def test_a_dataset_source_under_a_user_who_does_not_exist_is_one_line(tmp_path):
    from entropy_rft.common.errors import UserError
    from entropy_rft.tasks.rows import _local_file

    with pytest.raises(UserError, match=r"task.params.source '~nouser_erft/d.jsonl': user 'nouser_erft' does not "
                                        r"exist here"):
        _local_file("~nouser_erft/d.jsonl")
