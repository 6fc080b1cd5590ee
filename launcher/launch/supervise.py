"""Supervising a running node: the elastic agent's thread, signals, the live display and the
hang watchdog, until the workers end, hang, or are stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import psutil
from rich.console import Console

from launcher.launch import rendezvous
from launcher.launch.agent import AgentThread
from launcher.launch.closed_output import flush_standard_streams
from launcher.launch.display import RunDisplay
from launcher.launch.display.lines import format_ranks
from launcher.launch.plan import LaunchPlan
from launcher.launch.watchdog import Stall, Watchdog
from launcher.metrics.telemetry import read_beat
from launcher.stop_signals import SIGTERM_REPEAT_WINDOW_S

SIGNAL_EXIT = {"SIGHUP": 129, "SIGINT": 130, "SIGTERM": 143}


@dataclass
class Outcome:
    """How supervision ended: the agent's error (None: the workers finished), or the signals
    taken, or the ranks that hung."""

    error: BaseException | None = None
    signals: int = 0  # SIGINT, SIGTERM and SIGHUP taken
    signal_name: str = ""
    stalls: list[Stall] = field(default_factory=list)
    untrained: bool = False  # stopped before any rank finished a step: nothing to save
    folder_gone: bool = False  # the run folder was deleted or moved while the run ran
    fault: str = ""  # what ended the run, said already (the Lighthouse was lost)

    @property
    def exit_code_of_signal(self) -> int:
        return SIGNAL_EXIT.get(self.signal_name, 1)


class AgentWatch:
    """What supervision asks of the agents besides their threads: none for one agent; the
    replica groups' under fault tolerance (`launcher.replicas.torchft_coordinator`)."""

    def ended(self, agent: AgentThread) -> None:
        """`agent` ended while others go on."""

    def fault(self) -> str | None:
        """A reason to stop the run now, said in one line (the Lighthouse was lost)."""
        return None

    def outcome_error(self, agents: list[AgentThread]) -> BaseException | None:
        return agents[0].error


def supervise(
    plan: LaunchPlan,
    agents: list[AgentThread],
    view: NodeView,
    console: Console,
    spare: int,
    watch: AgentWatch | None = None,
) -> Outcome:
    """Runs the agents until their workers end. A first signal asks every rank to finish its
    step and save (the stop-request file), or kills every worker while none has finished a
    step (nothing to save); a second one, or a hang, kills every worker. `spare`: a process
    of ours that stays (the reaper)."""
    stop_request = plan.layout.stop_request
    folder = FolderWatch(plan.run_dir)
    watch = watch or AgentWatch()
    running = list(agents)
    with view, Signals() as signals:
        for agent in agents:
            agent.start()
        while running:
            running[0].join(0.2)
            for agent in [a for a in running if not a.is_alive()]:
                running.remove(agent)
                if running:
                    watch.ended(agent)
            if (fault := watch.fault()) is not None:
                console.print(f"error: {fault}", style="bold red", highlight=False, soft_wrap=True)
                kill_workers(spare)
                return Outcome(RuntimeError(fault), signals.received, signals.name, fault=fault)
            if folder.gone() and not folder.stop_in_new_folder(stop_request, console):
                kill_workers(spare)
                return Outcome(None, signals.received, signals.name, folder_gone=True)
            if signals.received == 1 and not signals.forwarded:
                signals.forwarded = True
                if view.untrained():
                    kill_workers(spare)
                    return Outcome(None, 1, signals.name, untrained=True)
                stop_request.touch()
                save = " and saves a checkpoint" if plan.spec.checkpoint.enabled else ""
                console.print(
                    f"{signals.name}: every rank finishes its step{save}; "
                    "press Ctrl-C again to stop at once",
                    style="yellow",
                )
            stalls = [] if signals.received >= 2 else view.stalls(signals.asked_s())
            if signals.received >= 2 or stalls:
                kill_workers(spare)
                return Outcome(None, signals.received, signals.name, stalls)
    error = watch.outcome_error(agents)
    return Outcome(error, signals.received, signals.name, folder_gone=folder.said)


