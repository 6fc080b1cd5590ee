"""`train ARGS` in a fork of a warm server process: what `run_train` runs.

A `train` subprocess spends 1.5-2 CPU-seconds importing torch and the launcher before it
reads its spec; a fork of a process that imported them once starts at once. The fork comes
from multiprocessing's fork server, started once per test session with those imports
preloaded: a single-threaded process, so the fork cannot inherit a lock another thread held
(CPython gh-112275; the test process itself has gloo's, the sinks' and the display's threads).
The fork is still a process of its own, as a subprocess is: its own session, working
directory, environment and standard streams, its exit code and output read the same way, and
nothing of it may outlive it. What it starts (the reaper, the workers' fork server, the
workers) starts as a user's `train` starts it. Tests that signal the launcher, or need its
command line, start the real command (`conftest.start_train`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

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


def _kill(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # its session: what it started too


def _be_train(
    args: list[str],
    cwd: Path,
    env: dict[str, str],
    out: Path,
    err: Path,
    preexec_fn: Callable[[], None] | None,
) -> None:
    """The fork's whole life: `train ARGS` as its own process, with the test's environment
    (`env`, whole), ended by os._exit."""
    code = 1
    try:
        os.setsid()
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
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
