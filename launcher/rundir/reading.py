"""Reading a run folder's files as anyone who can write into the folder may have left them:
only regular files are read (a FIFO would block the reader forever, `/dev/zero` would fill
its memory), and never more than a bound, so a rank that wrote a gigabyte of log costs the
launcher a few megabytes when it reports the failure.

Every function returns None (or nothing) where the file is missing, unreadable or not a
regular file: these readers report on runs, and one odd file must never break a report."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

# What the launcher's reports read of a rank's log: its end, where the traceback is.
LOG_TAIL_BYTES = 4 << 20


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO | None]:
    """The file, open for reading, or None where it is not a regular file. Opened without
    blocking: opening a FIFO for reading would otherwise wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield None
        return
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, too: fdopen would refuse it
        os.close(fd)
        yield None
        return
    with os.fdopen(fd, "rb") as file:
        yield file


def read_head(path: Path, limit: int) -> bytes | None:
    """The file's first `limit` bytes (all of a smaller file)."""
    with open_regular(path) as file:
        if file is None:
            return None
        try:
            return file.read(limit)
        except OSError:
            return None


def read_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> bytes | None:
    """The file's last `limit` bytes, from the start of a line (all of a smaller file)."""
    with open_regular(path) as file:
        if file is None:
            return None
        try:
            start = max(0, file.seek(0, os.SEEK_END) - limit)
            file.seek(start)
            data = file.read(limit)
        except OSError:
            return None
    if start:  # the first line is cut: what is left starts after its end (if it has one)
        data = data[data.find(b"\n") + 1 :]
    return data


def read_log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """A rank's log's end as text ("" where there is none)."""
    return (read_tail(path, limit) or b"").decode("utf-8", errors="replace")
