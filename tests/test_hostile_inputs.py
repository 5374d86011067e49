"""Issue 37: nothing written outside the run, nothing a file can blow up, no internal error on a user's main path.

One test (or a few) per class of the issue, through the real CLI: a lock linked out of the run, a local math file
without ``val_size``, a YAML alias bomb, a batch no machine holds, a metrics line nested 100k levels deep, and a
signal to ``erft compare --jobs 2``; then the smaller ones (SIGHUP, modes under the umask, duplicated step rows,
a file of NULs, a folder given as a dataset file). Each ends in one line naming the file or field and the fix, or in
a run that works; nothing is written outside the run and no process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from entropy_rft.cli.main import main
from micro import again, make_micro_policy, micro_overrides

TESTS = Path(__file__).parent


def set_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def erft(capsys, *argv: str) -> tuple[int, list[str]]:
    """``erft ARGV`` in this process: (exit status, stderr's non-empty lines)."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.strip()]


def cli_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("ERFT_FAULT", None)
    return env


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


def micro_sets(model: Path, **extra) -> list[str]:
    return set_args(micro_overrides(model, **{"train.max_steps": 2, "train.tensorboard": False, **extra}))


@pytest.fixture(scope="module")
def micro_run(micro_model, tmp_path_factory) -> Path:
    """A finished 2-step micro run (checkpoints at steps 2), trained once for the module."""
    out = tmp_path_factory.mktemp("runs") / "run"
    assert main(["train", *micro_sets(micro_model), "--out", str(out)]) == 0
    return out


def copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


# ----------------------------------------------------------------------------- 1. links out of the run


def test_lock_linked_out_of_the_run_is_refused_and_the_outside_file_kept(micro_run, tmp_path, capsys):
    d = copy_run(micro_run, tmp_path / "run")
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    (d / ".erft.lock").unlink()
    (d / ".erft.lock").symlink_to(outside)
    rc, err = erft(capsys, "train", "--resume", d, *again(d), "--max-steps", "3")
    assert rc == 2, err
    assert outside.read_text() == "keep me\n"
    assert len(err) == 1 and ".erft.lock" in err[0] and "link" in err[0], err


def test_lock_linked_out_of_a_new_run_folder_is_refused(micro_model, tmp_path, capsys):
    d = tmp_path / "new"
    d.mkdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    (d / ".erft.lock").symlink_to(outside)
    rc, err = erft(capsys, "train", *micro_sets(micro_model), "--out", d)
    assert rc == 2, err
    assert outside.read_text() == "keep me\n"
    assert len(err) == 1 and ".erft.lock" in err[0], err
    assert sorted(p.name for p in d.iterdir()) == [".erft.lock"]


def test_damaged_lines_file_linked_out_of_the_run_is_refused(micro_run, tmp_path, capsys):
    d = copy_run(micro_run, tmp_path / "run")
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    with open(d / "metrics.jsonl", "a") as f:
        f.write("not json\n" + json.dumps({"step": 1}) + "\n")  # a damaged line that a resume sets aside
    (d / "metrics.jsonl.damaged").symlink_to(outside)
    rc, err = erft(capsys, "train", "--resume", d, *again(d), "--max-steps", "3")
    assert rc == 2, err
    assert outside.read_text() == "keep me\n"
    assert "metrics.jsonl.damaged" in err[-1] and "link" in err[-1], err


def test_checkpoints_folder_on_another_disk_is_followed(micro_run, tmp_path, capsys):
    """A link from checkpoints/ to a folder elsewhere (another disk) is meant: a resume writes through it."""
    d = copy_run(micro_run, tmp_path / "run")
    elsewhere = tmp_path / "big-disk" / "ckpts"
    elsewhere.parent.mkdir()
    shutil.move(d / "checkpoints", elsewhere)
    (d / "checkpoints").symlink_to(elsewhere)
    rc, err = erft(capsys, "train", "--resume", d, *again(d), "--max-steps", "3")
    assert rc == 0, err
    assert (elsewhere / "step_000003").is_dir()
    assert (d / "checkpoints").is_symlink()


# ----------------------------------------------------------------------------- 2. a local math file


def math_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


MATH_PARAMS = ("--task", "math", "--set", "task.params.prompt_format=plain",
               "--set", "task.params.template=Q{question}A")


def test_math_local_file_without_val_size_trains_on_a_default_split(micro_model, tmp_path, capsys):
    src = math_file(tmp_path / "mine.jsonl", 20)
    out = tmp_path / "run"
    sets = [s for s in micro_overrides(micro_model, **{"train.max_steps": 1, "train.tensorboard": False,
                                                         "eval.prompts": 2, "eval.samples": 2})
            if not s.startswith("task.")]
    rc, err = erft(capsys, "train", *set_args(sets), *MATH_PARAMS, "--set", f"task.params.source={src}",
                   "--out", out)
    assert rc == 0, err
    assert any("val_size" in line for line in err), err  # the split is said
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/pass@1" in rows[0]


def test_task_with_an_empty_validation_split_is_refused_before_anything_is_written(micro_model, tmp_path, capsys):
    src = math_file(tmp_path / "mine.jsonl", 20)
    out = tmp_path / "run"
    sets = [s for s in micro_overrides(micro_model) if not s.startswith("task.")]
    rc, err = erft(capsys, "train", *set_args(sets), *MATH_PARAMS, "--set", f"task.params.source={src}",
                   "--set", "task.params.val_size=0", "--out", out)
    assert rc == 2, err
    assert len(err) == 1 and "val_size" in err[0] and "eval.every" in err[0], err
    assert not out.exists()


def test_eval_on_a_local_file_evaluates_all_of_it(micro_model, tmp_path, capsys):
    src = math_file(tmp_path / "aime.jsonl", 5)
    out = tmp_path / "eval"
    rc, err = erft(capsys, "eval", "--model", micro_model, "--dataset", "math", "--task-param", f"source={src}",
                   "--task-param", "prompt_format=plain", "--task-param", "template=Q{question}A",
                   "--samples", "1", "--max-new-tokens", "4", "--out", out)
    assert rc == 0, err
    result = json.loads((out / "eval.json").read_text())
    assert [r["questions"] for r in result["results"]] == [5]


# ----------------------------------------------------------------------------- 3. YAML alias bombs


def alias_bomb(path: Path, levels: int) -> Path:
    """``levels`` levels of 9 aliases each, all under the known section ``trl`` (a mapping of any keys)."""
    lines = ["trl:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_yaml_alias_bomb_is_refused_naming_the_file(tmp_path, capsys):
    bomb = alias_bomb(tmp_path / "bomb.yaml", 6)
    rc, err = erft(capsys, "train", "--config", bomb, "--out", tmp_path / "run")
    assert rc == 2, err
    assert len(err) == 1 and "bomb.yaml" in err[0] and "alias" in err[0], err
    assert not (tmp_path / "run").exists()


def test_yaml_alias_bomb_of_the_issue_is_refused_fast_under_a_memory_limit(tmp_path):
    """The issue's bomb (9 levels x 9 aliases) in a fresh process limited to 3 GB: one line naming the file."""
    bomb = alias_bomb(tmp_path / "bomb.yaml", 9)

    p = subprocess.run([sys.executable, "-m", "entropy_rft.cli", "train", "--config", str(bomb), "--out",
                        str(tmp_path / "run")], env=cli_env(), capture_output=True, text=True, timeout=120,
                       preexec_fn=limited(3))
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr
    assert len(err) == 1 and "bomb.yaml" in err[0] and "alias" in err[0], err


def test_yaml_config_over_the_size_limit_is_refused_naming_the_file(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("train:\n  seed: 0\n" + "# padding\n" * 300_000)
    rc, err = erft(capsys, "train", "--config", big, "--out", tmp_path / "run")
    assert rc == 2, err
    assert len(err) == 1 and "big.yaml" in err[0] and "MB" in err[0], err


# ----------------------------------------------------------------------------- 4. batches no machine holds


def limited(gb: int = 4):
    """A ``preexec_fn`` limiting the child's address space to ``gb`` GB (a batch that is not refused must not take
    the machine)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (gb << 30, gb << 30))
    return limit


@pytest.mark.parametrize("field", ["rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens",
                                   "eval.samples"])
def test_batch_no_machine_holds_is_refused_naming_the_field(micro_model, tmp_path, field):
    out = tmp_path / "run"
    sets = [f"{field}=1000000000000"] + (["eval.batch_size=1000000000000"] if field.startswith("eval.") else [])
    p = subprocess.run([sys.executable, "-m", "entropy_rft.cli", "train", *micro_sets(micro_model), *set_args(sets),
                        "--out", str(out)], env=cli_env(), capture_output=True, text=True, timeout=300,
                       preexec_fn=limited())
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr
    assert len(err) == 1 and field in err[0] and "memory" in err[0], err
    assert not out.exists()


# ----------------------------------------------------------------------------- 5. lines a reader must survive

DEEP = "[" * 100_000 + "]" * 100_000


def with_deep_line(run: Path, to: Path) -> Path:
    d = copy_run(run, to)
    lines = (d / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(1, DEEP + "\n")
    (d / "metrics.jsonl").write_text("".join(lines))
    return d


@pytest.mark.parametrize("command", ["report", "fit-law", "resume"])
def test_metrics_line_nested_100k_deep_is_set_aside(micro_run, tmp_path, capsys, command):
    d = with_deep_line(micro_run, tmp_path / "run")
    argv = {"report": ["report", d, "--out", tmp_path / "report"], "fit-law": ["fit-law", d],
            "resume": ["train", "--resume", d, *again(d), "--max-steps", "3"]}[command]
    rc, err = erft(capsys, *argv)
    assert not any("internal error" in line for line in err), err
    assert any("metrics.jsonl:2" in line for line in err), err
    if command != "fit-law":  # fit-law may refuse two points as too few for a fit: in one line, exit 2
        assert rc == 0, err
    else:
        assert rc in (0, 2) and len([e for e in err if "error" in e]) <= 1, err


def test_duplicated_and_swapped_step_rows_are_reported(tmp_path, capsys):
    from entropy_rft.rundir.files import forget_warnings, read_step_log

    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in (0, 1, 3, 2, 3)))
    forget_warnings()
    capsys.readouterr()
    read_step_log(p)
    err = capsys.readouterr().err
    assert "step 3" in err and "twice" in err, err
    assert "out of order" in err and ":4" in err, err


def test_metrics_file_of_nuls_is_damaged_not_empty(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("train:\n  seed: 0\n")
    (d / "metrics.jsonl").write_bytes(b"\0" * 4096)
    rc, err = erft(capsys, "report", d, "--out", tmp_path / "report")
    assert rc == 2, err
    assert len(err) == 1 and "metrics.jsonl" in err[0] and "empty" not in err[0], err


def test_folder_given_as_a_dataset_file_is_called_a_folder(tmp_path, capsys):
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    rc, err = erft(capsys, "train", "--task", "math", "--set", f"task.params.source={folder}", "--out",
                   tmp_path / "run")
    assert rc == 2, err
    assert len(err) == 1 and "folder" in err[0] and "not found" not in err[0], err


# ----------------------------------------------------------------------------- 7. the user's umask


def test_run_files_follow_the_umask(micro_run, tmp_path, capsys):
    d = copy_run(micro_run, tmp_path / "run")
    old = os.umask(0o022)
    try:
        rc, err = erft(capsys, "train", "--resume", d, *again(d), "--max-steps", "3")
    finally:
        os.umask(old)
    assert rc == 0, err
    for name in ("config.yaml", "run.json", "metrics.jsonl", "samples.jsonl"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o644, name
    for name in ("final", "checkpoints/step_000003"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o755, name


# ----------------------------------------------------------------------------- 6. signals


def descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(p.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, pp in parents.items() if pp == parent]
        out.update(kids)
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_rows(runs: list[Path], proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until each run's metrics.jsonl holds a training step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if all((r / "metrics.jsonl").is_file() and '"step": 1' in (r / "metrics.jsonl").read_text() for r in runs):
            return
        time.sleep(0.2)
    raise AssertionError("the runs logged no step in time")


def test_compare_on_sigterm_stops_its_workers_and_writes_the_summary(micro_model, tmp_path):
    out = tmp_path / "cmp"
    sets = micro_overrides(micro_model, **{"train.max_steps": 400, "train.tensorboard": False, "eval.every": 0,
                                           "train.checkpoint_every": 1000})
    proc = subprocess.Popen([sys.executable, "-m", "entropy_rft.cli", "compare", "--methods", "none,clip_b",
                             "--jobs", "2", *set_args(sets), "--out", str(out)], env=cli_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    runs = [out / "none-s0", out / "clip_b-s0"]
    kids: set[int] = set()
    try:
        wait_for_rows(runs, proc)
        kids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        for pid in [proc.pid, *kids] if proc.poll() is None else []:  # a failure here leaves nothing running
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr
    assert "SIGTERM" in stderr and "erft compare" in stderr, stderr
    assert (out / "summary.md").is_file(), stdout + stderr
    for r in runs:
        info = json.loads((r / "run.json").read_text())
        assert info["status"] == "stopped", info
        assert (r / "checkpoints" / f"step_{info['step']:06d}").is_dir(), info
    time.sleep(0.5)
    assert kids and not [k for k in kids if alive(k)], kids


def test_train_on_sighup_saves_a_checkpoint_and_says_stopped(micro_model, tmp_path):
    out = tmp_path / "run"
    sets = micro_overrides(micro_model, **{"train.max_steps": 400, "train.tensorboard": False, "eval.every": 0,
                                           "train.checkpoint_every": 1000})
    proc = subprocess.Popen([sys.executable, "-m", "entropy_rft.cli", "train", *set_args(sets), "--out", str(out)],
                            env=cli_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_rows([out], proc)
        proc.send_signal(signal.SIGHUP)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGHUP, stderr
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "stopped", info
    assert (out / "checkpoints" / f"step_{info['step']:06d}").is_dir(), info
