"""Issue 24: every fault is resumable and nothing executes from a run directory, through the real CLI.

The crash points are made deterministic with the ``ERFT_FAULT=<point>:<step>`` hook (``rundir.fault_point``:
the process SIGKILLs itself there), and the full disk by a file object that fails as a full disk does, under
the real ``torch.save``. Each case ends with the metrics of an uninterrupted run, or with nothing executed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from entropy_rft.cli.main import main
from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from entropy_rft.rundir import checkpoints
from entropy_rft.rundir.files import read_jsonl
from micro import again, make_micro_policy, micro_overrides

TESTS = Path(__file__).parent
VOLATILE = ("time/", "perf/")
SETS = {"train.max_steps": 6, "train.checkpoint_every": 2, "train.keep_checkpoints": 2, "train.tensorboard": False}


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def cli(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("ERFT_FAULT", None)
    if fault:
        env["ERFT_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "entropy_rft.cli", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def set_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


@pytest.fixture(scope="module")
def reference(micro_model, tmp_path_factory) -> dict[int, list[dict]]:
    """Uninterrupted 6-step runs at 1 and 2 threads."""
    refs = {}
    for threads in (1, 2):
        out = tmp_path_factory.mktemp(f"ref{threads}") / "run"
        start(load_config(None, micro_overrides(micro_model, **SETS, **{"train.threads": threads})), out)
        refs[threads] = stable(read_jsonl(out / "metrics.jsonl"))
    assert refs[1][-1]["step"] == 6
    return refs


# ----------------------------------------------------------------------------- 1. the first checkpoint's window


@pytest.mark.parametrize(("fault", "threads"), [("after_row:2", 1), ("after_row:2", 2), ("in_checkpoint:2", 1),
                                                ("after_row:3", 2)])
def test_sigkill_at_a_fixed_point_resumes_exactly(micro_model, tmp_path, reference, capsys, fault, threads):
    """after_row:2 is the window of issue 24's item 1: step 2's row written, its (first) checkpoint not."""
    out = tmp_path / "run"
    sets = micro_overrides(micro_model, **SETS, **{"train.threads": threads})
    killed = cli("train", "--out", str(out), *set_args(sets), fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert read_jsonl(out / "metrics.jsonl")[-1]["step"] == int(fault.split(":")[1])
    if fault.endswith(":2"):
        assert checkpoints.checkpoint_dirs(out) == []  # no checkpoint at all: the run that was stuck for good
    assert main(["train", "--resume", str(out), *again(out)]) == 0
    err = capsys.readouterr().err
    if fault.endswith(":2"):
        assert "no checkpoint yet" in err and "starting again from step 0" in err
    assert stable(read_jsonl(out / "metrics.jsonl")) == reference[threads]
    assert not list((out / "checkpoints").glob(".tmp_step_*"))


def test_compare_that_held_a_run_killed_in_the_window_recovers_on_rerun(micro_model, tmp_path):
    sets = set_args(micro_overrides(micro_model, **{**SETS, "train.max_steps": 3}))
    args = ["compare", "--methods", "none", "--seeds", "1", "--max-steps", "3", *sets]
    first = cli(*args, "--jobs", "2", "--out", str(tmp_path / "cmp"), fault="after_row:2")
    assert first.returncode == 2 and "1 run(s) failed" in first.stderr.strip().splitlines()[-1], first.stderr
    assert main([*args, "--out", str(tmp_path / "cmp")]) == 0  # before: "no checkpoint ..." on every rerun
    assert main([*args, "--out", str(tmp_path / "clean")]) == 0
    for name in ("none-s0",):
        got = stable(read_jsonl(tmp_path / "cmp" / name / "metrics.jsonl"))
        assert [r["step"] for r in got] == [0, 1, 2, 3]
        assert got == stable(read_jsonl(tmp_path / "clean" / name / "metrics.jsonl"))


# ----------------------------------------------------------------------------- 3. a full disk inside torch.save


class FullDisk:
    """A binary file on a disk that fills up after ``room`` bytes: write() raises ENOSPC, as the kernel does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        n = len(memoryview(data))
        if n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("full_at", [2, 4])
