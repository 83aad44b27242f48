"""Writing run and job files without following symbolic links.

A link left where autoplan writes a file (a job's launch.sh, a run's metrics.jsonl or lock
file) would make the write land on the link's target, which may be anything the user can
write. Every file autoplan creates, truncates or appends to is opened with O_NOFOLLOW, and a
link in its place is refused with one paragraph naming it. Only the last part of the path is
checked: a run or job directory that is itself a link (to scratch storage, say) is the
user's choice and is followed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from autoplan.errors import UserError


def link_refusal(path: str | Path) -> UserError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return UserError(f"{path} is a symbolic link (to {target}); autoplan does not write its files "
                     "through links, since that would change the link's target instead. Remove "
                     "the link (its target is left as it is) and run again, or choose another "
                     "directory.")


def refuse_link(path: str | Path) -> None:
    """UserError when `path` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise link_refusal(path)


def open_no_follow(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """os.open(path, flags) that never follows a link at the last part of the path."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        # O_EXCL alone refuses a link with EEXIST, O_NOFOLLOW with ELOOP
        if exc.errno in (errno.ELOOP, errno.EEXIST) and os.path.islink(path):
            raise link_refusal(path) from None
        raise


def write_file(path: str | Path, data: bytes, *, append: bool = False,
               executable: bool = False) -> None:
    """Write (or append) `data` to the regular file at `path`; never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = open_no_follow(path, flags)
    with os.fdopen(fd, "ab" if append else "wb") as fh:
        if executable:  # on the open file: a chmod by name would follow a link put there since
            os.fchmod(fd, os.fstat(fd).st_mode | 0o111)
        fh.write(data)


def write_output(path: str | Path, text: str) -> None:
    """Write a command's -o file: its missing folders are made, a link in its place is refused,
    and a path that cannot be written (a folder there, no permission, a full disk) is one
    UserError naming it; whether an existing file may be replaced is the command's check."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, text.encode())
    except OSError as exc:  # a refused link is a UserError already
        raise UserError(f"cannot write {path}: {exc.strerror or exc}; choose another -o path "
                        "(a file in a folder you can write to)") from None
