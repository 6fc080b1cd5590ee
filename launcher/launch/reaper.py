"""Nothing a run starts outlives it: the workers, and whatever they start (a recipe's
`subprocess.Popen`, a DataLoader worker, a daemon), however the launcher ends.

How: every process of the run carries a cookie in its environment, as Jenkins marks a build's
processes (its ProcessTreeKiller). The launcher sets `LAUNCHER_RUN_COOKIE` before it starts
anything; workers inherit it, and so does everything they start, in whatever process group or
session it moves to. A worker forked by the fork server never started a program, so its
environment, as /proc shows it, is still the one the launcher started with: it carries the
cookie as the name of a page of memory it maps instead (`forked_mark`), which its own forks
inherit, whatever session they move to and descriptors they close. A reaper, a small process
the launcher starts first, waits for the launcher's end: EOF on a pipe that only the launcher
holds open, which the kernel closes however the launcher ends, SIGKILL included. It then
SIGKILLs every process with the cookie (SIGKILL: a recipe's child may ignore or block SIGTERM)
until none is left, and exits. On every end it
controls, the launcher waits for the reaper, so `train` returns once nothing of the run remains.

Why not the alternatives:
- Process groups and sessions: the elastic agent starts each worker in a session of its own
  and signals the groups of workers still alive; a killed worker's group is left alone, and a
  child that starts a session of its own leaves its worker's group anyway.
- PR_SET_CHILD_SUBREAPER in the launcher: orphans come back to it, but only while it lives;
  once it is SIGKILLed they go to init.
- PR_SET_PDEATHSIG: the workers already die with the launcher through it (forked ones with
  their fork server, which dies with the launcher), but the kernel clears it at fork: their
  children cannot get it without running code between fork and exec.

The reaper ignores SIGINT, SIGTERM and SIGHUP and runs in a session of its own: Ctrl-C at the
terminal, SLURM's SIGTERM to every process of the job, or a SIGKILL to the launcher's process
group must not end it before it has done its work. What escapes it: a process that replaces
its environment and leaves the run's process tree (the launcher's second Ctrl-C and its hang
watchdog kill that tree, see `supervise.kill_workers`), and one that is not readable (setuid).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from types import TracebackType

COOKIE = "LAUNCHER_RUN_COOKIE"


class Reaper:
    """Starts the reaper and marks this process's future children; `with` ends the run's
    processes on the way out."""

    def __init__(self) -> None:
        self.cookie = uuid.uuid4().hex
        # Not marked itself: a run started inside a run (a recipe calling `train`) keeps its
        # own reaper while the outer one ends it.
        env = {k: v for k, v in os.environ.items() if k != COOKIE}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.launch.reaper", self.cookie],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        os.environ[COOKIE] = self.cookie  # everything started from now on carries it

    @property
    def pid(self) -> int:
        return self._proc.pid

    def finish(self, timeout_s: float = 20.0) -> None:
        """Ends every process of the run and waits for that, for at most `timeout_s`."""
        os.environ.pop(COOKIE, None)
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout_s)

    def __enter__(self) -> Reaper:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()


@contextlib.contextmanager
def children_reaped() -> Iterator[None]:
    """Nothing started inside outlives it: for code the launcher runs in its own process, as
    when it imports a recipe to check it (a module may start a server when imported). The
    cookie marks what is started meanwhile, and this process reaps it on the way out."""
    import psutil

    cookie, outer = uuid.uuid4().hex, os.environ.get(COOKIE)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    os.environ[COOKIE] = cookie
    try:
        yield
    finally:
        if outer is None:
            os.environ.pop(COOKIE, None)
        else:
            os.environ[COOKIE] = outer
        # A forked child (multiprocessing, os.fork) carries the environment it was exec'd
        # with, not the cookie: the new children of this process are ended by name.
        forked = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        for child in forked:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(forked, timeout=5.0)
        reap(cookie, spare={os.getpid()}, timeout_s=5.0)


def forked_mark(env: dict[str, str]) -> str:
    """The name of the mark a worker forked with environment `env` carries, "" for none: a
    page of memory (`worker.fork_server`), which its own forks inherit, named as the cookie's
    entry in an environment is."""
    return f"{COOKIE}={env[COOKIE]}" if COOKIE in env else ""


def marked(cookie: str, spare: set[int]) -> list[int]:
    """Live processes whose environment holds the cookie, or which carry the mark of a
    forked worker (their environment in /proc is the launcher's at its start); zombies have
    neither left."""
    entry = f"{COOKIE}={cookie}".encode()
    mapping = b"/memfd:" + entry + b" "  # as /proc/PID/maps names it: "... (deleted)"
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit() or int(name) in spare:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if entry in environ.read().split(b"\0"):
                    found.append(int(name))
                    continue
            with open(f"/proc/{name}/maps", "rb") as maps:
                if mapping in maps.read():
                    found.append(int(name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def reap(cookie: str, spare: set[int], timeout_s: float = 15.0) -> None:
    """SIGKILLs the marked processes until none is left (a dying one may still fork)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = marked(cookie, spare)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    launcher = os.getppid()
    sys.stdin.buffer.read()  # returns at EOF: the launcher has ended, or asks for the end
    reap(argv[1], spare={os.getpid(), launcher})


if __name__ == "__main__":
    main(sys.argv)