def test_a_full_disk_inside_torch_save_is_one_line_and_the_run_resumes(micro_model, tmp_path, reference, capsys,
                                                                        monkeypatch, full_at):
    real_open = open

    def open_on_a_full_disk(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        if Path(path).name == "optim.pt" and f"step_{full_at:06d}" in Path(path).parent.name:
            return FullDisk(f, room=4096)
        return f

    monkeypatch.setattr(checkpoints, "open", open_on_a_full_disk, raising=False)
    with pytest.raises(RuntimeError, match="inline_container"), open(tmp_path / "probe.pt", "wb") as raw:
        torch.save({"w": torch.zeros(10_000)}, FullDisk(raw, room=4096))  # what torch.save itself raises
    out = tmp_path / "run"
    sets = micro_overrides(micro_model, **SETS, **{"train.threads": 1})
    assert main(["train", "--out", str(out), *set_args(sets)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "disk is full" in err[0], err
    assert "optim.pt" in err[0] and "internal error" not in err[0]
    assert read_jsonl(out / "metrics.jsonl")[-1]["step"] == full_at
    monkeypatch.undo()  # space freed
    assert main(["train", "--resume", str(out), *again(out)]) == 0
    assert stable(read_jsonl(out / "metrics.jsonl")) == reference[1]


def test_a_full_disk_in_the_final_export_is_one_line_and_the_resume_finishes(micro_model, tmp_path, capsys,
                                                                             monkeypatch):
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def full(self, folder, *a, **kw):  # what safetensors raises on a full disk (os error 28 is ENOSPC)
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "run"
    sets = micro_overrides(micro_model, **{**SETS, "train.max_steps": 2})
    assert main(["train", "--out", str(out), *set_args(sets)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"erft train: error: '{out / 'final'}': No space left on device; the disk is full; free some "
                   "space or choose another disk"], err
    assert not list(out.glob(".final_*")) and not (out / "final").exists()
    rows = (out / "metrics.jsonl").read_text()
    monkeypatch.undo()
    assert main(["train", "--resume", str(out), *again(out)]) == 0
    assert (out / "final" / "model.safetensors").stat().st_size > 1000
    assert (out / "metrics.jsonl").read_text() == rows
    assert json.loads((out / "run.json").read_text())["status"] == "finished"


def test_an_atomic_write_on_a_full_disk_names_its_file_and_leaves_no_temp(tmp_path, monkeypatch):
    """A buffered file on a full disk fails its flush, and its close again: the error names the file once."""
    from entropy_rft.rundir import files as rundir

    class Full:
        def write(self, data):
            return len(data)

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        close = flush

        def fileno(self):
            return -1

    real_fdopen = os.fdopen

    def fdopen(fd, *a, **kw):
        real_fdopen(fd, *a, **kw).close()
        return Full()

    monkeypatch.setattr(rundir.os, "fdopen", fdopen)
    with pytest.raises(OSError) as e:
        rundir.atomic_write_json(tmp_path / "run.json", {"a": 1})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "run.json")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 4. nothing executes


class Payload:
    """What a tampered checkpoint file holds: unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tamper(ckpt: Path, name: str, marker: Path) -> None:
    """Replace ``name`` by a pickled payload and update the manifest, as someone who shares the run could."""
    torch.save({"state": Payload(marker)}, ckpt / name)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoints.verify_checkpoint(ckpt) is None  # the manifest catches damage, not tampering


@pytest.mark.parametrize("name", ["rng.pt", "model.pt"])
def test_a_tampered_checkpoint_executes_nothing_and_is_refused_in_one_line(micro_model, tmp_path, capsys, name):
    out = tmp_path / "run"
    start(load_config(None, micro_overrides(micro_model, **{**SETS, "train.max_steps": 4})), out)
    marker = tmp_path / "pwned"
    tamper(out / "checkpoints" / "step_000004", name, marker)
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "6"]) == 2  # before: exit 0, and the marker
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("erft train: error: checkpoint "), err
    assert f"step_000004: {name} would run code to load (posix.system)" in err[0] and "refused" in err[0]
    assert (out / "metrics.jsonl").read_text() == before

    assert main(["eval", "--run", str(out), "--dataset", "micro:DigitTask", "--checkpoints", "--samples", "2",
                 "--limit", "2", "--max-new-tokens", "2", "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{name} would run code to load" in err[0], err
    assert not marker.exists()


def test_every_checkpoint_file_loads_with_weights_only(micro_model, tmp_path):
    """The native engine's checkpoints (GRPO with the autopilot's state, PPO with a critic): each .pt loads
    with torch.load(weights_only=True), which runs no code, and needs no global beyond torch's own."""
    for name, extra in (("auto", {"method.name": "clip_higher", "method.entropy_target": "0.5"}),
                        ("ppo", {"algo.algorithm": "ppo"})):
        out = tmp_path / name
        start(load_config(None, micro_overrides(micro_model, **{**SETS, "train.max_steps": 2, **extra})), out)
        (ck,) = checkpoints.checkpoint_dirs(out)
        files = sorted(p.name for p in ck.glob("*.pt"))
        want = ["model.pt", "optim.pt", "rng.pt", "sched.pt", "trainer.pt"]
        assert files == sorted(want + (["value_head.pt", "value_optim.pt"] if name == "ppo" else []))
        for p in ck.glob("*.pt"):
            assert torch.serialization.get_unsafe_globals_in_checkpoint(p) == [], p.name
            torch.load(p, weights_only=True)
        trainer = torch.load(ck / "trainer.pt", weights_only=True)
        assert trainer["step"] == 2
        if name == "auto":
            assert set(trainer["autopilot"]) == {"integral", "u", "smoothed", "base"}


def test_an_old_format_checkpoint_is_refused_not_unpickled(micro_model, tmp_path, capsys):
    """A checkpoint of an erft before this format (numpy's RNG state pickled as an ndarray) is refused with
    the fix, never loaded with weights_only=False."""
    import numpy as np

    out = tmp_path / "run"
    start(load_config(None, micro_overrides(micro_model, **{**SETS, "train.max_steps": 2})), out)
    ck = out / "checkpoints" / "step_000002"
    rng = torch.load(ck / "rng.pt", weights_only=True)
    rng["numpy"] = np.random.get_state()  # how rng.pt looked before
    torch.save(rng, ck / "rng.pt")
    tamper_manifest = json.loads((ck / "manifest.json").read_text())
    data = (ck / "rng.pt").read_bytes()
    tamper_manifest["files"]["rng.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "manifest.json").write_text(json.dumps(tamper_manifest))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "4"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "rng.pt would run code to load (numpy." in line and "--overwrite" in line
    shutil.rmtree(out)


# ----------------------------------------------------------------------------- 2. the TRL engine's checkpoints


@pytest.mark.parametrize("cut", ["no trainer_state.json", "trainer_state.json cut short", "no erft_state.pt"])
def test_trl_resume_skips_an_incomplete_checkpoint(micro_model, tmp_path, capsys, cut):
    """transformers writes trl/checkpoint-N in place, trainer_state.json last: a run killed while writing it
    leaves a folder without one (or with half of it). Resume names it, removes it and goes on from the
    previous complete checkpoint with the uninterrupted run's metrics."""
    from entropy_rft.launch import run as launch

    sets = micro_overrides(micro_model, **{"eval.every": 0, "train.tensorboard": "false", "train.max_steps": 3,
                                           "train.checkpoint_every": 1, "train.keep_checkpoints": 3})
    out = tmp_path / "run"
    launch.start(load_config(None, sets, extra={"engine": "trl"}), out)
    reference = stable(read_jsonl(out / "metrics.jsonl"))
    assert [r["step"] for r in reference] == [1, 2, 3]
    ckpts = sorted((out / "trl").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(ckpts) == 3
    newest = ckpts[-1]
    if cut == "no trainer_state.json":
        (newest / "trainer_state.json").unlink()
    elif cut == "trainer_state.json cut short":
        text = (newest / "trainer_state.json").read_text()
        (newest / "trainer_state.json").write_text(text[: len(text) // 2])
    else:
        (newest / "erft_state.pt").unlink()
    assert checkpoints.trl_checkpoint_gap(newest) is not None and checkpoints.trl_checkpoint_gap(ckpts[-2]) is None
    shutil.rmtree(out / "final")  # the run was killed: no final policy, status running
    (out / "run.json").write_text(json.dumps({"schema": "erft.run/1", "status": "running", "max_steps": 3}))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), *again(out)]) == 0
    err = capsys.readouterr().err
    assert f"{newest} is incomplete" in err and f"resuming from {ckpts[-2].name}" in err, err
    assert stable(read_jsonl(out / "metrics.jsonl")) == reference
    assert checkpoints.trl_checkpoint_gap(newest) is None  # written again, whole


# ----------------------------------------------------------------------------- beyond: dataset files


def test_dataset_files_in_real_encodings_read_every_row(tmp_path):
    """A UTF-8 BOM (Windows editors), UTF-16 with its BOM, CRLF line ends, and U+2028 inside a JSON string
    (json.dumps(ensure_ascii=False) writes it raw) all give the rows of the plain UTF-8 file; Latin-1 is
    refused in one line naming the byte and the fix. Before: the BOM's row was dropped as bad, UTF-16 and
    Latin-1 were internal errors, a BOM'd .json was "not valid JSON", U+2028 split its row in two."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.tasks import build_task

    rows = [{"prompt": f"What is {a}+{a}?\u2028Think.", "answer": str(2 * a)} for a in range(1, 13)]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    files = {"plain.jsonl": text.encode(), "bom.jsonl": b"\xef\xbb\xbf" + text.encode(),
             "crlf.jsonl": text.replace("\n", "\r\n").encode(), "utf16.jsonl": text.encode("utf-16"),
             "bom.json": b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False).encode()}
    got = {}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        got[name] = build_task("math", source=str(tmp_path / name), val_size=2).pairs
    assert len(got["plain.jsonl"]) == 12 and got["plain.jsonl"][0][0].startswith("What is ")
    assert sorted(p[:2] for p in got["plain.jsonl"]) == sorted((r["prompt"], r["answer"]) for r in rows)
    for name in files:
        assert got[name] == got["plain.jsonl"], name
    (tmp_path / "latin1.jsonl").write_bytes(text.replace("\u2028", "").replace("What", "Wh\u00e4t").encode("latin-1"))
    with pytest.raises(UserError) as e:
        build_task("math", source=str(tmp_path / "latin1.jsonl"), val_size=2)
    msg = str(e.value)
    assert "latin1.jsonl' is not UTF-8 text (byte 0xe4 at offset 14)" in msg  # 14 = len('{"prompt": "Wh')
    assert "iconv" in msg and "\n" not in msg


# ----------------------------------------------------------------------------- beyond: readers racing a live run


def test_eval_checkpoints_skips_one_a_live_run_pruned_meanwhile(micro_model, tmp_path, capsys, monkeypatch):
    """`erft eval --run R --checkpoints` lists R's checkpoints, then loads them one by one; a live run that
    prunes one in between (its keep_checkpoints) costs that one, named in a warning, not the whole eval."""
    out = tmp_path / "run"
    start(load_config(None, micro_overrides(micro_model, **{**SETS, "train.max_steps": 4})), out)
    real = checkpoints.load_checkpoint

    def pruned_first(path, *a, **kw):
        if Path(path).name == "step_000002":
            shutil.rmtree(path)  # what save_checkpoint's pruning does
        return real(path, *a, **kw)

    monkeypatch.setattr(checkpoints, "load_checkpoint", pruned_first)
    capsys.readouterr()
    assert main(["eval", "--run", str(out), "--dataset", "micro:DigitTask", "--checkpoints", "--samples", "2",
                 "--limit", "2", "--max-new-tokens", "2", "--out", str(tmp_path / "ev")]) == 0
    err = capsys.readouterr().err
    assert f"{out / 'checkpoints' / 'step_000002'} was removed while erft eval ran" in err, err
    got = [r["model"] for r in json.loads((tmp_path / "ev" / "eval.json").read_text())["results"]]
    assert got == ["run/step_000004", "run/final"]


# ----------------------------------------------------------------------------- beyond: paths an encoder rejects


def test_a_path_that_is_not_utf8_is_refused_before_the_work(micro_model, tmp_path, capsys):
    """Linux takes any bytes in a name; the tokenizer's writer and safetensors take only UTF-8. Before: the
    run trained every step, then died in the final export with an internal UnicodeEncodeError."""
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff")
    sets = set_args(micro_overrides(micro_model, **{**SETS, "train.max_steps": 1}))
    for argv in (["train", "--out", out, *sets],
                 ["eval", "--model", str(micro_model), "--dataset", "micro:DigitTask", "--out", out]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"erft {argv[0]}: error: --out '{tmp_path}/run\\xff': the path is not UTF-8 (byte 0xff), "
                       "which the tokenizer and safetensors cannot write to; choose a name in UTF-8"], err
        assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- beyond: library threads


def test_tensorboards_writer_thread_dying_is_one_warning_not_a_traceback(micro_model, tmp_path, capsys,
                                                                         monkeypatch):
    """TensorBoard writes events from its own thread; on a full disk that thread dies and Python printed its
    traceback ahead of erft's lines. Now: one warning line per thread, the tracker is dropped, the run goes
    on with every metrics row."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device", "events.out.tfevents")

    monkeypatch.setattr(RecordWriter, "write", full)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)  # Python's, not pytest's
    out = tmp_path / "run"
    sets = micro_overrides(micro_model, **{**SETS, "train.max_steps": 2, "train.tensorboard": True})
    assert main(["train", "--out", str(out), *set_args(sets)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and all(line.startswith("erft: warning: ") for line in err), err
    assert any("a background thread" in line and "No space left on device" in line for line in err), err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]


# ----------------------------------------------------------------------------- beyond: caches damaged in place


def test_weights_damaged_in_place_are_refused_before_the_work(micro_model, tmp_path, capsys):
    """Bytes of a cached policy that change after it was written (the tail of model.safetensors: the last
    tensor's data) still load; the first sample then failed as an internal error ("probability tensor
    contains either inf, nan"). Now one line names the tensor and the fix, and nothing is written."""
    from entropy_rft.models.loading import INFO_FILE

    policy = tmp_path / "policy"
    shutil.copytree(micro_model, policy)
    data = bytearray((policy / "model.safetensors").read_bytes())
    data[-64:] = b"\xff" * 64  # float32 0xffffffff is NaN
    (policy / "model.safetensors").write_bytes(bytes(data))
    out = tmp_path / "run"
    sets = set_args(micro_overrides(policy, **{**SETS, "train.max_steps": 1}))
    for cached, fix in ((False, "re-save or re-download the model"), (True, f"delete {policy} and it is built again")):
        if cached:
            (policy / INFO_FILE).write_text("{}")  # a finished build of the cache
        assert main(["train", "--out", str(out), *sets]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"erft train: error: --model '{policy}': weight ") and "holds NaN or inf" in line
        assert line.endswith(fix) and not out.exists()
