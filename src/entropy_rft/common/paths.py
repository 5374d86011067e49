"""A path the user wrote, with its ``~`` or ``~user`` expanded, or refused in one line. Torch-free.

``Path.expanduser`` raises a bare ``RuntimeError("Could not determine home directory.")`` for ``~nouser/...``
(no such user) or for ``~`` with no home folder known: :func:`expand_user` says instead which flag, field or
environment variable held the path and what to write.
"""

from __future__ import annotations

import os
from pathlib import Path

from entropy_rft.common.errors import UserError


def expand_user(path: str | os.PathLike, what: str) -> Path:
    """``Path(path).expanduser()``; a leading ``~user`` whose user does not exist (or a ``~`` when the home folder
    is not known) is a :class:`UserError` naming ``what`` (``--model``, ``ERFT_CACHE``, ...) and the fix."""
    text = os.fsdecode(os.fspath(path))
    if text.startswith("~"):
        head = text.split("/", 1)[0].split(os.sep, 1)[0]
        if os.path.expanduser(head).startswith("~"):  # what Path.expanduser raises its RuntimeError on
            user = head[1:]
            why = (f"user {user!r} does not exist here" if user
                   else "the home folder is not known (HOME is not set)")
            raise UserError(f"{what} {text!r}: {why}, so {head!r} cannot be expanded; write the path in full "
                            "(e.g. /home/<user>/...)")
    return Path(text).expanduser()