class FolderWatch:
    """Whether the run folder is still the one the run started in. Deleted (or moved), the
    ranks go on writing into files no one can find: their heartbeats too, so the watchdog
    would call a healthy run hung. Said at once, and the run stops with a checkpoint where
    it can (`stop_in_new_folder`)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.identity = self._identity()
        self.said = False
        self._missed = 0  # looks in a row that found another folder, or none

    def _identity(self) -> tuple[int, int] | None:
        """The folder's (device, inode); None where there is none. Any other error (a
        network file system's ESTALE or EIO) says nothing: the folder is taken to be there."""
        try:
            info = os.stat(self.run_dir)
        except FileNotFoundError:
            return None
        except OSError:
            return self.identity
        return info.st_dev, info.st_ino

    def gone(self) -> bool:
        """Whether it went away (said once): two looks in a row, so that a network file
        system's passing hiccup is not taken for it."""
        if self.said or self.identity is None:
            return False
        self._missed = self._missed + 1 if self._identity() != self.identity else 0
        return self._missed >= 2

    def stop_in_new_folder(self, stop_request: Path, console: Console) -> bool:
        """Makes a new folder at the run folder's path and asks the ranks to stop there: each
        finishes its step and saves into it. False where the folder cannot be made."""
        self.said = True
        console.print(
            f"error: the run folder {self.run_dir} was deleted or moved while the run ran",
            style="bold red",
            highlight=False,
            soft_wrap=True,
        )
        try:
            stop_request.parent.mkdir(parents=True, exist_ok=True)
            stop_request.touch()
        except OSError as exc:
            console.print(f"cannot make it again ({exc.strerror}): stopping at once")
            return False
        console.print(
            "every rank finishes its step, saves a checkpoint into a new folder at that path, "
            "and stops (its logs and metrics went with the old one)",
            highlight=False,
            soft_wrap=True,
        )
        return True


class NodeView:
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
            plan.layout.beat(rank).unlink(missing_ok=True)
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

    def untrained(self) -> bool:
        """Whether no rank has finished a step past the checkpoint it started from: a stop
        would save nothing. Never on several nodes: the others' ranks are out of sight."""
        if self.plan.nodes.multi:
            return False
        with self._lock:
            ranks = self.ranks or range(0)
        beats = [read_beat(self.plan.layout.beat(rank)) for rank in ranks]
        return not any(beat is not None and beat.stepped for beat in beats)

    def stalls(self, stop_asked_s: float | None = None) -> list[Stall]:
        """The hung ranks: for the stall timeout, or since a stop was asked for
        `stop_asked_s` seconds ago (`Watchdog.check_after_stop`)."""
        with self._lock:
            if self._watchdog is None:
                return []
            if stop_asked_s is not None and (hung := self._watchdog.check_after_stop(stop_asked_s)):
                return hung
            return self._watchdog.check()

    def __enter__(self) -> NodeView:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if self._display is not None:
                self._display.stop()


class Signals:
    """Counts SIGINT, SIGTERM and SIGHUP while the run is going."""

    def __init__(self) -> None:
        self.received = 0
        self.name = ""
        self.forwarded = False
        self._at = 0.0
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def asked_s(self) -> float | None:
        """Seconds since the stop was asked for (the first signal), or None."""
        return time.monotonic() - self._first if self.received else None

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        repeated = now - self._at < SIGTERM_REPEAT_WINDOW_S
        if signum == signal.SIGTERM and self.name == "SIGTERM" and repeated:
            return
        self.received += 1
        self.name = signal.Signals(signum).name
        self._at = now
        self._first = self._first or now

    def __enter__(self) -> Signals:
        # SIGHUP: the terminal or ssh session went away; treated as a request to stop.
        for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def exit_now(code: int) -> NoReturn:
    """Ends the launcher while the elastic agent's thread is still inside torch: a normal
    interpreter exit would tear down its C++ objects under it and abort (SIGABRT)."""
    flush_standard_streams()
    os._exit(code)


def kill_workers(spare: int) -> None:
    """Every process this launcher started, and theirs (spawned replicas, data workers), but
    `spare` (the reaper: it ends what left the tree, once the launcher has ended)."""
    children = [p for p in psutil.Process().children(recursive=True) if p.pid != spare]
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=10)
