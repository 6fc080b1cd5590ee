"""Writing a file (or a folder) whole or not at all: a reader never sees half of it, and a
crash leaves at most a hidden partial beside it. The one way every record of a run folder is
written."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, text: str, private: bool = False) -> None:
    """Writes `text` to `path`, replacing what was there in one step; `private`: readable by
    this user alone (it holds a secret), from the first byte."""
    partial = _partial(path)
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
        with open(fd, "w") as f:
            f.write(text)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_new(path: Path, write: Callable[[Path], None]) -> bool:
    """Has `write` fill a partial file, then moves it to `path` unless `path` exists, in one
    step: a file created there meanwhile is never replaced (a hard link fails where its name is
    taken). Returns False, writing nothing, where `path` exists."""
    partial = _partial(path)
    try:
        write(partial)
        try:
            os.link(partial, path)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: the check and the move are two steps
            if path.exists():
                return False
            os.replace(partial, path)
        return True
    finally:
        partial.unlink(missing_ok=True)


def write_new_folder(path: Path, write: Callable[[Path], None]) -> bool:
    """Has `write` fill a partial folder, then renames it `path`: a rename takes the place of
    a missing or empty folder only, so one that got files meanwhile is never replaced (False,
    nothing written), and a crash leaves no half folder at `path`."""
    partial = _partial(path)
    partial.mkdir()
    try:
        write(partial)
        try:
            os.rename(partial, path)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            return False
        return True
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _partial(path: Path) -> Path:
    # Beside `path`: a rename is atomic only within one file system. Hidden, and named by the
    # writing process, so that two writers never share one.
    return path.with_name(f".{path.name}.{os.getpid()}")
