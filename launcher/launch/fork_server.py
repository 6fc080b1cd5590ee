"""Who starts the workers: the launcher's half of the workers' fork server
(`launch.worker_start`; `launcher.worker.fork_server` is the server's, with its protocol).

The agent starts each worker as `python -u -m launcher.worker.main ...` through torch's
`SubprocessContext`, which asks `get_subprocess_handler` for a handler holding a
`subprocess.Popen`. While `forked_workers` is open, that function is ours: it hands the same
command to a fork server, which forks a warm copy of itself instead of a new interpreter, and
returns a handler whose process answers as a `Popen` does (pid, poll, wait, the exit code, the
process group that `close` signals). The agent's supervision, restarts and failure reports are
torch's own, unchanged.

Where the server comes from: `warm_server` forks it from the `train` process itself, once the
spec is valid and torch imported, before the recipe is (so it never holds user code) and
before any thread starts (CPython gh-112275). It then costs the launcher a fork, not a second
interpreter importing torch: a first start is as cheap as a restart (BENCHMARKS.md). Where that
cannot be (a thread is running, say an object store's client's), and for each replica group,
the server is a new interpreter, started as the workers are about to start.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing import api as elastic_processes

from launcher.errors import LauncherError
from launcher.launch.agent import WORKER_MODULE
from launcher.launch.plan import LaunchPlan, workers_forked
from launcher.launch.reaper import forked_mark
from launcher.stop_signals import JOB_SIGNALS

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec

FORK_SERVER_MODULE = "launcher.worker.fork_server"
# The fork server's status messages: (b"p", the worker's pid), then (b"x", its exit code).
_STATUS = struct.Struct("=cq")


@contextlib.contextmanager
def warm_server(spec: RunSpec) -> Iterator[ForkServer | None]:
    """A fork server forked from this process now, for a run whose workers it will fork
    (None for any other, or where this process runs a thread); closed on the way out unless
    the run has taken it (`forked_workers`). Enter it before the recipe is imported."""
    server = ForkServer.fork_here() if _forks_here(spec) else None
    try:
        yield server
    finally:
        if server is not None:
            server.close()


def _forks_here(spec: RunSpec) -> bool:
    from launcher.launch.devices import resolve_accelerator

    try:
        accelerator = resolve_accelerator(spec.launch.accelerator, spec.launch.strategy)
    except LauncherError:
        return False  # the plan says why
    # Replica groups get a server each, whose environment (/proc) holds the group's.
    if not workers_forked(spec, accelerator) or spec.fault_tolerance.enabled:
        return False
    # No other thread runs Python (gh-112275 is about the interpreter's locks). A native
    # pool that never enters Python may run: OpenBLAS's, started as numpy is imported, stops
    # itself around a fork (pthread_atfork), as the server's own forks rely on too.
    return len(sys._current_frames()) == 1


@contextlib.contextmanager
def forked_workers(plan: LaunchPlan, warm: ForkServer | None = None) -> Iterator[None]:
    """While open, the elastic agents of this process start their workers through fork
    servers (`plan.forks_workers`; else as new interpreters): `warm`, forked from this process
    as it started (`warm_server`), or one started now; and a new interpreter's per
    environment an agent adds (a replica group's), so that each worker's environment, as
    tools read it from its start (/proc), holds it. Open it once the workers' environment is
    set: a server started here starts with it."""
    if warm is not None and (not plan.forks_workers or plan.replica_groups):
        warm.close()  # the plan, resolved, starts its workers otherwise
        warm = None
    if not plan.forks_workers:
        yield
        return
    servers = ForkServers(plan.run_dir, plan.recipe_libraries, warm)
    if not plan.replica_groups:
        servers.get({})  # started now, to import while the agent sets up its rendezvous
    popen_handler = elastic_processes.get_subprocess_handler

    def handler(
        entrypoint: str,
        args: tuple,
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
        numa_options: Any = None,
    ) -> Any:
        added: dict[str, str] = {}
        argv = _worker_argv(entrypoint, args, added)
        server = None if argv is None or numa_options is not None else servers.get(added)
        if server is None or not server.ready():
            return popen_handler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)
        child_env = {**os.environ, **env, **added}
        return ForkedHandler(server, argv, child_env, stdout, stderr, local_rank_id)

    elastic_processes.get_subprocess_handler = handler  # type: ignore[assignment]
    try:
        yield
    finally:
        elastic_processes.get_subprocess_handler = popen_handler
        servers.close()


class ForkServers:
    """This launcher's fork servers, one per environment added to its own."""

    def __init__(
        self, run_dir: Path, libraries: tuple[str, ...], warm: ForkServer | None = None
    ) -> None:
        """`warm`: the server of the workers that add nothing, forked already (it is sent the
        recipe's libraries now); `libraries`: what every server imports besides its own list."""
        self._run_dir, self._libraries = run_dir, libraries
        self._servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
        if warm is not None:
            warm.send_libraries(libraries)
            self._servers[()] = warm
        self._lock = threading.Lock()

    def get(self, added: dict[str, str]) -> ForkServer:
        key = tuple(sorted(added.items()))
        with self._lock:
            if key not in self._servers:
                self._servers[key] = ForkServer.start(self._run_dir, added, self._libraries)
            return self._servers[key]

    def close(self) -> None:
        with self._lock:
            for server in self._servers.values():
                server.close()


def _worker_argv(entrypoint: str, args: tuple, added: dict[str, str]) -> list[str] | None:
    """The interpreter's arguments of a worker's command (`[env K=V...] python -u -m
    launcher.worker.main ...`, its `K=V`s put in `added`); None for any other command."""
    argv = [str(a) for a in args]
    if os.path.basename(entrypoint) == "env":
        while argv and "=" in argv[0] and not argv[0].startswith("-"):
            key, _, value = argv.pop(0).partition("=")
            added[key] = value
        entrypoint, argv = (argv[0], argv[1:]) if argv else ("", [])
    if entrypoint != sys.executable or argv[:3] != ["-u", "-m", WORKER_MODULE]:
        return None
    return argv


class ForkServer:
    """The launcher's half of one server (its protocol is `launcher.worker.fork_server`'s):
    `fork_here` forks it from this process, `start` starts it as a new interpreter."""

    def __init__(
        self, control: socket.socket, process: subprocess.Popen | ServerProcess, timeout_s: float
    ) -> None:
        self._control, self._proc = control, process
        self._lock = threading.Lock()
        self._ready: bool | None = None
        self._ready_timeout_s = timeout_s
        self._closed = False

    @classmethod
    def start(
        cls,
        run_dir: Path,
        added: dict[str, str],
        libraries: tuple[str, ...] = (),
        ready_timeout_s: float = 120.0,
    ) -> ForkServer:
        """A server started as a new interpreter. `added`: variables added to this process's
        environment for the server and its workers; `libraries`: modules it imports beside
        its own list (the recipe's)."""
        control, theirs = socket.socketpair()
        argv = [sys.executable, "-m", FORK_SERVER_MODULE, "--fd", str(theirs.fileno())]
        # Its parent-death signal follows this thread: an agent's ends before the launcher.
        if threading.current_thread() is threading.main_thread():
            argv += ["--parent", str(os.getpid())]
        # In its own session: Ctrl-C at the terminal is for the launcher and the workers.
        # Nothing of its own reaches the terminal; its workers get the launcher's streams.
        process = subprocess.Popen(
            [*argv, "--run-dir", str(run_dir)],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **added},
            start_new_session=True,
        )
        theirs.close()
        server = cls(control, process, ready_timeout_s)
        server.send_libraries(libraries)
        return server

    @classmethod
    def fork_here(cls, ready_timeout_s: float = 120.0) -> ForkServer:
        """A server forked from this process, which must be single-threaded (CPython
        gh-112275): it starts with what this process imported (torch), and imports the rest
        while this one goes on. The recipe's libraries follow (`send_libraries`)."""
        control, theirs = socket.socketpair()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # the server's whole life; by name: the launcher imports no worker code
            importlib.import_module(FORK_SERVER_MODULE).run_forked(theirs.fileno(), launcher)
        theirs.close()
        return cls(control, ServerProcess(pid), ready_timeout_s)

    def send_libraries(self, libraries: tuple[str, ...]) -> None:
        """The server's first message: the installed libraries it imports for the recipe."""
        message = pickle.dumps(tuple(libraries))
        with contextlib.suppress(OSError):  # a server that died at once: ready() says so
            self._control.sendall(struct.pack("!I", len(message)) + message)

    def ready(self) -> bool:
        """Whether the server has imported what it preloads (waiting for that, once); a
        server that failed is said once, and the workers start as new interpreters."""
        with self._lock:
            if self._ready is None:
                self._ready = self._await_ready()
            return self._ready

    def _await_ready(self) -> bool:
        readable, _, _ = select.select([self._control], [], [], self._ready_timeout_s)
        answer = self._control.recv(1024) if readable else b""
        if answer == b"\x01":
            return True
        why = answer[1:].decode(errors="replace") or f"exit code {self._proc.poll()}"
        print(
            f"warning: the workers' fork server cannot fork them ({why}); they start as new "
            "interpreters (launch.worker_start: spawn says so without trying)",
            file=sys.stderr,
        )
        return False

    def fork(self, argv: list[str], env: dict[str, str], streams: list[int]) -> ForkedProcess:
        """A worker forked from the server: `python ARGV` with `env` and the standard
        streams `streams` (stdin, stdout, stderr), in this process's working directory."""
        mine, theirs = socket.socketpair()
        request = pickle.dumps(
            (argv, env, os.getcwd(), _umask(), forked_mark(env), _ignored_signals())
        )
        with self._lock:
            socket.send_fds(self._control, [request], [*streams, theirs.fileno()])
        theirs.close()
        return ForkedProcess(argv, mine)

    def close(self) -> None:
        """Ends the server (EOF on its control socket); its workers have ended by now. One
        that forked nothing (the run ended first) is killed, not left to finish importing."""
        if self._closed:
            return
        self._closed = True
        self._control.close()
        with self._lock:
            if not self._ready:
                self._proc.kill()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _ignored_signals() -> tuple[int, ...]:
    """The job's signals this process ignores now (`Request.ignored`)."""
    return tuple(int(sig) for sig in JOB_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN)


