"""Issue 73: the sweep driver behind `make run-real-cpu` and `make run-gpu` (benchmarks/gpu/realm.py) under the
faults a ten-hour sweep over many sittings meets, on the micro policy at tests/test_real_cpu.py's sizes.

- a committed run cut short (a torn last line, its last rows missing) beside a run.json saying finished is refused
  in one line naming the file and what is missing, or restored from the finished run in runs/ (said so);
- nothing is written through a link under results/;
- the export writes through a temp file and a rename, run.json last, and rewrites no unchanged file: a full disk
  (a file-size limit) leaves the committed copy whole and ends in one line, training going on;
- a second driver on the same folders is refused in one line naming the first's process, before anything trains;
- a SIGKILLed driver takes its sweep with it (each run stops with a checkpoint), and a start right away resumes it;
- the last resort of --stop-wait-s reaches every process of the sweep, each in a process group of its own;
- a damaged environment.json is set aside in one line.

After every fault the rows equal an uninterrupted sweep's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from entropy_rft.common.processes import session_members
from entropy_rft.launch import results as results_export
from entropy_rft.launch import sessions
from entropy_rft.rundir import finished as run_files
from entropy_rft.rundir.files import FAULT_ENV, read_jsonl
from micro import make_micro_policy, micro_overrides
from test_determinism import stable

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = ROOT / "configs" / "smollm2-cpu.yaml"
TESTS = Path(__file__).resolve().parent
DRIVER = "benchmarks.gpu.realm"  # run as a module from ROOT, as the Makefile runs it

STEPS = 6


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """The micro policy, the driver's --set overrides, and the rows of one uninterrupted sweep of ``none``."""
    base = tmp_path_factory.mktemp("sweep-faults")
    policy = make_micro_policy(base / "policy")
    sets = micro_overrides(policy, **{"task.params": "{}", "train.max_steps": STEPS, "train.checkpoint_every": 2,
                                      "eval.every": 2, "probe.jvp_every": 0, "probe.counterfactual_every": 0})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop(FAULT_ENV, None)
    clean = base / "clean"
    out = subprocess.run(_argv(sets, clean / "results", clean / "runs"), env=env, capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = read_jsonl(clean / "results" / "none-s0" / "metrics.jsonl")
    return {"sets": sets, "env": env, "rows": rows, "clean": clean / "results" / "none-s0"}


def _argv(sets: list[str], results: Path, runs: Path, methods: str = "none") -> list[str]:
    return [sys.executable, "-m", DRIVER, "--config", str(CPU_CONFIG), "--results", str(results),
            "--runs", str(runs), "--methods", methods, "--seeds", "1", "--jobs", "2", "--export-every-s", "1",
            "--stop-wait-s", "60", "--no-report", *sum((["--set", s] for s in sets), [])]


def _sweep(micro, tmp: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(_argv(micro["sets"], tmp / "results", tmp / "runs"), env=micro["env"], capture_output=True,
                          text=True, cwd=ROOT, **kw)


def _lines(out: subprocess.CompletedProcess) -> str:
    return out.stdout + out.stderr


def _shipped(run: Path) -> dict[str, bytes]:
    return {n: (run / n).read_bytes() for n in run_files.SHIPPED if (run / n).is_file()}


# --- finished, proven from the rows (hand-made runs: the words are the rule's, written here by hand) -------------

def _hand_run(folder: Path, steps: int = 4, every: int = 2, rows: list[dict] | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"status": "finished", "step": steps, "max_steps": steps}))
    (folder / "config.yaml").write_text(f"eval:\n  every: {every}\n")
    if rows is None:
        rows = [{"step": s, **({"eval/pass@1": 0.5} if s % every == 0 or s == steps else {}),
                 **({"loss": 1.0} if s else {})} for s in range(steps + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_a_run_is_finished_only_when_its_rows_prove_it(tmp_path):
    whole = _hand_run(tmp_path / "whole", steps=5, every=2)  # evaluations at 0, 2, 4 and the last, 5
    assert run_files.missing(whole) is None and run_files.finished(whole)
    assert run_files.missing(str(whole)) is None and run_files.finished(str(whole))  # a path as text reads the same
    torn = _hand_run(tmp_path / "torn")
    text = (torn / "metrics.jsonl").read_text()
    (torn / "metrics.jsonl").write_text(text[: text.index('{"step": 3') + 9])  # rows 0-2 whole, row 3 cut
    assert run_files.missing(torn) == ("metrics.jsonl: its last line is cut short (no line end); step(s) 3-4 of 0-4 "
                                       "missing; no evaluation at step(s) 4")
    short = _hand_run(tmp_path / "short", rows=[{"step": 0, "eval/x": 1}, {"step": 1}, {"step": 1}, {"step": 3}])
    assert run_files.missing(short) == ("metrics.jsonl: step(s) 2, 4 of 0-4 missing; step(s) 1 logged more than "
                                        "once; no evaluation at step(s) 2, 4")
    no_evals = _hand_run(tmp_path / "no-evals", steps=2, every=0, rows=[{"step": 1}, {"step": 2}])
    assert run_files.missing(no_evals) is None  # eval.every 0: no step 0, no evaluation
    (no_evals / "config.yaml").write_text("eval: [")
    assert run_files.missing(no_evals) == "config.yaml has no whole eval.every"
    (whole / "run.json").write_text('{"status": "finish')
    assert run_files.missing(whole) == "run.json does not say finished" and not run_files.finished(whole)


# --- the export ----------------------------------------------------------------------------------------------------

def test_the_export_rewrites_no_unchanged_file_and_writes_through_no_link(tmp_path):
    src = _hand_run(tmp_path / "runs" / "none-s0")
    (src / "samples.jsonl").write_text('{"prompt": "p"}\n')
    dst = tmp_path / "results" / "none-s0"
    assert results_export.export(tmp_path / "runs", tmp_path / "results") == ["none-s0"]
    assert _shipped(dst) == _shipped(src)
    before = {n: (dst / n).stat() for n in run_files.SHIPPED}
    results_export.export(tmp_path / "runs", tmp_path / "results")
    after = {n: (dst / n).stat() for n in run_files.SHIPPED}
    assert all((before[n].st_ino, before[n].st_mtime_ns) == (after[n].st_ino, after[n].st_mtime_ns)
               for n in run_files.SHIPPED)  # nothing rewritten
    (src / "samples.jsonl").write_text('{"prompt": "q"}\n')
    results_export.export(tmp_path / "runs", tmp_path / "results")
    assert (dst / "samples.jsonl").stat().st_ino != before["samples.jsonl"].st_ino  # a new file, renamed in
    assert (dst / "samples.jsonl").read_text() == '{"prompt": "q"}\n'
    assert (dst / "metrics.jsonl").stat().st_ino == before["metrics.jsonl"].st_ino

    outside = tmp_path / "outside.jsonl"
    outside.write_text("someone's file\n")
    (dst / "samples.jsonl").unlink()
    (dst / "samples.jsonl").symlink_to(outside)
    done, line = results_export.try_export(tmp_path / "runs", tmp_path / "results")
    assert done == [] and "samples.jsonl is a symbolic link" in line and "\n" not in line
    assert outside.read_text() == "someone's file\n"


def test_a_full_disk_leaves_the_committed_copy_whole(tmp_path):
    """The export under a file-size limit (a disk that fills while it writes): the committed metrics.jsonl is the
    old one, whole, no temp file is left, and the failure is one line."""
    src = _hand_run(tmp_path / "runs" / "none-s0", steps=40, every=2)
    dst = tmp_path / "results" / "none-s0"
    _hand_run(dst, steps=2, every=2)
    old = (dst / "metrics.jsonl").read_bytes()
    limit = len(old) + 64
    assert (src / "metrics.jsonl").stat().st_size > limit
    code = ("import resource, signal, sys; from entropy_rft.launch import results as results_export; "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY)); "
            f"done, line = results_export.try_export(results_export.Path({str(tmp_path / 'runs')!r}), "
            f"results_export.Path({str(tmp_path / 'results')!r})); print(line)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith("the export to") and "File too large" in out.stdout, out.stdout
    assert (dst / "metrics.jsonl").read_bytes() == old and run_files.finished(dst)
    assert sorted(p.name for p in dst.iterdir()) == sorted(["config.yaml", "metrics.jsonl", "run.json"])


def test_the_last_resort_reaches_every_process_of_the_sweep(tmp_path):
    """A run worker in a process group of its own that does not stop on SIGTERM (a run deep in a long step): the
    last resort after --stop-wait-s (launch.sessions.stop_session) still kills it."""
    pidfile = tmp_path / "worker.pid"
    worker = ("import os, signal, time; os.setpgrp(); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    parent = (f"import signal, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)")
    proc = sessions.start_session([sys.executable, "-c", parent])
    end = time.monotonic() + 60
    while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < end:
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    assert os.getpgid(pid) == pid != proc.pid and os.getsid(pid) == proc.pid
    sessions.stop_session(proc, 0.5)
    assert proc.poll() is not None and session_members(proc.pid) == []
    assert _ended(pid)


def _ended(pid: int) -> bool:
    """Whether ``pid`` has ended: gone, or a zombie nobody has reaped yet (a container's init may never)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 1:].split()[0] in ("Z", "X")


# --- the driver, end to end ---------------------------------------------------------------------------------------

def test_a_torn_committed_run_is_refused_or_restored(micro, tmp_path):
    first = _sweep(micro, tmp_path)
    assert first.returncode == 0, _lines(first)
    committed = tmp_path / "results" / "none-s0"
    whole = _shipped(committed)
    text = whole["metrics.jsonl"].decode()
    cut = text.index('{"step": 5')  # rows 0-4 whole; row 5 cut in its middle, row 6 gone
    (committed / "metrics.jsonl").write_text(text[: cut + 40])
    (tmp_path / "results" / "environment.json").write_text('[{"device": "cpu", "wa')  # cut short too

    # runs/ still holds the finished run: the committed copy is restored from it, and said so
    again = _sweep(micro, tmp_path)
    assert again.returncode == 0, _lines(again)
    assert "restored from the finished run in" in again.stdout and "cut short" in again.stdout, again.stdout
    assert _shipped(committed) == whole
    assert "environment.json was damaged" in again.stdout
    aside = tmp_path / "results" / "environment.json.damaged"
    assert aside.read_text() == '[{"device": "cpu", "wa'
    assert len(json.loads((tmp_path / "results" / "environment.json").read_text())) == 1

    # a bare sitting (no runs/): a copy missing its last rows is refused, naming the file; nothing trains
    (tmp_path / "runs").rename(tmp_path / "sitting-1")
    (committed / "metrics.jsonl").write_text(text[:cut])
    refused = _sweep(micro, tmp_path)
    assert refused.returncode == 2 and "Traceback" not in _lines(refused)
    said = [line for line in refused.stdout.splitlines() if "none-s0" in line]
    assert said == [f"run_gpu: {committed}/metrics.jsonl: step(s) 5-6 of 0-{STEPS} missing; no evaluation at "
                    f"step(s) 6, though its run.json says finished: restore it (git checkout -- {committed}) or "
                    f"remove {committed} to train it again"], refused.stdout
    assert not (tmp_path / "runs" / "none-s0").exists()
    assert stable(read_jsonl(tmp_path / "sitting-1" / "none-s0" / "metrics.jsonl")) == stable(micro["rows"])


def test_a_link_under_results_is_refused_before_anything_is_written(micro, tmp_path):
    committed = tmp_path / "results" / "none-s0"
    committed.mkdir(parents=True)
    for name, data in _shipped(micro["clean"]).items():
        (committed / name).write_bytes(data)
    outside = tmp_path / "outside.jsonl"
    outside.write_text("someone's file\n")
    (committed / "samples.jsonl").unlink()
    (committed / "samples.jsonl").symlink_to(outside)
    out = _sweep(micro, tmp_path)
    assert out.returncode == 2 and "Traceback" not in _lines(out)
    assert out.stdout.strip().splitlines()[-1].startswith(f"run_gpu: {committed}/samples.jsonl is a symbolic link")
    assert outside.read_text() == "someone's file\n" and not (tmp_path / "runs" / "none-s0").exists()


def test_a_second_driver_is_refused_naming_the_first(micro, tmp_path):
    results = tmp_path / "results"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from entropy_rft.rundir.lock import RunLock; "
                               f"RunLock({str(results)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = _sweep(micro, tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2 and "Traceback" not in _lines(out)
    assert out.stdout.strip().splitlines() == [
        f"run_gpu: results folder {results} is in use by process {holder.pid}; another sweep driver is writing it: "
        "wait for it to finish or stop it (kill PID: its runs save a checkpoint); nothing was started"]
    assert not (tmp_path / "runs").exists()


def _compare_pid(runs: Path, timeout: float = 120.0) -> int:
    """The pid of the ``erft compare`` writing ``runs`` (its session's id)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    argv = (entry / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"compare" in argv and str(runs).encode() in argv:
                    return int(entry.name)
        time.sleep(0.2)
    raise AssertionError("no erft compare started")


def test_a_killed_driver_takes_its_sweep_with_it(micro, tmp_path):
    runs = tmp_path / "runs"
    driver = subprocess.Popen(_argv(micro["sets"], tmp_path / "results", runs), env=micro["env"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    compare = _compare_pid(runs)
    end = time.monotonic() + 300
    while not any(r.get("step", 0) >= 1 for r in read_jsonl(runs / "none-s0" / "metrics.jsonl")
                  if (runs / "none-s0" / "metrics.jsonl").is_file()):
        assert time.monotonic() < end and driver.poll() is None
        time.sleep(0.05)
    os.kill(driver.pid, signal.SIGKILL)  # the OOM killer, kill -9, a supervisor
    driver.wait()
    end = time.monotonic() + 120
    while session_members(compare) and time.monotonic() < end:
        time.sleep(0.2)
    assert session_members(compare) == []  # compare and its worker ended with the driver
    status = json.loads((runs / "none-s0" / "run.json").read_text())
    assert status["status"] == "stopped" and status["step"] < STEPS, status  # a checkpoint, not trained on
    again = _sweep(micro, tmp_path)  # a start right away: nothing holds the runs
    assert again.returncode == 0, _lines(again)
    assert stable(read_jsonl(tmp_path / "results" / "none-s0" / "metrics.jsonl")) == stable(micro["rows"])


SITE = """import resource
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # the runs write freely; the driver lowers its own
"""


def test_a_failed_export_is_one_line_and_training_goes_on(micro, tmp_path):
    """The results' disk fills while the runs train (the driver's file-size limit; its runs write freely): one
    line, the run trains to its end, the call ends non-zero with the line, nothing torn is left; the next call
    exports it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    env = {**micro["env"], "PYTHONPATH": os.pathsep.join([str(site), micro["env"]["PYTHONPATH"]])}
    limit = 2048  # the lock files and environment.json fit; a run's metrics.jsonl does not
    assert len((micro["clean"] / "metrics.jsonl").read_bytes()) > limit
    wrapper = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY)); "
               f"sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
    argv = _argv(micro["sets"], tmp_path / "results", tmp_path / "runs")
    out = subprocess.run([sys.executable, "-c", wrapper, *argv[2:]], env=env, capture_output=True, text=True,
                         cwd=ROOT)  # argv[2:]: the driver's module and its arguments
    assert out.returncode == 2 and "Traceback" not in _lines(out), _lines(out)
    said = [line for line in out.stdout.splitlines() if line.startswith("run_gpu:") and "failed" in line]
    assert said and "File too large" in said[0] and "training goes on" in said[0], out.stdout
    assert said[-1].endswith("free the space (or mend the folder) and run it again to export them"), said
    assert run_files.finished(tmp_path / "runs" / "none-s0")  # it trained to its end
    committed = tmp_path / "results" / "none-s0"
    assert not (committed / "run.json").exists()  # run.json is written last: no finished run beside torn rows
    left = [p.name for p in committed.iterdir()] if committed.is_dir() else []
    assert not [n for n in left if n.startswith(".")], left  # no temp file left behind
    again = _sweep(micro, tmp_path)
    assert again.returncode == 0, _lines(again)
    assert stable(read_jsonl(committed / "metrics.jsonl")) == stable(micro["rows"])


# --- the same driver from erft compare (issue 78) ------------------------------------------------------------------


def test_erft_compare_with_results_is_the_same_driver(micro, tmp_path):
    """``erft compare --results DIR`` runs the package's driver (launch.resumable): the finished run's shipped files
    in DIR with the rows of the clean sweep, a log entry per sitting, and a second sitting keeps the run and trains
    nothing. Its own flags are refused without --results, and --results cannot be --out."""
    def erft(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "entropy_rft.cli", "compare", "--config", str(CPU_CONFIG), "--methods", "none",
               "--seeds", "1", "--jobs", "2", *sum((["--set", s] for s in micro["sets"]), []), *extra]
        return subprocess.run(cmd, env=micro["env"], capture_output=True, text=True, timeout=900)

    results, runs = tmp_path / "results", tmp_path / "runs"
    first = erft("--out", str(runs), "--results", str(results), "--export-every-s", "1", "--no-report")
    assert first.returncode == 0, _lines(first)
    assert "erft compare: 1 run(s) finished in" in first.stdout and "complete" in first.stdout
    assert sorted(p.name for p in (results / "none-s0").iterdir()) == sorted(run_files.SHIPPED)
    assert stable(read_jsonl(results / "none-s0" / "metrics.jsonl")) == stable(micro["rows"])
    assert (results / "summary.md").is_file() and not (results / "report").exists()  # --no-report
    again = erft("--out", str(tmp_path / "bare"), "--results", str(results), "--no-report")
    assert again.returncode == 0, _lines(again)
    assert "erft compare: kept 1 run(s) already in" in again.stdout and "none-s0" in again.stdout
    log = json.loads((results / "environment.json").read_text())
    assert [e["complete"] for e in log] == [True, True] and log[0]["runs_finished"] == 1
    for extra, words in ((["--out", str(runs), "--deadline-s", "5"], "add --results DIR"),
                         (["--out", str(runs), "--results", str(runs)], "--results must be another folder")):
        bad = erft(*extra)
        assert bad.returncode != 0 and words in bad.stderr, _lines(bad)
