"""What a run directory's writers refuse, and the modes they give: a file erft creates, appends to or truncates
inside a run is never written through a symbolic link that leads out of the run (one line, :class:`UserError`),
and every file and folder erft makes there follows the user's umask (``tempfile`` makes them 0600/0700).

A linked *folder* is followed on purpose: ``checkpoints/`` (or ``tb/``) may be a link to another disk, and the
files erft writes in it are its own. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from entropy_rft.common.errors import UserError


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(folder: bool) -> int:
    """The mode ``open``/``mkdir`` would give a new file (0666) or folder (0777) under the current umask."""
    return (0o777 if folder else 0o666) & ~current_umask()


def follow_umask(path: str | Path | int, *, folder: bool = False) -> None:
    """Give ``path`` (or an open descriptor) the mode a plain ``open``/``mkdir`` would have given it."""
    if isinstance(path, int):
        os.fchmod(path, umask_mode(folder))
    else:
        os.chmod(path, umask_mode(folder))


def link_out(path: str | Path, run: str | Path | None = None) -> Path | None:
    """Where ``path`` leads when it is a symbolic link whose target is outside ``run`` (default: the folder that
    holds ``path``); None when it is not a link, or a link that stays inside the run."""
    p = Path(path)
    if not p.is_symlink():
        return None
    root = Path(run if run is not None else p.parent).resolve()
    target = p.resolve()
    return None if target == root or root in target.parents else target


def refuse_link_out(path: str | Path, run: str | Path | None = None) -> None:
    """One line (:class:`UserError`) when ``path`` is a symbolic link leading out of the run (see :func:`link_out`):
    erft would write through it into a file that is not the run's."""
    target = link_out(path, run)
    if target is not None:
        raise UserError(f"{path} is a symbolic link to {target}, outside the run directory; erft does not write "
                        f"through it: remove the link (rm '{path}') and rerun")
