"""The hang watchdog: follows every rank's heartbeat (telemetry/rank-N.beat) and names the
ranks that have made no progress for `launch.stall_timeout` seconds, with where they are.

Times are the launcher's own clock, taken when a record is seen, so clocks of other machines
never matter. A rank that is stuck shows where in its Python stack: the watchdog sends it
SIGUSR2, and faulthandler (registered by the worker) writes every thread's stack into its log.
A rank whose stack is in torch's DataLoader waiting for a batch is waiting for one of its
DataLoader worker processes, which is named as such: the stack's innermost frame (a pipe's
`select`) would say nothing of it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from launcher.metrics.telemetry import Beat, read_beat
from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import read_log_tail

# faulthandler's header of the thread that handled the signal, then its innermost frame.
_CURRENT = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):$", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
# The frames of a DataLoader iterator waiting for a batch from its worker processes.
_LOADER_WAIT = re.compile(r'/torch/utils/data/dataloader\.py", line \d+ in _(try_)?get_data$', re.M)


# /proc states of a process that runs nothing until it is continued (`T`, `t`).
_HALTED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)

# Before its first step a rank builds, restores and (XLA) compiles: it gets this many timeouts.
STARTUP_TIMEOUTS = 3
# After a stop request, a rank has this long (or 4 of its slowest steps) to finish its step.
STOP_GRACE_S = 10.0


@dataclass
class RankState:
    seen: float  # launcher clock when the heartbeat last changed
    beat: Beat | None = None
    longest_gap: float = 0.0  # between two heartbeats of its own steps: its slowest step
    gaps: int = 0  # how many such gaps were seen

    @property
    def stepped(self) -> bool:
        """Whether this process has finished a step of its own (its heartbeat says so)."""
        return self.beat is not None and self.beat.stepped


@dataclass(frozen=True)
class Stall:
    rank: int
    step: int | None
    idle_s: float
    where: str | None  # innermost Python frame, e.g. "recipe.py:12 in loss"
    stopped: bool = False  # by SIGSTOP (or a debugger): it runs no code, so it says nothing
    loader_wait: bool = False  # waiting for a batch from a DataLoader worker process


class Watchdog:
    def __init__(self, run_dir: Path, ranks: range, timeout_s: float | None) -> None:
        self.layout = RunLayout(run_dir)
        self.timeout_s = timeout_s
        now = time.monotonic()
        # Before its first heartbeat a rank is starting up: that counts from now.
        self.ranks = {rank: RankState(seen=now) for rank in ranks}

    def check(self) -> list[Stall]:
        """The stalled ranks, or [] (always [] with the watchdog off)."""
        if self.timeout_s is None:
            return []
        self._update()
        now = time.monotonic()
        late = any(
            now - s.seen > self.timeout_s * (1 if s.stepped else STARTUP_TIMEOUTS)
            for s in self.ranks.values()
        )
        return self._stalls(self.timeout_s / 2) if late else []

    def check_after_stop(self, asked_s: float, grace_s: float = STOP_GRACE_S) -> list[Stall]:
        """A stop was asked for `asked_s` seconds ago: every rank finishes the step it is in,
        saves and stops. The ranks, if one of them has not finished that step within `grace_s`
        or 4 of its slowest steps: it is hung, and nothing will be saved. Catches a hung run
        at Ctrl-C without waiting for the stall timeout. Only for a rank whose pace is known
        (two steps seen) in a step or in an evaluation past its first batch (it beats after
        every batch); one saving, or before its first evaluation batch (workers start, XLA
        compiles), has the stall timeout."""
        self._update()
        asked_at = time.monotonic() - asked_s
        late = any(
            s.gaps >= 2  # its step time is known
            and s.beat is not None
            and (not s.beat.busy or s.beat.evaluating)  # a save takes as long as it takes
            and s.seen < asked_at
            and asked_s > max(grace_s, 4 * s.longest_gap)
            for s in self.ranks.values()
        )
        return self._stalls(grace_s / 2) if late else []

    def _update(self) -> None:
        now = time.monotonic()
        for state, beat in zip(self.ranks.values(), self._beats(), strict=True):
            if beat is None or beat == state.beat:
                continue
            if state.stepped and state.beat is not None and beat.pid == state.beat.pid:
                state.longest_gap = max(state.longest_gap, now - state.seen)
                state.gaps += 1
            elif state.beat is None or beat.pid != state.beat.pid:  # a new process
                state.longest_gap, state.gaps = 0.0, 0
            state.beat, state.seen = beat, now

    def _stalls(self, idle_s: float) -> list[Stall]:
        """Every rank idle for over `idle_s`, with where it stands: one rank hung holds the
        others in their next collective, and where each one is tells them apart."""
        now = time.monotonic()
        idle = {r: now - s.seen for r, s in self.ranks.items()}
        stalled = [r for r, t in idle.items() if t > idle_s]
        self._request_stacks(stalled)
        stalls = []
        for r in stalled:
            where, loader_wait = where_in_stack(self.layout.log(r))
            stalls.append(Stall(r, self._step(r), idle[r], where, self._stopped(r), loader_wait))
        return stalls

    def _stopped(self, rank: int) -> bool:
        beat = self.ranks[rank].beat
        try:
            return beat is not None and psutil.Process(beat.pid).status() in _HALTED
        except psutil.Error:
            return False

    def _beats(self) -> list[Beat | None]:
        return [read_beat(self.layout.beat(rank)) for rank in self.ranks]

    def _step(self, rank: int) -> int | None:
        beat = self.ranks[rank].beat
        return beat.step if beat else None

    def _request_stacks(self, ranks: list[int], wait_s: float = 1.5) -> None:
        # Only processes of this run: a pid in a heartbeat may be long gone, and reused.
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        asked: dict[Path, int] = {}
        for rank in ranks:
            beat = self.ranks[rank].beat
            if beat is None or beat.pid not in ours:
                continue
            log = self.layout.log(rank)
            try:
                size = log.stat().st_size
                os.kill(beat.pid, signal.SIGUSR2)
                asked[log] = size
            except (ProcessLookupError, OSError):
                pass
        # faulthandler writes from C at once, without the GIL: a log that grew has its dump
        # (give it a moment to finish); a stopped process never writes.
        deadline = time.monotonic() + wait_s
        while asked and time.monotonic() < deadline:
            time.sleep(0.05)
            if all(_size(log) > size for log, size in asked.items()):
                time.sleep(0.1)
                return


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def where_in_stack(log_file: Path) -> tuple[str | None, bool]:
    """The innermost frame of the thread that took the last SIGUSR2 (faulthandler's dump in
    the log), and whether that thread waits in a DataLoader for a batch from its workers."""
    log = read_log_tail(log_file)
    dumps = list(_CURRENT.finditer(log))
    if not dumps:
        return None, False
    end = log.find("\n\n", dumps[-1].end())  # faulthandler ends each thread's stack so
    stack = log[dumps[-1].end() : end if end >= 0 else len(log)]
    frame = _FRAME.search(stack)
    where = f"{frame['file']}:{frame['line']} in {frame['func']}" if frame else None
    return where, _LOADER_WAIT.search(stack) is not None


def describe(stall: Stall) -> str:
    step = "before its first step" if stall.step is None else f"after step {stall.step}"
    if stall.stopped:
        return (
            f"rank {stall.rank}: no progress for {stall.idle_s:.0f} s {step}: its process is "
            "stopped (SIGSTOP, or a debugger holds it) and runs nothing until SIGCONT"
        )
    where = stall.where or "stack unknown"
    if stall.loader_wait:
        return (
            f"rank {stall.rank}: no progress for {stall.idle_s:.0f} s {step}, waiting for a "
            f"DataLoader worker (data.num_workers), at {where}"
        )
    waiting = "site-packages/torch" in where or "/torch/" in where
    note = " (waiting inside torch, likely for another rank)" if waiting else ""
    return f"rank {stall.rank}: no progress for {stall.idle_s:.0f} s {step}, at {where}{note}"
