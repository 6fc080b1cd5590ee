"""Running a `LaunchPlan`: the run folder, torch.distributed's elastic agent, the live display.

One process per device, started by the same elastic agent that torchrun uses; each runs
`launcher.worker`, which writes its own log file that the display follows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NoReturn

import psutil
from rich.console import Console
from rich.text import Text
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from launcher import checkpoint, rendezvous
from launcher.display import RunDisplay
from launcher.errors import RunError, UsageError
from launcher.failure_report import failure_panel, peer_lost
from launcher.plan import LaunchPlan
from launcher.ranks import format_ranks
from launcher.spec_loader import spec_to_yaml
from launcher.strategies import strategy_info
from launcher.telemetry import STOP_FILE, beat_path
from launcher.watchdog import Stall, Watchdog
from launcher.watchdog import describe as describe_stall

SIGNAL_EXIT = {"SIGHUP": 129, "SIGINT": 130, "SIGTERM": 143}


def execute(plan: LaunchPlan, console: Console | None = None) -> int:
    """Runs the plan to the end and returns the process exit code."""
    # Whatever the user's umask, nothing the run writes (folders, logs, checkpoints, by the
    # launcher or its workers, who inherit this) is writable by other users.
    os.umask(os.umask(0) | 0o002)
    spec_file = prepare_run_dir(plan)
    # Left by an earlier attempt in this folder (a requeued job's, say): its stop request.
    # Every node removes it before it joins, so never after the run has started.
    (plan.run_dir / STOP_FILE).unlink(missing_ok=True)
    console = console or Console()
    _quiet_elastic(plan.debug)
    os.environ.update(plan.worker_env())  # the elastic agent passes its environment on
    view = _NodeView(plan, console)
    config = _launch_config(plan, view)
    args = [
        "-u",
        "-m",
        "launcher.worker",
        "--run-dir",
        str(plan.run_dir),
        "--spec",
        str(spec_file),
        "--accelerator",
        plan.accelerator,
    ]
    if plan.resume_from is not None:
        args += ["--resume", str(plan.resume_from)]
    if strategy_info(plan.spec.launch.strategy).processes == "xla_spawn":
        args += ["--xla-spawn", "all" if plan.devices.spawn_all else "1"]
    verb = "resuming" if plan.resume_from else "starting"
    for note in plan.notes:
        console.print(Text("warning: ", style="bold yellow") + Text(note), soft_wrap=True)
    console.print(
        f"{verb} {plan.spec.run.name}: {plan.devices.count} x {plan.accelerator}, "
        f"strategy {plan.spec.launch.strategy}, run dir {plan.run_dir}",
        highlight=False,
        soft_wrap=True,
    )
    if plan.nodes.multi:
        console.print(plan.nodes.describe(), highlight=False, soft_wrap=True)
    agent = _Agent(config, args)
    stalls: list[Stall] = []
    with view, _Signals() as signals:
        agent.start()
        while agent.is_alive():
            agent.join(0.2)
            if signals.received == 1 and not signals.forwarded:
                signals.forwarded = True
                (plan.run_dir / STOP_FILE).touch()
                save = " and saves a checkpoint" if plan.spec.checkpoint.enabled else ""
                console.print(
                    f"{signals.name}: every rank finishes its step{save}; "
                    "press Ctrl-C again to stop at once",
                    style="yellow",
                )
            if signals.received >= 2 or (stalls := view.stalls()):
                _kill_workers()
                break
    if signals.received >= 2:
        console.print(
            f"stopped at once by a second {signals.name}; logs in {plan.run_dir / 'logs'}"
        )
        _exit_now(SIGNAL_EXIT.get(signals.name, 1))
    if stalls:
        _exit_now(_report_stall(stalls, plan, console))
    if isinstance(agent.error, ChildFailedError):
        return _report_failure(agent.error, plan, console)
    if isinstance(agent.error, SignalException):  # a signal the agent took (e.g. SIGHUP)
        console.print(f"stopped by {agent.error.sigval.name}; logs in {plan.run_dir / 'logs'}")
        return SIGNAL_EXIT.get(agent.error.sigval.name, 1)
    if agent.error is not None:  # the rendezvous or the agent itself, not a worker
        _explain_rendezvous_error(agent.error, plan)
        raise RunError(
            f"torch.distributed.elastic failed: {type(agent.error).__name__}: {agent.error}",
            hint="Run again with --debug to see its traceback and logs.",
        ) from agent.error
    # A stop asked for elsewhere: a worker's own SIGTERM (SLURM signals every process), or
    # another node's Ctrl-C when the nodes share the run folder.
    asked_elsewhere = not signals.received and (plan.run_dir / STOP_FILE).exists()
    if signals.received or asked_elsewhere:
        latest = checkpoint.latest_complete(plan.run_dir)
        resume = "latest" if plan.nodes.job_id else str(plan.run_dir)
        console.print(
            (f"stopped by {signals.name}" if signals.received else "stopped on request")
            + (
                f"; saved {latest}. Continue with: --resume {resume}"
                if latest
                else " (checkpoints are off: nothing to resume)"
            ),
            highlight=False,
            soft_wrap=True,
        )
        return SIGNAL_EXIT.get(signals.name, 1) if signals.received else 0
    console.print(f"finished: {plan.run_dir}", highlight=False, soft_wrap=True)
    return 0


def _launch_config(plan: LaunchPlan, view: _NodeView) -> LaunchConfig:
    nodes = plan.nodes
    node = rendezvous.NodeConfig(
        nproc=plan.nproc,
        spec_digest=hashlib.sha256(spec_to_yaml(plan.spec).encode()).hexdigest()[:12],
        node_rank=nodes.node_rank,
        loopback=not nodes.multi,
        on_round=view.follow,
    )
    local = not nodes.multi or nodes.is_local
    return LaunchConfig(
        min_nodes=nodes.min,
        max_nodes=nodes.max,
        nproc_per_node=plan.nproc,
        # The same on every node; a single node's own, so that two runs never share one.
        run_id=nodes.job_id if nodes.multi else f"{plan.spec.run.name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend=rendezvous.register(),
        # One node: c10d's rendezvous on stores that listen on loopback only, each on a free
        # port of its own (so two runs never race for one).
        rdzv_endpoint=nodes.endpoint if nodes.multi else f"{rendezvous.LOOPBACK}:0",
        rdzv_configs=node.rdzv_configs(),
        # The address the other nodes reach this one at: the workers' MASTER_ADDR on node 0.
        local_addr=rendezvous.LOOPBACK if local else None,
        max_restarts=plan.spec.launch.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.node_dir / ".elastic")),
    )


class _NodeView:
    """The display and the hang watchdog of this node's ranks. Which global ranks those are
    is known once a rendezvous round gives the node its group rank, and may change from one
    round to the next in an elastic run; `follow` is called before each round's workers."""

    def __init__(self, plan: LaunchPlan, console: Console) -> None:
        self.plan, self.console = plan, console
        self.ranks: range | None = None
        self._display: RunDisplay | None = None
        self._watchdog: Watchdog | None = None
        self._lock = threading.Lock()

    def follow(self, round: rendezvous.Round) -> None:
        plan = self.plan
        first = round.group_rank * plan.devices.replica_logs + plan.rank_offset
        ranks = range(first, first + plan.devices.replica_logs)
        # Left by an earlier attempt: a stale heartbeat would look like a stalled rank.
        for rank in ranks:
            beat_path(plan.run_dir, rank).unlink(missing_ok=True)
        with self._lock:
            self._watchdog = Watchdog(plan.run_dir, ranks, plan.spec.launch.stall_timeout)
            if ranks == self.ranks:
                return
            if self._display is not None:
                self._display.stop()
            if plan.nodes.multi:
                self.console.print(
                    f"node {round.group_rank} of {round.nodes} ({socket.gethostname()}): "
                    f"ranks {format_ranks(ranks)} of {round.nodes * len(ranks)}",
                    highlight=False,
                )
            self.ranks = ranks
            self._display = RunDisplay(
                plan.run_dir,
                ranks=ranks,
                show=plan.show_ranks,
                console=self.console,
                title=plan.spec.run.name,
            )
            self._display.start()

    def stalls(self) -> list[Stall]:
        with self._lock:
            return self._watchdog.check() if self._watchdog else []

    def __enter__(self) -> _NodeView:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if self._display is not None:
                self._display.stop()


