"""Which rank failed first, by itself: the one the failure report is about."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import Any

from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import read_json_or_none


def root_cause(failures: dict[int, Any], run_dir: Path | None = None) -> tuple[int, Any]:
    """The rank that failed first by itself, not one that failed or was stopped because of it.

    A rank killed by a signal from outside (SIGKILL by the OOM killer, SIGSEGV) comes first:
    its peers only see their connections drop. Then ranks that raised, by the time each one
    recorded, or for a rank that died before it could record (os._exit, a full disk), by its
    log's last write; ranks the agent stopped, last.
    """
    failed_at = failure_times(run_dir) if run_dir else {}
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
        return kind, failed_at.get(rank) or _died_at(run_dir, rank, failure), rank

    return min(failures.items(), key=order)


def _died_at(run_dir: Path | None, rank: int, failure: Any) -> float:
    """When a rank that left no failure record failed: its log's last write, which is right
    before it ended. The agent's own timestamp is a whole second (rounded down), so it would
    come before the precise records of the peers that failed because of this rank."""
    seen = float(failure.timestamp)
    if run_dir is not None:
        with contextlib.suppress(OSError):
            return min(seen + 1, RunLayout(run_dir).log(rank).stat().st_mtime)
    return seen


def failure_times(run_dir: Path) -> dict[int, tuple[float, int]]:
    """{rank: (when it failed, its pid)} from the records failed workers left."""
    times: dict[int, tuple[float, int]] = {}
    for path in RunLayout(run_dir).failures():
        record = read_json_or_none(path, "record")
        with contextlib.suppress(ValueError, KeyError, TypeError, OverflowError):
            times[int(record["rank"])] = (float(record["failed_at"]), int(record["pid"]))
    return times
