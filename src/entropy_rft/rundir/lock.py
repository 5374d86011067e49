"""The one-writer rule of a run directory: an OS lock (``flock``) on ``<out>/.erft.lock`` held for the run's life.

The lock file is never written through a symbolic link that leads out of the run (``rundir.guard``). Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from entropy_rft.common.errors import UserError
from entropy_rft.rundir.guard import refuse_link_out

LOCK = ".erft.lock"
# what a refused writer is told to do
ADVICE = "wait for it to finish or stop it (a killed process releases the run at once)"


class RunLock:
    """The one-writer rule: an OS lock (``flock``) on ``<out>/.erft.lock`` held for the run's life.

    The kernel releases it when the process dies, so a kill -9 never leaves a stale lock; the file itself
    stays (removing a lock file races with the next locker). The holder's pid is written into it so that a
    second writer can say who holds the run."""

    def __init__(self, out: str | Path, what: str = "run directory",
                 advice: str = ADVICE):
        self.out = Path(out)
        self.what, self.advice = what, advice  # the refusal's words: "<what> <out> is in use by ...; <advice>"
        self._fd: int | None = None

    @staticmethod
    def _take(fd: int, out: Path, exclusive: bool, what: str = "run directory",
              advice: str = ADVICE) -> None:
        import fcntl

        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise UserError(f"{what} {out} is in use by {who}; {advice}") from None

    @classmethod
    def refuse_if_held(cls, out: str | Path) -> None:
        """Raise the 'in use' error when another process holds ``out``'s lock (creates nothing)."""
        try:
            fd = os.open(Path(out) / LOCK, os.O_RDONLY)
        except OSError:
            return
        cls._take(fd, Path(out), exclusive=False)
        os.close(fd)

    def acquire(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        refuse_link_out(self.out / LOCK, self.out)  # the pid below would overwrite a file that is not the run's
        fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        self._take(fd, self.out, exclusive=True, what=self.what, advice=self.advice)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