class _Agent(threading.Thread):
    """torch.distributed's elastic agent, on a thread of its own: the main thread keeps the
    signals (a first Ctrl-C stops the run gracefully, a second at once) and the watchdog."""

    def __init__(self, config: LaunchConfig, args: list[str]) -> None:
        super().__init__(name="elastic-agent", daemon=True)
        self.config, self.args = config, args
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            elastic_launch(self.config, sys.executable)(*self.args)
        except BaseException as exc:
            self.error = exc


class _Signals:
    """Counts SIGINT, SIGTERM and SIGHUP while the run is going."""

    def __init__(self) -> None:
        self.received = 0
        self.name = ""
        self.forwarded = False
        self._at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        # SLURM's preemption can deliver one SIGTERM twice (slurmstepd signals the task, and
        # srun forwards its own): a second one that soon is not a request to stop at once.
        if signum == signal.SIGTERM and self.name == "SIGTERM" and now - self._at < 10:
            return
        self.received += 1
        self.name = signal.Signals(signum).name
        self._at = now

    def __enter__(self) -> _Signals:
        # SIGHUP: the terminal or ssh session went away; treated as a request to stop.
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _exit_now(code: int) -> NoReturn:
    """Ends the launcher while the elastic agent's thread is still inside torch: a normal
    interpreter exit would tear down its C++ objects under it and abort (SIGABRT)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _kill_workers() -> None:
    """Every process this launcher started, and theirs (spawned replicas, data workers)."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=10)


