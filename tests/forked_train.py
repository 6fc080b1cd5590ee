"""`train ARGS` in a fork of a warm server process: what `run_train` runs, and `fork_train`
starts and leaves running.

A `train` subprocess spends 2.5 CPU-seconds importing torch and the launcher before it
reads its spec; a fork of a process that imported them once starts at once. The fork comes
from multiprocessing's fork server, started once per test session with those imports
preloaded: a single-threaded process, so the fork cannot inherit a lock another thread held
(CPython gh-112275; the test process itself has gloo's, the sinks' and the display's threads).
The fork is still a process of its own, as a subprocess is: its own session, working
directory, environment and standard streams, its exit code and output read the same way, and
nothing of it may outlive it. What it starts (the reaper, the workers' fork server, the
workers) starts as a user's `train` starts it. Tests of how `train` itself starts (a signal
during its imports, its command line, a wrapper) start the real command
(`conftest.start_train`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from launcher.launch.fork_server import PopenSignals
from launcher.worker.fork_server import PRELOAD
from tests.conftest import _assert_no_leftovers, _where_they_hang, finish_train, start_train

# What `train` imports on its way to refusing a spec: preloaded by the fork server, once.
# A module another engineer renamed is only a slower fork, never a failure (the server skips
# what it cannot import).
_WARM = [
    "torch",
    "launcher.cli.app",
    "launcher.cli.dry_build",
    "launcher.cli.memory_check",
    "launcher.cli.recipe_check",
    "launcher.cli.export",
    "launcher.config.loader",
    "launcher.clusters.nodes",
    "launcher.launch.execute",
    "launcher.launch.plan",
    "launcher.checkpoint.resume_decision",
    "tests.forked_train",
    # What the launcher's fork of its workers' server then holds already (and the workers
    # forked from it): the worker's own modules, and the Hugging Face models the tests train.
    *PRELOAD,
    "tests.warm_libraries",
]


def _server() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_WARM)
    return context


def train_in_fork(
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 90,
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """What `run_train(args, cwd, timeout, env)` returns; `preexec_fn` (a module-level function: it is sent to the fork by name) is
    called in the fork just before `train` starts. Under torch_xla (whose runtime a preloaded
    torch would start in the server) it is run_train's own subprocess, and `preexec_fn` runs
    before the exec, as Popen's does."""
    if "torch_xla" in sys.modules:
        proc = start_train(args, cwd, env, preexec_fn=preexec_fn)
        return finish_train(proc, cwd, timeout)
    environment = {**os.environ, "COLUMNS": "200", **(env or {})}
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        fork = _server().Process(
            target=_be_train, args=(args, cwd, environment, out, err, preexec_fn)
        )
        fork.start()
        fork.join(timeout)
        if fork.exitcode is None:
            hung = _where_they_hang(fork.pid, cwd) if fork.pid else ""
            _kill(fork.pid)
            fork.join()
            output = out.read_text(errors="replace") + err.read_text(errors="replace")
            pytest.fail(
                f"train {' '.join(args)} (forked) timed out after {timeout}s\n{output}\n{hung}"
            )
        _assert_no_leftovers(fork.pid, marker=str(cwd))
        return subprocess.CompletedProcess(
            ["train", *args],
            fork.exitcode,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )


def needs_the_real_command(env: dict[str, str] | None) -> bool:
    """Whether a `train` with the test's `env` must be the real command, not a fork: under
    torch_xla (whose runtime a preloaded torch would start in the server), or where `env`
    changes how an interpreter starts (PYTHON*, TORCH*), which a fork has done already."""
    return "torch_xla" in sys.modules or any(k.startswith(("PYTHON", "TORCH")) for k in env or {})


def fork_train(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> ForkedTrain | subprocess.Popen[str]:
    """`train ARGS` forked from the warm server and left running, for a test that signals a
    running launcher or waits on it midway: it answers as `start_train`'s Popen does (finish
    it with finish_train), 2.5 CPU-seconds of imports cheaper. A test of how `train` itself
    starts (a signal during its imports, its command line, a wrapper) starts the real command.
    Under torch_xla, or with an environment that changes how an interpreter starts, it is the
    real command (as run_train's)."""
    if needs_the_real_command(env):
        return start_train(args, cwd, env)
    return ForkedTrain(args, cwd, {**os.environ, "COLUMNS": "200", **(env or {})})


class ForkedTrain(PopenSignals):
    """A forked `train` as a `subprocess.Popen(text=True, stdout=PIPE, stderr=PIPE,
    start_new_session=True)` of it: `pid`, `args`, `returncode`, `stdout` and `stderr` (pipes,
    read as they come), `poll`, `wait`, `communicate`, `send_signal`, `terminate`, `kill`.
    Its exit code is the server's report (minus the signal's number for a signal, as
    Popen's); its parent is the server, which reaps it."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.args = ["train", *args]
        self.returncode: int | None = None
        ends = [os.pipe() for _ in range(2)]
        self.stdout, self.stderr = (open(read, errors="replace") for read, _ in ends)  # noqa: SIM115
        writers = [Connection(write, readable=False) for _, write in ends]
        self._fork = _server().Process(target=_be_train, args=(args, cwd, env, *writers, None))
        self._fork.start()  # the writers go to the fork (their pickling duplicates them)
        for writer in writers:
            writer.close()  # so that the pipes end when the fork and what it started end
        self.pid: int = self._fork.pid  # type: ignore[assignment]
        self._read: dict[str, list[str]] = {}
        self._readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        self.returncode = self._fork.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._fork.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Reads both pipes to their end and waits for the exit, as Popen's; a timeout leaves
        the reading going, for the next call."""
        if not self._readers:
            for name, stream in (("out", self.stdout), ("err", self.stderr)):
                self._read[name] = []
                reader = threading.Thread(
                    target=lambda s=stream, into=self._read[name]: into.append(s.read()),
                    daemon=True,
                )
                reader.start()
                self._readers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return "".join(self._read["out"]), "".join(self._read["err"])


def _kill(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # its session: what it started too


def _be_train(
    args: list[str],
    cwd: Path,
    env: dict[str, str],
    out: Path | Connection,
    err: Path | Connection,
    preexec_fn: Callable[[], None] | None,
) -> None:
    """The fork's whole life: `train ARGS` as its own process, with the test's environment
    (`env`, whole), ended by os._exit."""
    code = 1
    try:
        os.setsid()
        for fd, target in ((1, out), (2, err)):
            if isinstance(target, Connection):  # the write end of a pipe the test reads
                os.dup2(target.fileno(), fd)
                target.close()  # fd alone holds it: the pipe ends when this run's processes do
            else:
                os.dup2(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (ended by os._exit)
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        from launcher.cli import interrupt
        from launcher.cli.app import main

        signal.signal(signal.SIGINT, interrupt._exit_quietly)
        if preexec_fn is not None:
            preexec_fn()
        sys.argv = ["train", *args]
        code = _exit_code(main)
    except BaseException:  # as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(main: Callable[[], None]) -> int:
    """main()'s exit code, as the interpreter turns a SystemExit into one."""
    try:
        main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0
