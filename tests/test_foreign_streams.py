"""Issue 48, class 3: a foreign log is read as a stream, with bounds.

Files as a hostile (or unlucky) sender would give them: a log that is a link to ``/dev/zero``, a FIFO, a dataset
``source`` that is a device, a CSV with a cell over Python's field limit, JSON lines nested 100k deep in every
JSON reader, a verl console log whose last line is still being written, a TRL output dir whose newest checkpoint
was cut short, and a console log with a line far over the length bound. Each ends in one line (within seconds,
under a memory cap) or in a result that leaves the damage out and says so.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys

import pytest

from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError

DEEP = "[" * 100_000 + "]" * 100_000


def erft(capsys, *argv) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, [line for line in cap.err.splitlines() if line.strip()]


def capped(gb: float = 1.5):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (int(gb * (1 << 30)),) * 2)
    return limit


def erft_capped(*argv, timeout: float = 60) -> subprocess.CompletedProcess:
    """``erft ARGV`` in a fresh process under a 1.5 GB address-space cap and a timeout."""
    return subprocess.run([sys.executable, "-m", "entropy_rft.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=capped())


def h_of(s: int) -> float:
    return 1.2 - 0.05 * s


def r_of(h: float) -> float:
    return 0.9 - 0.1 * math.exp(h)


def console_lines(steps: int) -> list[str]:
    return [f"step:{s} - actor/entropy:{h_of(s):.6f} - val-core/d/acc/mean@1:{r_of(h_of(s)):.6f}"
            for s in range(1, steps + 1)]


@pytest.mark.parametrize("command", ["fit-law", "report"])
def test_link_to_dev_zero_is_one_line_in_seconds_under_a_memory_cap(tmp_path, command):
    link = tmp_path / "verl.log"
    link.symlink_to("/dev/zero")
    extra = ["--out", tmp_path / "rep"] if command == "report" else []
    p = erft_capped(command, link, *extra)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert "not a regular file" in err[0] and "verl.log" in err[0]


@pytest.mark.parametrize("source", [None, "verl-console", "table"])
def test_fifo_is_one_line_in_seconds(tmp_path, source):
    fifo = tmp_path / "live.log"
    os.mkfifo(fifo)
    p = erft_capped("fit-law", fifo, *(["--source", source] if source else []), timeout=30)
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert "not a regular file" in err[0] and "FIFO" in err[0]


def test_dataset_source_that_is_a_device_says_so(tmp_path):
    from entropy_rft.training import preflight

    with pytest.raises(UserError, match="not a regular file") as e:
        preflight.build_task("math", {"source": "/dev/zero"}, flag="--dataset", params_flag="--task-param")
    assert "not found" not in str(e.value)


def test_csv_cell_over_the_field_limit_is_read(tmp_path, capsys):
    table = tmp_path / "export.csv"
    rows = ["step,actor/entropy,val-core/d/acc/mean@1,notes"]
    rows += [f"{s},{h_of(s):.6f},{r_of(h_of(s)):.6f},{'x' * 200_000 if s == 3 else ''}" for s in range(1, 13)]
    table.write_text("\n".join(rows) + "\n")
    rc, out, err = erft(capsys, "fit-law", table)
    assert rc == 0, err
    assert "over 12 evaluations" in out


def test_json_nested_100k_deep_is_a_damaged_line_in_every_reader(tmp_path, capsys):
    from entropy_rft.analysis.engine_logs import read_engine_log

    verl = tmp_path / "verl.jsonl"
    good = [json.dumps({"step": s, "data": {"actor/entropy": h_of(s)}}) for s in (1, 2)]
    verl.write_text("\n".join([good[0], DEEP, good[1]]) + "\n")
    log = read_engine_log(verl, "verl-file")
    assert sorted(log.rows) == [1, 2] and log.skipped == 1

    table = tmp_path / "export.jsonl"
    table.write_text("\n".join([json.dumps({"step": 1, "x": 1.0}), DEEP]) + "\n")
    log = read_engine_log(table, "table")
    assert sorted(log.rows) == [1] and log.skipped == 1

    trl = tmp_path / "trl"
    trl.mkdir()
    (trl / "trainer_state.json").write_text('{"log_history": ' + DEEP + "}")
    rc, out, err = erft(capsys, "fit-law", trl)
    assert rc == 2 and len(err) == 1 and "trainer_state.json" in err[0], err

    from entropy_rft.tasks.rows import load_rows

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n" + DEEP + "\n")
    rows = load_rows(str(data))
    assert len(rows) == 2 and rows[0] == {"question": "1+1", "answer": "2"} and type(rows[1]).__name__ == "_BadJson"


def test_unfinished_last_line_of_a_console_log_is_left_out_and_counted(tmp_path, capsys):
    from entropy_rft.analysis.byo import fit_engine_log

    lines = console_lines(12)
    cut = lines[-1][: lines[-1].rindex(":") + 4]  # the writer stopped inside the last value: "0.6" of "0.633..."
    log = tmp_path / "verl.log"
    log.write_text("\n".join(lines[:-1]) + "\n" + cut)
    res = fit_engine_log(log)
    assert res["fit"]["n"] == 11 and res["unfinished"] == 1
    assert "unfinished last line" in res["note"]
    assert res["points"]["step"][-1] == 11


def test_damaged_newest_trl_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    out = tmp_path / "trl_out"
    for step, n in ((6, 6), (12, 12)):
        ck = out / f"checkpoint-{step}"
        ck.mkdir(parents=True)
        history = [{"step": s, "entropy": h_of(s), "eval_reward": r_of(h_of(s))} for s in range(1, n + 1)]
        (ck / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))
    newest = out / "checkpoint-12" / "trainer_state.json"
    newest.write_text(newest.read_text()[:100])  # cut short by a kill mid-write
    rc, text, err = erft(capsys, "fit-law", out)
    assert rc == 0, err
    assert "over 6 evaluations" in text
    assert len(err) == 1 and "checkpoint-12" in err[0] and "checkpoint-6" in err[0], err


def test_a_line_over_the_bound_is_skipped_without_being_held(tmp_path):
    from entropy_rft.common.streams import LineCounts, lines

    path = tmp_path / "verl.log"
    body = console_lines(12)
    with open(path, "w") as f:
        f.write("\n".join(body[:6]) + "\n" + "y" * (3 << 20) + "\n" + "\n".join(body[6:]) + "\n")
    counts = LineCounts()
    with open(path, "rb") as f:
        got = [line.decode() for line in lines(f, counts, max_line=1 << 20)]
    assert got == body and counts.too_long == 1 and counts.unfinished == 0


# ----------------------------------------------------------------------------- 4. what the law cannot fit


@pytest.mark.parametrize("scale", [1000.0, 720.0])
def test_law_refuses_a_summed_entropy_naming_the_key(tmp_path, capsys, scale):
    """An entropy summed over ~1000 tokens (the issue's ~1000 nats: LinAlgError before) and one just past the
    bound (exp(H) near float64's overflow): one line naming the key and the likely mistake."""
    log = tmp_path / "verl.log"
    rows = [f"step:{s} - actor/entropy_sum:{scale + h_of(s):.6f} - val-core/d/acc/mean@1:{r_of(h_of(s)):.6f}"
            for s in range(1, 13)]
    log.write_text("\n".join(rows) + "\n")
    rc, out, err = erft(capsys, "fit-law", log, "--entropy-key", "actor/entropy_sum")
    assert rc == 2 and len(err) == 1, err
    assert "actor/entropy_sum" in err[0] and "summed" in err[0] and "overflows" in err[0]