def prepare_run_dir(plan: LaunchPlan) -> Path:
    """Creates the run folder (never world-writable) and saves the resolved spec into it;
    returns the spec file this node's workers read."""
    # A new run claims its folder atomically: two launches never share one. The nodes of a
    # job share theirs, which whichever comes first creates.
    fresh = (
        plan.resume_from is None
        and plan.nodes.job_id is None
        and not (plan.run_dir.is_dir() and not any(plan.run_dir.iterdir()))
    )
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=not fresh, mode=0o755)
        (plan.run_dir / "logs").mkdir(exist_ok=True)
        plan.node_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"--run-dir {plan.run_dir}: appeared while starting; run again") from None
    except OSError as exc:
        raise UsageError(f"--run-dir {plan.run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(plan.run_dir, os.W_OK):
        raise UsageError(f"--run-dir {plan.run_dir}: not writable")
    text = spec_to_yaml(plan.spec)
    if plan.writes_shared_files:
        spec_file = plan.run_dir / "spec.yaml"
        if spec_file.exists():
            # A resumed run keeps the spec it started with; this attempt's goes beside it.
            n = len(list(plan.run_dir.glob("spec.resume-*.yaml"))) + 1
            spec_file = plan.run_dir / f"spec.resume-{n}.yaml"
        _write_atomic(spec_file, text)
        if plan.node_dir == plan.run_dir:
            return spec_file
    # Every node's workers read their own node's copy: it is there with or without storage
    # that the nodes share, and no node ever reads a file another is writing.
    _write_atomic(plan.node_dir / "spec.yaml", text)
    return plan.node_dir / "spec.yaml"


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(path)


def _report_failure(exc: ChildFailedError, plan: LaunchPlan, console: Console) -> int:
    rank, failure = root_cause(exc.failures, plan.run_dir)
    code = failure.exitcode
    log = plan.run_dir / "logs" / f"rank-{rank}.log"
    if plan.nodes.multi and peer_lost(log):
        console.print(
            Text("lost another node: ", style="bold red")
            + Text(
                f"rank {rank} on this node lost its connection to ranks on another node. The "
                "cause is most likely there: see that node's output (on shared storage, its "
                f"ranks' logs are in {plan.run_dir / 'logs'})."
            ),
            soft_wrap=True,
        )
    console.print(failure_panel(rank, socket.gethostname(), code, log))
    others = sorted(set(exc.failures) - {rank})
    failed = [r for r in others if exc.failures[r].exitcode > 0]
    stopped = [r for r in others if r not in failed]
    also = "; ".join(
        f"{label}: ranks {format_ranks(ranks)}"
        for label, ranks in (("also failed", failed), ("stopped because of it", stopped))
        if ranks
    )
    if also:
        console.print(also, highlight=False)
    if plan.spec.launch.max_restarts:
        console.print(f"gave up after {plan.spec.launch.max_restarts} restart(s)")
    # A worker's own usage error (exit 2) is still the user's input to fix.
    return code if code in (1, 2) else (128 - code if code < 0 else 1)


def _explain_rendezvous_error(error: BaseException, plan: LaunchPlan) -> None:
    """Rendezvous failures in the words of the flags that set them up."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    nodes = plan.nodes
    if isinstance(error, rendezvous.NodeMismatch):
        raise UsageError(f"the nodes of job {nodes.job_id} do not match: {error}") from error
    if isinstance(error, RendezvousTimeoutError) and nodes.multi:
        raise RunError(
            f"gave up waiting for {nodes.min} nodes at {nodes.endpoint} (job {nodes.job_id})",
            hint="Start the missing nodes with the same command (after a failure, with "
            "--resume latest), or check that they reach the endpoint.",
        ) from error
    if isinstance(error, RendezvousConnectionError) and nodes.multi:
        hosting = nodes.node_rank == 0
        raise RunError(
            f"--rdzv-endpoint {nodes.endpoint}: "
            + ("node 0 cannot host the rendezvous there" if hosting else "cannot reach it")
            + f" ({error.__cause__ or error})",
            hint="Choose a port that is free on node 0, the same on every node."
            if hosting
            else "Start node 0 (--node-rank 0) on that host, and check that the port is open "
            "between the nodes.",
        ) from error


def _report_stall(stalls: list[Stall], plan: LaunchPlan, console: Console) -> int:
    timeout = plan.spec.launch.stall_timeout
    console.print(
        Text(f"stopped: no progress for {timeout:g} s (launch.stall_timeout)", style="bold red")
    )
    for stall in sorted(stalls, key=lambda s: s.rank):
        console.print(describe_stall(stall), highlight=False, soft_wrap=True)
    console.print(
        f"Every stalled rank's Python stack is in its log ({plan.run_dir / 'logs'}).",
        highlight=False,
        soft_wrap=True,
    )
    return 1


def root_cause(failures: dict[int, Any], run_dir: Path | None = None) -> tuple[int, Any]:
    """The rank that failed first by itself, not one that failed or was stopped because of it.

    A rank killed by a signal from outside (SIGKILL by the OOM killer, SIGSEGV) comes first:
    its peers only see their connections drop. Then ranks that raised, by the time each one
    recorded (the agent's own timestamps are whole seconds); ranks the agent stopped, last.
    """
    failed_at = _failure_times(run_dir) if run_dir else {}
    # Only this attempt's records: an earlier attempt's rank had another pid.
    failed_at = {
        r: t for r, (t, pid) in failed_at.items() if r in failures and failures[r].pid == pid
    }

    def order(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, failure = item
        code = failure.exitcode
        if code < 0 and code != -signal.SIGTERM:
            kind = 0
        elif code > 0:
            kind = 1
        else:
            kind = 2
        return kind, failed_at.get(rank, float(failure.timestamp)), rank

    return min(failures.items(), key=order)


def _failure_times(run_dir: Path) -> dict[int, tuple[float, int]]:
    times: dict[int, tuple[float, int]] = {}
    for path in (run_dir / "telemetry").glob("rank-*.jsonl"):
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                if '"failed_at"' in line:
                    with contextlib.suppress(ValueError, KeyError):
                        record = json.loads(line)
                        times[int(record["rank"])] = (float(record["failed_at"]), record["pid"])
    return times


def _quiet_elastic(debug: bool) -> None:
    # The agent's INFO/WARNING chatter repeats what the display shows; --debug brings it back.
    level = logging.INFO if debug else logging.CRITICAL
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(level)


__all__ = ["RunError", "execute", "prepare_run_dir"]
