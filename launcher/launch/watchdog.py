"""The hang watchdog: follows every rank's heartbeat (telemetry/rank-N.beat) and names the
ranks that have made no progress for `launch.stall_timeout` seconds, with where they are.

Times are the launcher's own clock, taken when a record is seen, so clocks of other machines
never matter. A rank that is stuck shows where in its Python stack: the watchdog sends it
SIGUSR2, and faulthandler (registered by the worker) writes every thread's stack into its log.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from launcher.metrics.telemetry import read_beat
from launcher.rundir.layout import RunLayout

# faulthandler's header of the thread that handled the signal, then its innermost frame.
_CURRENT = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):$", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)


# Before its first step a rank builds, restores and (XLA) compiles: it gets this many timeouts.
STARTUP_TIMEOUTS = 3


@dataclass
class RankState:
    seen: float  # launcher clock when the heartbeat last changed
    beat: tuple[int, int, int] | None = None  # step, beats, pid
    step_changes: int = 0  # by this process: a restore moves the step once, then steps do

    @property
    def stepped(self) -> bool:
        """Whether this process has surely finished a step of its own."""
        return self.step_changes >= 2


@dataclass(frozen=True)
class Stall:
    rank: int
    step: int | None
    idle_s: float
    where: str | None  # innermost Python frame, e.g. "recipe.py:12 in loss"


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
        now = time.monotonic()
        for rank, state in self.ranks.items():
            beat = read_beat(self.layout.beat(rank))
            if beat is None or beat == state.beat:
                continue
            if state.beat is None or beat[2] != state.beat[2]:  # a new process (a restart)
                state.step_changes = 0
            elif beat[0] != state.beat[0]:
                state.step_changes += 1
            state.beat, state.seen = beat, now
        idle = {r: now - s.seen for r, s in self.ranks.items()}
        limit = {
            r: self.timeout_s * (1 if s.stepped else STARTUP_TIMEOUTS)
            for r, s in self.ranks.items()
        }
        if not any(idle[r] > limit[r] for r in idle):
            return []
        # One rank hung holds the others in their next collective: all of them are idle, and
        # where each one stands is what tells them apart.
        stalled = [r for r, t in idle.items() if t > self.timeout_s / 2]
        self._request_stacks(stalled)
        return [
            Stall(r, self._step(r), idle[r], innermost_frame(self.layout.log(r))) for r in stalled
        ]

    def _step(self, rank: int) -> int | None:
        beat = self.ranks[rank].beat
        return beat[0] if beat else None

    def _request_stacks(self, ranks: list[int], wait_s: float = 1.5) -> None:
        # Only processes of this run: a pid in a heartbeat may be long gone, and reused.
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        asked = False
        for rank in ranks:
            beat = self.ranks[rank].beat
            if beat is None or beat[2] not in ours:
                continue
            try:
                os.kill(beat[2], signal.SIGUSR2)
                asked = True
            except ProcessLookupError:
                pass
        if asked:
            time.sleep(wait_s)  # faulthandler writes at once; the log is then complete


def innermost_frame(log_file: Path) -> str | None:
    """Where the thread that took the last SIGUSR2 was, from faulthandler's dump in the log."""
    try:
        log = log_file.read_text(errors="replace")
    except OSError:
        return None
    dumps = list(_CURRENT.finditer(log))
    if not dumps:
        return None
    frame = _FRAME.search(log, dumps[-1].end())
    if frame is None:
        return None
    return f"{frame['file']}:{frame['line']} in {frame['func']}"


def describe(stall: Stall) -> str:
    step = "before its first step" if stall.step is None else f"after step {stall.step}"
    where = stall.where or "stack unknown"
    waiting = "site-packages/torch" in where or "/torch/" in where
    note = " (waiting inside torch, likely for another rank)" if waiting else ""
    return f"rank {stall.rank}: no progress for {stall.idle_s:.0f} s {step}, at {where}{note}"
