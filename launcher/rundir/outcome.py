"""How a run ended, as its launcher records it in the run folder (`RunLayout.outcome`); the
launcher (`launch/execute.py`) writes it, `train runs` (`launcher/runs/`) reads it:

    {"status": "finished", "exit_code": 0, "reason": "", "started": 1795597465.1,
     "ended": 1795597466.5, "host": "node01", "pid": 3660}

`status` is one of:
- `finished`: the run ended by itself (its steps are done, or an early stop), exit code 0;
- `failed`: a rank failed or hung, or the launcher itself failed; `exit_code` is `train`'s;
- `stopped`: a stop asked for from outside (Ctrl-C, SIGTERM, SIGHUP: a preemption, or
  another node's stop request); `reason` names it. Such a run resumes where it saved.

`started` is when this attempt began (a resumed run's latest attempt). A folder with no record
and no launcher holding its lock ended without a word (its launcher was killed, or its machine
lost): `train runs` calls it `interrupted`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass

from launcher.errors import INTERRUPTED, LauncherError
from launcher.rundir import fault_events
from launcher.rundir.atomic import write_atomic
from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import read_json_or_none

STATUSES = ("finished", "failed", "stopped")
# Held in the run folder while the run runs: more than a record takes.
RESERVED_BYTES = 16384


@dataclass(frozen=True)
class RunOutcome:
    status: str
    exit_code: int
    ended: float
    started: float | None = None
    reason: str = ""


def read_outcome(layout: RunLayout) -> RunOutcome | None:
    """The recorded outcome, or None: none was written, or it cannot be read."""
    record = read_json_or_none(layout.outcome, "record")
    if not isinstance(record, dict):
        return None
    try:
        started = record.get("started")
        outcome = RunOutcome(
            status=str(record["status"]),
            exit_code=int(record["exit_code"]),
            ended=_finite(record["ended"]),
            started=None if started is None else _finite(started),
            reason=str(record.get("reason") or ""),
        )
    except (ValueError, KeyError, TypeError, OverflowError):  # OverflowError: 1e999
        return None
    return outcome if outcome.status in STATUSES else None


def _finite(found: object) -> float:
    number = float(found)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise ValueError(f"not a finite time: {found}")
    return number


class OutcomeRecorder:
    """Records how the launch ended: `record` when it returns, or the exception it raises
    (a KeyboardInterrupt is a stop). The record of an earlier attempt is removed on entry, so
    that an attempt killed outright leaves none. `enabled`: this node writes the run's files."""

    def __init__(self, layout: RunLayout, enabled: bool = True) -> None:
        self.layout, self.enabled = layout, enabled
        self.started = time.time()
        self.done = False

    def __enter__(self) -> OutcomeRecorder:
        if self.enabled:
            self.layout.outcome.unlink(missing_ok=True)
            # Room for the record, held from the start: a disk that fills up during the run
            # would leave none for it at the end.
            with contextlib.suppress(OSError):
                # Random: zeros take no room on a file system that compresses (ZFS, btrfs).
                self.layout.outcome_reserve.write_bytes(os.urandom(RESERVED_BYTES))
        return self

    def record(self, exit_code: int, stopped: bool = False, reason: str = "") -> None:
        status = "stopped" if stopped else "finished" if exit_code == 0 else "failed"
        self.done = True
        if not self.enabled:
            return
        outcome = RunOutcome(status, exit_code, round(time.time(), 3), self.started, reason)
        record = {**asdict(outcome), "host": socket.gethostname(), "pid": os.getpid()}
        if losses := fault_events.summarize(fault_events.read(self.layout.fault_events)):
            record["replica_group_losses"] = losses  # fault_tolerance's
        text = json.dumps(record, indent=1) + "\n"
        try:
            write_atomic(self.layout.outcome, text)
        except OSError:  # a full disk: the reserve's room is the record's
            self.layout.outcome_reserve.unlink(missing_ok=True)
            # Should it fail again, the run's own result is unchanged (`train runs` then
            # calls it interrupted).
            with contextlib.suppress(OSError):
                write_atomic(self.layout.outcome, text)
        with contextlib.suppress(OSError):
            self.layout.outcome_reserve.unlink(missing_ok=True)

    def __exit__(self, kind: type[BaseException] | None, error: object, tb: object) -> None:
        if self.done or kind is None:
            return
        if issubclass(kind, KeyboardInterrupt):
            self.record(INTERRUPTED, stopped=True, reason="SIGINT")
        elif isinstance(error, LauncherError):
            self.record(error.exit_code, reason=error.message.splitlines()[0][:200])
        else:
            self.record(1, reason=f"{kind.__name__} in the launcher")
