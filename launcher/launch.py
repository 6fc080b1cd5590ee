"""Running a `LaunchPlan`: the run folder, torch.distributed's elastic agent, the live display.

One process per device, started by the same elastic agent that torchrun uses; each runs
`launcher.worker`, which writes its own log file that the display follows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
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
from launcher.failure_report import failure_panel
from launcher.plan import LaunchPlan
from launcher.ranks import format_ranks
from launcher.spec_loader import spec_to_yaml
from launcher.strategies import strategy_info
from launcher.telemetry import STOP_FILE
from launcher.watchdog import Stall, Watchdog
from launcher.watchdog import describe as describe_stall

SIGNAL_EXIT = {"SIGHUP": 129, "SIGINT": 130, "SIGTERM": 143}


def execute(plan: LaunchPlan, console: Console | None = None) -> int:
    """Runs the plan to the end and returns the process exit code."""
    # Whatever the user's umask, nothing the run writes (folders, logs, checkpoints, by the
    # launcher or its workers, who inherit this) is writable by other users.
    os.umask(os.umask(0) | 0o002)
    spec_file = prepare_run_dir(plan)
    # Left by an earlier attempt in this folder: its stop request and its heartbeats.
    (plan.run_dir / STOP_FILE).unlink(missing_ok=True)
    for beat in (plan.run_dir / "telemetry").glob("*.beat"):
        beat.unlink(missing_ok=True)
    console = console or Console()
    _quiet_elastic(plan.debug)
    os.environ.update(plan.worker_env())  # the elastic agent passes its environment on
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.nproc,
        run_id=f"{plan.spec.run.name}-{uuid.uuid4().hex[:8]}",
        # c10d's rendezvous, on stores that listen on loopback only, each on a free port of
        # its own (so two runs never race for one); the workers' MASTER_ADDR is loopback too.
        rdzv_backend=rendezvous.register(),
        rdzv_endpoint=f"{rendezvous.LOOPBACK}:0",
        local_addr=rendezvous.LOOPBACK,
        max_restarts=plan.spec.launch.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.run_dir / ".elastic")),
    )
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
    ranks = range(plan.devices.replica_logs)
    display = RunDisplay(
        plan.run_dir, ranks=ranks, show=plan.show_ranks, console=console, title=plan.spec.run.name
    )
    agent = _Agent(config, args)
    watchdog = Watchdog(plan.run_dir, ranks, plan.spec.launch.stall_timeout)
    stalls: list[Stall] = []
    with display, _Signals() as signals:
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
            if signals.received >= 2 or (stalls := watchdog.check()):
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
        raise RunError(
            f"torch.distributed.elastic failed: {type(agent.error).__name__}: {agent.error}",
            hint="Run again with --debug to see its traceback and logs.",
        ) from agent.error
    if signals.received:
        latest = checkpoint.latest_complete(plan.run_dir)
        console.print(
            f"stopped by {signals.name}"
            + (
                f"; saved {latest}. Continue with: --resume {plan.run_dir}"
                if latest
                else " (checkpoints are off: nothing to resume)"
            ),
            highlight=False,
            soft_wrap=True,
        )
        return SIGNAL_EXIT.get(signals.name, 1)
    console.print(f"finished: {plan.run_dir}", highlight=False, soft_wrap=True)
    return 0


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
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received += 1
        self.name = signal.Signals(signum).name

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
    """Creates the run folder (never world-writable) and saves the resolved spec into it."""
    # A new run claims its folder atomically: two launches never share one.
    fresh = plan.resume_from is None and not (
        plan.run_dir.is_dir() and not any(plan.run_dir.iterdir())
    )
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=not fresh, mode=0o755)
        (plan.run_dir / "logs").mkdir(exist_ok=True)
    except FileExistsError:
        raise UsageError(f"--run-dir {plan.run_dir}: appeared while starting; run again") from None
    except OSError as exc:
        raise UsageError(f"--run-dir {plan.run_dir}: cannot create it ({exc.strerror})") from None
    if not os.access(plan.run_dir, os.W_OK):
        raise UsageError(f"--run-dir {plan.run_dir}: not writable")
    spec_file = plan.run_dir / "spec.yaml"
    if spec_file.exists():
        # A resumed run keeps the spec it started with; this attempt's goes beside it.
        n = len(list(plan.run_dir.glob("spec.resume-*.yaml"))) + 1
        spec_file = plan.run_dir / f"spec.resume-{n}.yaml"
    spec_file.write_text(spec_to_yaml(plan.spec))
    return spec_file


def _report_failure(exc: ChildFailedError, plan: LaunchPlan, console: Console) -> int:
    rank, failure = root_cause(exc.failures, plan.run_dir)
    code = failure.exitcode
    log = plan.run_dir / "logs" / f"rank-{rank}.log"
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
