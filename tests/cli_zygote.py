"""Test helper: many ``erft`` command lines, each run as its own process, forked from one process that imported
torch and erft's command line once. A fresh ``erft`` process spends ~2.5 s importing torch before it can refuse a
bad ``compare`` or ``filter`` argument; test_bad_inputs runs ~170 command lines.

Each child is a real process: its own exit status, its own stdout and stderr (files), stdin from /dev/null, the
working directory and environment this helper was started with. Only the imports are shared: the CPU pin is
applied before torch loads, as ``erft`` itself does.

Protocol: one JSON list (the arguments after ``erft``) per line on stdin; for each, one JSON line on stdout:
``{"rc": int, "stdout": str, "stderr": str, "seconds": float}``. Up to ``argv[1]`` children run at once; answers
come in the order of the requests.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(sys.executable)  # as for the ``erft`` script (bin/), not this file's folder

from entropy_rft.common.numerics import pin_cpu_numerics  # noqa: E402

pin_cpu_numerics()

import torch  # noqa: E402,F401  (what the slow cases import)

import entropy_rft.control  # noqa: E402,F401  (the method registry: compare, filter and train validate against it)
from entropy_rft.cli.main import main  # noqa: E402


def start(argv: list[str]) -> tuple[int, float, object, object]:
    """Fork one child running ``erft argv``; (pid, start time, its stdout file, its stderr file)."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - closed by finish()
    sys.stdout.flush()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: a process of its own from here on
        code = 1
        try:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.argv = ["erft", *argv]
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - shown on the case's stderr, as an uncaught error would be
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 0)
    return pid, t0, out, err


def finish(pid: int, t0: float, out, err) -> dict:
    _, status = os.waitpid(pid, 0)
    seconds = time.perf_counter() - t0
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    return {"rc": os.waitstatus_to_exitcode(status), "stdout": texts[0], "stderr": texts[1], "seconds": seconds}


def serve(width: int) -> None:
    running: list[tuple[int, float, object, object]] = []
    for line in sys.stdin:
        running.append(start(json.loads(line)))
        if len(running) >= width:
            print(json.dumps(finish(*running.pop(0))), flush=True)
    for r in running:
        print(json.dumps(finish(*r)), flush=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
