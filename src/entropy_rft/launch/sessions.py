"""The processes of a resumable sweep's driver (benchmarks/gpu/realm.py and its paced wave; issue 73): each
``erft compare`` in a session of its own that ends with the driver, however the driver ends; a stop that reaches
every process of that session (``erft compare``'s run workers are each in a process group of their own); a start
that waits for the runs an earlier driver's sweep is still stopping. Linux's interfaces through
``entropy_rft.common.processes``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from entropy_rft.common.processes import die_with_parent, session_members, signal_session

REAP_S = 30.0  # after the last-resort SIGKILL, how long the session's processes are given to disappear


def start_session(cmd: list[str], **popen) -> subprocess.Popen:
    """``cmd`` in a session of its own (its process group too), sent SIGTERM by the kernel when this process ends
    (``die_with_parent``: a SIGKILLed driver, the out-of-memory killer): its runs then save a checkpoint and
    stop, and ``erft compare``'s workers, which die with it the same way, do too."""
    me = os.getpid()
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM, me),
                            **popen)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of ``proc``'s session, then wait until none is left (at most ``REAP_S``)."""
    signal_session(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + REAP_S
    while time.monotonic() < end:
        left = signal_session(proc.pid, signal.SIGKILL)
        if not left:
            return
        time.sleep(0.1)


def stop_session(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM to ``proc``'s process group (``erft compare`` passes it on to each run: a checkpoint, then "stopped");
    after ``wait_s`` the last resort, SIGKILL, reaches every process of the session, each worker included."""
    end = time.monotonic() + max(0.0, wait_s)
    signal_session(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(0.0, wait_s))
    while session_members(proc.pid) and time.monotonic() < end:  # workers still saving their checkpoint
        time.sleep(0.2)
    kill_session(proc)


def held_runs(runs: Path) -> list[tuple[str, str]]:
    """(run, holder's words) of each run folder in ``runs`` whose lock another process holds."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.rundir.lock import RunLock

    held = []
    for d in sorted(p for p in runs.iterdir() if p.is_dir() and not p.is_symlink()) if runs.is_dir() else []:
        try:
            RunLock.refuse_if_held(d)
        except UserError as e:
            words = str(e)
            held.append((d.name, words[words.find("in use by ") + 10:].split(";")[0]))
    return held


def wait_for_runs(runs: Path, wait_s: float, say) -> list[tuple[str, str]]:
    """Wait up to ``wait_s`` for the runs in ``runs`` that another process still holds (an earlier driver's sweep
    stopping with checkpoints, after that driver was killed) to be released, saying so once. Returns those still
    held (empty: the folder is free)."""
    held = held_runs(runs)  # said without a prefix: ``say`` adds the driver's
    if held:
        say(f"waiting up to {wait_s:.0f} s for {len(held)} run(s) an earlier sweep is stopping "
            f"({', '.join(f'{n}: {w}' for n, w in held[:3])})")
    end = time.monotonic() + wait_s
    while held and time.monotonic() < end:
        time.sleep(0.5)
        held = held_runs(runs)
    return held
