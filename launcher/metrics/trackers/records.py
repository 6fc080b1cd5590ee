"""trackers.json: what each experiment tracker needs to go on with the same tracker run when
the run resumes or restarts: its run's id, and the newest step (with the metrics of that
step) it was sent. Rank 0's tracker sinks are the only ones that read or write it, each from
its own thread.

    {"run_dir": "/runs/quickstart/20261127-080000",
     "trackers": {"mlflow": {"run_id": "...", "tracking_uri": "...", "step": 40, "keys": [...]}}}

A resumed run does again the steps after its checkpoint that the killed attempt had already
sent: a tracker keeps every value it is sent, so those are not sent twice (metrics.jsonl,
whose readers drop the older ones, keeps them all).

The file names the run folder it was written for: one copied into another run's folder must
not make that run log into the first run's tracker runs. Where it names another folder (a copy,
or a run folder moved since), or cannot be read (damaged, too large, nested too deeply), every
tracker starts a new tracker run, after one line saying why. A file written before it named
its folder (the trackers' entries alone) is taken as this folder's."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from launcher.metrics.sink_types import warn
from launcher.rundir.atomic import write_atomic
from launcher.rundir.reading import UnreadableJson, read_json


class TrackerRecords:
    """Every tracker's entry of one run's trackers.json (`path`, in the run folder), shared
    by its tracker sinks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.run_dir = str(path.parent.resolve())
        self._lock = threading.Lock()  # each tracker sink updates and saves from its thread
        self._entries = self._read()
        self._changed = False

    def _read(self) -> dict[str, dict[str, Any]]:
        """The entries of this run folder's file; none (and one line saying why) where it
        was written for another folder or cannot be read."""
        try:
            found = read_json(self.path, "trackers")
        except FileNotFoundError:
            return {}
        except UnreadableJson as exc:
            warn("trackers", f"{exc}; every tracker starts a new tracker run")
            return {}
        entries, written_for = _entries(found)
        if entries is None:
            warn("trackers", f"{self.path}: not a trackers record; every tracker starts a "
                 "new tracker run")  # fmt: skip
            return {}
        if written_for is not None and written_for != self.run_dir:
            warn("trackers", f"{self.path} was written for the run folder {written_for}, not "
                 "this one (a copy?); every tracker starts a new tracker run")  # fmt: skip
            return {}
        return entries

    def get(self, tracker: str) -> dict[str, Any]:
        with self._lock:
            return dict(self._entries.get(tracker, {}))

    def update(self, tracker: str, **fields: Any) -> None:
        with self._lock:
            entry = self._entries.setdefault(tracker, {})
            if any(entry.get(k) != v for k, v in fields.items()):
                entry.update(fields)
                self._changed = True

    def save(self) -> None:
        # Under the lock: two threads writing the one file at once would share its partial.
        with self._lock:
            if self._changed:
                record = {"run_dir": self.run_dir, "trackers": self._entries}
                write_atomic(self.path, json.dumps(record, indent=1))
                self._changed = False


def _entries(found: Any) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """A trackers.json's entries (None where it is not one) and the run folder it names (None
    in a file written before it named one)."""
    if not isinstance(found, dict):
        return None, None
    if "run_dir" not in found:  # the trackers' entries alone
        return {k: v for k, v in found.items() if isinstance(v, dict)}, None
    trackers, run_dir = found.get("trackers"), found["run_dir"]
    if not isinstance(trackers, dict) or not isinstance(run_dir, str):
        return None, None
    return {k: v for k, v in trackers.items() if isinstance(v, dict)}, run_dir


class SentSteps:
    """Which records a tracker was already sent, by an earlier attempt or this one: records are
    sent in step order, so the newest step and the metrics sent at it say it all."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self.step: int = int(entry.get("step", -1))
        self.keys: set[str] = set(entry.get("keys", ()))

    def unsent(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The metrics of a record at `step` not sent yet."""
        if step < self.step:
            return {}
        if step == self.step:
            return {k: v for k, v in metrics.items() if k not in self.keys}
        return metrics

    def sent(self, step: int, metrics: dict[str, float]) -> None:
        if step != self.step:
            self.step, self.keys = step, set()
        self.keys.update(metrics)

    def fields(self) -> dict[str, Any]:
        return {"step": self.step, "keys": sorted(self.keys)}
