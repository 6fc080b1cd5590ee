"""torch.distributed's elastic agent, configured from a plan: the one place that says how the
workers are started (torchrun's `config_from_args`, for our plan instead of its flags), and
the fork server that starts them (`launch.worker_start`).

The fork server: the agent starts each worker as `python -u -m launcher.worker.main ...`
through torch's `SubprocessContext`, which asks `get_subprocess_handler` for a handler holding a
`subprocess.Popen`. While `forked_workers` is open, that function is ours: it hands the same
command to the fork server (`launcher.worker.fork_server`), which forks a warm copy of itself
instead of a new interpreter, and returns a handler whose process answers as a `Popen` does
(pid, poll, wait, the exit code, the process group that `close` signals). The agent's
supervision, restarts and failure reports are torch's own, unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing import api as elastic_processes
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launcher.config.loader import spec_to_yaml
from launcher.launch import rendezvous
from launcher.launch.plan import LaunchPlan
from launcher.rundir.layout import RunLayout

WORKER_MODULE = "launcher.worker.main"
FORK_SERVER_MODULE = "launcher.worker.fork_server"
# The fork server's status messages: (b"p", the worker's pid), then (b"x", its exit code).
_STATUS = struct.Struct("=cq")
_logger = logging.getLogger(__name__)


def agent_config(
    plan: LaunchPlan,
    on_round: Callable[[rendezvous.Round], None],
    group: int | None = None,  # a replica group's own agent (`fault_tolerance`): its index here
) -> tuple[LaunchConfig, list[str]]:
    """The elastic agent's configuration, and the arguments of the interpreter it starts:
    the worker module and the one file that tells a worker everything (`--plan`).
    `on_round` is called with each rendezvous round, before that round's workers start.
    A replica group's agent runs a group of this machine alone: its rendezvous is its own,
    whatever the run's nodes."""
    nodes = plan.nodes
    folder = plan.node_dir if group is None else RunLayout.replica_group(plan.node_dir, group)
    one_node = group is not None or not nodes.multi
    listen = plan.listen if group is not None else rendezvous.LOOPBACK
    node = rendezvous.NodeConfig(
        nproc=plan.nproc if group is None else plan.group_size,
        spec_digest=hashlib.sha256(spec_to_yaml(plan.spec).encode()).hexdigest()[:12],
        node_rank=None if one_node else nodes.node_rank,
        loopback=one_node,
        listen=listen,
        on_round=on_round,
    )
    run_id = f"{plan.spec.run.name}-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        min_nodes=1 if one_node else nodes.min,
        max_nodes=1 if one_node else nodes.max,
        nproc_per_node=node.nproc,
        # The same on every node; a single node's own, so that two runs never share one.
        run_id=run_id if one_node else str(nodes.job_id),
        rdzv_backend=rendezvous.register(),
        # One node: c10d's rendezvous on stores that listen on loopback only, each on a free
        # port of its own (so two runs never race for one).
        rdzv_endpoint=f"{listen}:0" if one_node else nodes.endpoint,
        rdzv_configs=node.rdzv_configs(),
        # The address the other nodes reach this one at: the workers' MASTER_ADDR on node 0.
        local_addr=_local_addr(plan, group),
        max_restarts=plan.spec.launch.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=AgentLogs(log_dir=str(RunLayout.agent_logs(folder))),
    )
    argv = ["-u", "-m", WORKER_MODULE, "--plan", str(RunLayout.worker_plan(folder))]
    return config, argv


def _local_addr(plan: LaunchPlan, group: int | None) -> str | None:
    """MASTER_ADDR: loopback on one machine; a replica group's, where the other machines'
    groups reach its store (`plan.group_host`); else torch's choice (the host name)."""
    if group is not None:
        return plan.group_host
    if not plan.nodes.multi or plan.nodes.is_local:
        return rendezvous.LOOPBACK
    return None


