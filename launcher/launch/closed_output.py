"""When the reader of `train`'s output goes away: `train ... | head`, a terminal that closed, a
log collector that died. The run trains on and ends as it would have (logs, metrics, its
`outcome.json` and its exit code are its own); only what it would have said goes nowhere.

A write to a pipe whose reader is gone fails with EPIPE (Python ignores SIGPIPE), and one to a
terminal that closed with EIO. rich's answer to EPIPE is `SystemExit(1)`, which would end a
healthy run as failed; Python's, at exit, is an "Exception ignored ... BrokenPipeError" and exit
code 120, as it flushes what is still buffered. So the stream's file descriptor is pointed at
/dev/null instead: later writes, and that last flush, succeed and go nowhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import IO

from rich.console import Console


class LauncherConsole(Console):
    """A rich console that goes quiet when its reader goes away, rather than exiting."""

    def on_broken_pipe(self) -> None:
        stop_writing(self)

    def _check_buffer(self) -> None:
        # rich hands only EPIPE to on_broken_pipe; a terminal that closed gives EIO.
        try:
            super()._check_buffer()
        except OSError as exc:
            if not reader_gone(exc):
                raise
            stop_writing(self)


def reader_gone(exc: BaseException) -> bool:
    """Whether a failed write means that nobody reads the stream any more."""
    return isinstance(exc, OSError) and exc.errno in (errno.EPIPE, errno.EIO)


def stop_writing(console: Console) -> None:
    """`console`'s reader is gone: it writes nothing more, and what is still buffered for it
    is discarded without error."""
    console.quiet = True
    discard(console.file)


def discard(stream: IO[str]) -> None:
    """Points `stream`'s file descriptor, and every standard stream on the same pipe (`2>&1`),
    at /dev/null."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        closed = os.fstat(stream.fileno())
        same = [stream.fileno()]
        for other in (1, 2):
            with contextlib.suppress(OSError):
                found = os.fstat(other)
                if (found.st_dev, found.st_ino) == (closed.st_dev, closed.st_ino):
                    same.append(other)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in set(same):
                os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def flush_standard_streams() -> None:
    """Flushes stdout and stderr, discarding what a closed pipe can no longer take: called
    before the launcher exits, so that the interpreter's own last flush finds nothing to fail
    on."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except (OSError, ValueError) as exc:  # ValueError: closed by the program itself
            if reader_gone(exc):
                discard(stream)
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