def _umask() -> int:
    """This process's umask, read without setting it (`os.umask` sets it, for every thread)."""
    with contextlib.suppress(OSError, StopIteration), open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)  # where /proc has no Umask line: briefly set, and set back
    os.umask(mask)
    return mask


class PopenSignals:
    """`subprocess.Popen`'s send_signal, terminate and kill, for a process object that has a
    `pid` and answers `poll()`: as Popen's, a signal goes only to a process still running
    (never to a pid the system may have reused since)."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ServerProcess(PopenSignals):
    """A server forked from this process, answering as the `subprocess.Popen` of one started
    as a new interpreter does (what `ForkServer` asks of it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already (`supervise.kill_workers`): as Popen,
                pid, status = self.pid, 0  # which then knows no exit code either, says 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["fork server"], timeout or 0.0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


class ForkedProcess(PopenSignals):
    """A forked worker, answering as the `subprocess.Popen` of torch's handler does."""

    def __init__(self, args: list[str], status: socket.socket) -> None:
        self.args = args
        self.returncode: int | None = None
        self._status = status
        self._lock = threading.Lock()
        kind, pid = self._read(timeout_s=60.0)
        if kind != b"p":
            status.close()
            raise RuntimeError("the workers' fork server could not start a worker")
        self.pid = pid

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def _wait(self, timeout_s: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                kind, code = self._read(timeout_s)
                if kind == b"":  # the server ended before it could tell: its workers with it
                    kind, code = b"x", -signal.SIGKILL
                if kind == b"x":
                    self.returncode = code
                    self._status.close()
            return self.returncode

    def _read(self, timeout_s: float | None) -> tuple[bytes | None, int]:
        """The next status message, if one comes within `timeout_s` (None: none came;
        b"": the server closed the socket instead)."""
        readable, _, _ = select.select([self._status], [], [], timeout_s)
        if not readable:
            return None, 0
        data = self._status.recv(_STATUS.size, socket.MSG_WAITALL)
        if len(data) < _STATUS.size:
            return b"", 0
        kind, value = _STATUS.unpack(data)
        return kind, value


class ForkedHandler:
    """What torch's `SubprocessHandler` is to a `Popen`, for a forked worker: `proc`, and
    `close` signalling its process group (its own session, as the agent starts workers)."""

    def __init__(
        self,
        server: ForkServer,
        argv: list[str],
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
    ) -> None:
        self.local_rank_id = local_rank_id
        self._stdout = open(stdout, "w") if stdout else None  # noqa: SIM115 (closed by close)
        self._stderr = open(stderr, "w") if stderr else None  # noqa: SIM115
        with contextlib.ExitStack() as opened:
            streams = [
                _open_or_null(0, opened),
                self._stdout.fileno() if self._stdout else _open_or_null(1, opened),
                self._stderr.fileno() if self._stderr else _open_or_null(2, opened),
            ]
            self.proc = server.fork(argv, env, streams)

    def close(self, death_sig: signal.Signals | None = None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        for stream in (self._stdout, self._stderr):
            if stream is not None:
                stream.close()


def _open_or_null(fd: int, opened: contextlib.ExitStack) -> int:
    """`fd` of this process, as a child would inherit it; /dev/null where it is closed."""
    try:
        os.fstat(fd)
        return fd
    except OSError:
        null = os.open(os.devnull, os.O_RDWR)
        opened.callback(os.close, null)
        return null