class AgentLogs(DefaultLogsSpecs):
    """The agent's own logs, torch's way, except that the agent never reads a worker's
    error file.

    torch's agent parses a failed worker's error file (TORCHELASTIC_ERROR_FILE), and an empty
    or torn one (a full disk, a rank killed while writing it) makes the agent itself fail with
    a JSONDecodeError instead of reporting the worker's failure. The launcher needs none of
    it: its report comes from the rank's log, exit code and failure record. So workers still
    write theirs, where torch puts it, and the agent is handed os.devnull instead, as torch
    does itself when it keeps no logs."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        return dataclasses.replace(dest, error_files=dict.fromkeys(dest.error_files, os.devnull))


class AgentThread(threading.Thread):
    """The elastic agent, on a thread of its own: the main thread keeps the signals (a first
    Ctrl-C stops the run gracefully, a second at once) and the watchdog."""

    def __init__(
        self,
        config: LaunchConfig,
        argv: list[str],
        name: str = "elastic-agent",
        environment: dict[str, str] | None = None,
    ) -> None:
        """`environment`: variables of this agent's workers alone, set before they start (the
        agents share the launcher's own environment)."""
        super().__init__(name=name, daemon=True)
        self.config, self.argv = config, argv
        self.entrypoint = sys.executable
        if environment:  # `env` sets them, then becomes the interpreter (the same process)
            self.entrypoint = shutil.which("env") or "/usr/bin/env"
            self.argv = [*(f"{k}={v}" for k, v in environment.items()), sys.executable, *argv]
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            elastic_launch(self.config, self.entrypoint)(*self.argv)
        except BaseException as exc:
            self.error = exc


def quiet_elastic(debug: bool) -> None:
    # The agent's INFO/WARNING chatter repeats what the display shows; --debug brings it back.
    level = logging.INFO if debug else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def forked_workers(plan: LaunchPlan) -> Iterator[None]:
    """While open, the elastic agents of this process start their workers through fork
    servers (`plan.forks_workers`; else as new interpreters): one per environment an agent
    adds (a replica group's), so that each worker's environment, as tools read it from its
    start (/proc), holds it. Open it once the workers' environment is set: a server starts
    with it, and so do the libraries it loads."""
    if not plan.forks_workers:
        yield
        return
    servers = ForkServers(plan.run_dir, plan.recipe_libraries)
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

    def __init__(self, run_dir: Path, libraries: tuple[str, ...]) -> None:
        self._run_dir, self._libraries = run_dir, libraries
        self._servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
        self._lock = threading.Lock()

    def get(self, added: dict[str, str]) -> ForkServer:
        key = tuple(sorted(added.items()))
        with self._lock:
            if key not in self._servers:
                self._servers[key] = ForkServer(self._run_dir, added, self._libraries)
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
    """The launcher's half of `launcher.worker.fork_server` (its protocol is described there)."""

    def __init__(
        self,
        run_dir: Path,
        added: dict[str, str],
        libraries: tuple[str, ...] = (),
        ready_timeout_s: float = 120.0,
    ) -> None:
        """`added`: variables added to this process's environment for the server and its
        workers; `libraries`: modules it imports beside its own list (the recipe's)."""
        self._control, theirs = socket.socketpair()
        self._lock = threading.Lock()
        self._ready: bool | None = None
        self._ready_timeout_s = ready_timeout_s
        argv = [sys.executable, "-m", FORK_SERVER_MODULE, "--fd", str(theirs.fileno())]
        # In its own session: Ctrl-C at the terminal is for the launcher and the workers.
        # Nothing of its own reaches the terminal; its workers get the launcher's streams.
        self._proc = subprocess.Popen(
            [*argv, "--run-dir", str(run_dir)],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **added},
            start_new_session=True,
        )
        theirs.close()
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
        request = pickle.dumps((argv, env, os.getcwd()))
        with self._lock:
            socket.send_fds(self._control, [request], [*streams, theirs.fileno()])
        theirs.close()
        return ForkedProcess(argv, mine)

    def close(self) -> None:
        """Ends the server (EOF on its control socket); its workers have ended by now. One
        that forked nothing (the run ended first) is killed, not left to finish importing."""
        self._control.close()
        with self._lock:
            if not self._ready:
                self._proc.kill()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ForkedProcess:
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

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


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
