"""``erft fit-law`` on a large verl console log (issue 48): peak RSS and time, as ratios against ``wc -l`` of the
same file, side by side in one run.

The log is generated under ``/tmp`` (``--gb`` GB, default 2): ``--step-mb`` MB of ``step:N - key:value`` lines
(default 2, about 10,000 steps with an entropy and a validation score) spread evenly among Ray worker lines of the
kind a verl console prints, and deleted at the end (also on Ctrl-C). Then ``wc -l FILE`` and ``erft fit-law FILE``
run in turn, ``--rounds`` times each (wc, erft, erft, wc, ...), every one a fresh process whose peak RSS is its
own (``os.wait4``'s ``ru_maxrss``). Printed: the median wall time and the peak RSS of each, the ratios, and the
issue's target (fit-law's peak under 300 MB) as PASS/MISS. The page cache is warm after the file is written, for
both commands alike.

Usage: ``.venv/bin/python -m benchmarks.cpu.foreign_log [--gb 2] [--step-mb 2] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGET_RSS_MB = 300
FILLER = ("(WorkerDict pid=2471, ip=10.0.0.7) INFO 11-27 10:41:07 [gpu_model_runner.py:1904] Graph capturing "
          "finished in 5 secs, took 0.31 GiB\n")


def step_line(step: int) -> str:
    h = 1.4 * math.exp(-step / 4000) + 0.05
    r = 0.9 - 0.1 * math.exp(h)
    return (f"(TaskRunner pid=2210) step:{step} - actor/entropy:np.float64({h:.6f}) - actor/pg_loss:0.0123 - "
            f"critic/score/mean:{r:.6f} - val-core/gsm8k/acc/mean@1:{r:.6f}\n")


def write_log(path: Path, gb: float, step_mb: float) -> tuple[int, int]:
    """Write the log: (bytes, step lines)."""
    steps = max(2, int(step_mb * 1e6 / len(step_line(1))))
    total = int(gb * (1 << 30))
    filler_per_step = max(0, (total - steps * len(step_line(1))) // (steps * len(FILLER)))
    block = FILLER * filler_per_step
    written = 0
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            f.write(block)
            line = step_line(s)
            f.write(line)
            written += len(block) + len(line)
    return written, steps


def run(argv: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit status) of one fresh process."""
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
    t0 = time.perf_counter()
    pid = os.posix_spawnp(argv[0], argv, os.environ, file_actions=quiet)  # no fork: the child's RSS is its own
    _, status, usage = os.wait4(pid, 0)
    return time.perf_counter() - t0, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def main(args: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="size of the generated log (GB)")
    p.add_argument("--step-mb", type=float, default=2.0, help="MB of step lines in it")
    p.add_argument("--rounds", type=int, default=2, help="runs of each command")
    a = p.parse_args(args)
    erft = str(Path(sys.executable).with_name("erft"))
    fd, name = tempfile.mkstemp(prefix="erft-foreign-", suffix=".log", dir="/tmp")
    os.close(fd)
    path = Path(name)
    try:
        size, steps = write_log(path, a.gb, a.step_mb)
        print(f"log: {path}, {size / (1 << 30):.2f} GiB, {steps} step lines")
        res: dict[str, list[tuple[float, float, int]]] = {"wc": [], "erft": []}
        for i in range(a.rounds):
            order = ("wc", "erft") if i % 2 == 0 else ("erft", "wc")
            for who in order:
                cmd = ["wc", "-l", str(path)] if who == "wc" else [erft, "fit-law", str(path)]
                res[who].append(run(cmd))
        for who, rows in res.items():
            bad = [rc for _, _, rc in rows if rc != 0]
            if bad:
                print(f"{who}: exit status {bad[0]}")
                return 1
        t = {w: statistics.median(r[0] for r in rows) for w, rows in res.items()}
        m = {w: max(r[1] for r in rows) for w, rows in res.items()}
        print("| command | median wall s | peak RSS MB |")
        print("|---|---|---|")
        for w in ("wc", "erft"):
            print(f"| {'wc -l' if w == 'wc' else 'erft fit-law'} | {t[w]:.1f} | {m[w]:.0f} |")
        print(f"ratio erft / wc -l: time {t['erft'] / t['wc']:.1f}x, peak RSS {m['erft'] / m['wc']:.0f}x")
        verdict = "PASS" if m["erft"] < TARGET_RSS_MB else "MISS"
        print(f"target: fit-law peak RSS < {TARGET_RSS_MB} MB: {m['erft']:.0f} MB ({verdict})")
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
