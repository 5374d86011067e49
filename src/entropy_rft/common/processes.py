"""Processes that end with the one that started them, and the members of a process session. Torch-free.

A sweep's driver (benchmarks/gpu/realm.py) starts ``erft compare`` in a session of its own, and ``erft compare``
starts one worker per run, each in a process group of its own (``launch.sweep``), all in that session. Two things
keep such a tree from training on with nobody watching it:

- :func:`die_with_parent`: the kernel sends a child a signal when its parent ends, however it ends (SIGKILL and
  the out-of-memory killer included; Linux's ``prctl(PR_SET_PDEATHSIG)``). With SIGTERM a run saves a checkpoint
  and stops, as on any stop.
- :func:`session_members` / :func:`signal_session`: every process of a session, whatever group it is in (a
  process group is left by ``setpgrp``, the session only by ``setsid``), so that a last-resort SIGKILL reaches
  every worker, not only the first process's group.

Both read Linux's interfaces (``prctl``, ``/proc``); elsewhere they do nothing and say so (False, ``[]``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Have the kernel send ``signum`` to this process when its parent ends (``PR_SET_PDEATHSIG``). ``parent``: the
    pid the caller expects as its parent; if it has ended already (this process was re-parented before the call),
    ``signum`` is sent at once. Returns whether the kernel took the request (False off Linux).

    The kernel ties the signal to the *thread* that created the child: call it in a child of a process whose
    creating thread lives as long as the child should (the main thread, or a pool's manager thread)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)
    return True


def _state(pid: int) -> str | None:
    """The one-letter state of ``pid`` in ``/proc/<pid>/stat`` (after the command name, which may hold spaces
    and parentheses), or None when it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rfind(")") + 1:].split()
    return rest[0] if rest else None


def session_members(sid: int) -> list[int]:
    """The pids of the live processes (zombies left out: they have ended, their parent has not reaped them) whose
    session id is ``sid``, this process excepted; ``[]`` where ``/proc`` cannot be read."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    me, found = os.getpid(), []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            if os.getsid(pid) != sid:
                continue
        except OSError:  # ended meanwhile, or not ours to see
            continue
        if _state(pid) not in (None, "Z", "X"):
            found.append(pid)
    return sorted(found)


def signal_session(sid: int, signum: int) -> list[int]:
    """Send ``signum`` to every live process of session ``sid`` (:func:`session_members`) and to process group
    ``sid`` (where ``/proc`` is missing, that group is all that is reached). Returns the pids signalled."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signum)
    members = session_members(sid)
    for pid in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
    return members
