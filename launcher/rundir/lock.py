"""One launcher writes a run folder at a time. It holds an flock on the folder's lock file,
which records its host and pid; the kernel releases the lock when the launcher ends, however
it ends, so a lock is never left behind. Two launchers resuming one folder would write the
same checkpoints and metrics steps."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

from launcher.errors import UsageError
from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import UnreadableJson, parse_json


class RunLock:
    """Held until `release`, or until the process ends."""

    def __init__(self, fd: int | None = None) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        """Whether this process holds the lock: not where the file system has no flock."""
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def take(layout: RunLayout) -> RunLock:
    """Locks the run folder, or refuses naming the launcher that holds it."""
    try:
        # Not inherited by the workers (os.open's default): the lock ends with the launcher.
        fd = os.open(layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UsageError(f"--run-dir {layout.root}: cannot lock it ({exc.strerror})") from None
    try:
        _lock(fd)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise UsageError(
            f"run folder {layout.root}: another launcher is writing it ({holder}); a run "
            "folder has one launcher at a time",
            hint="Wait for that run to end, or stop it first.",
        ) from None
    except OSError as exc:
        # Some shared file systems have no flock (Lustre without -o flock): run unguarded
        # rather than not at all.
        os.close(fd)
        print(f"warning: {layout.lock}: cannot lock it ({exc.strerror})", file=sys.stderr)
        return RunLock()
    os.ftruncate(fd, 0)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.write(fd, json.dumps(record).encode())
    return RunLock(fd)


def _lock(fd: int, tries: int = 5) -> None:
    # `is_held` (train runs) takes the lock for a moment to look: a few tries pass a look.
    for _ in range(tries - 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.02)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def is_held(layout: RunLayout) -> bool | None:
    """Whether a launcher writes the run folder now, as its lock says; None where the file
    system cannot tell (no flock). Looks without waiting, and lets go at once."""
    try:
        # Not blocking: a FIFO put in the lock's place would wait for a writer forever.
        fd = os.open(layout.lock, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        # Shared: two looks never block each other; closing the file releases it.
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


def _holder(fd: int, patience: float = 2.0) -> str:
    """Who holds the lock, as its record says. The holder writes the record just after it takes
    the lock, so an empty record is waited for."""
    deadline = time.monotonic() + patience
    while True:
        try:
            # Anyone may have written into the file: a record nested too deeply is none.
            record = parse_json(os.pread(fd, 4096, 0), "launcher.lock")
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["since"]))
            return f"pid {record['pid']} on host {record['host']}, since {since}"
        except (UnreadableJson, ValueError, KeyError, TypeError, OverflowError):
            if time.monotonic() > deadline:
                return "its pid and host are not recorded"
            time.sleep(0.05)
