"""trackers.json: what each experiment tracker needs to go on with the same tracker run when
the run resumes or restarts: its run's id, and the newest step (with the metrics of that
step) it was sent. Rank 0's background writer is the only one that reads or writes it.

A resumed run does again the steps after its checkpoint that the killed attempt had already
sent: a tracker keeps every value it is sent, so those are not sent twice (metrics.jsonl,
whose readers drop the older ones, keeps them all)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from launcher.rundir.atomic import write_atomic
from launcher.rundir.reading import read_head

_MOST_BYTES = 1 << 20


class TrackerRecords:
    """Every tracker's entry of one run's trackers.json, shared by its tracker sinks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(OSError, ValueError):  # none yet, or damaged: new runs
            found = json.loads(read_head(path, _MOST_BYTES) or b"{}")
            if isinstance(found, dict):
                self._entries = {k: v for k, v in found.items() if isinstance(v, dict)}
        self._changed = False

    def get(self, tracker: str) -> dict[str, Any]:
        return dict(self._entries.get(tracker, {}))

    def update(self, tracker: str, **fields: Any) -> None:
        entry = self._entries.setdefault(tracker, {})
        if any(entry.get(k) != v for k, v in fields.items()):
            entry.update(fields)
            self._changed = True

    def save(self) -> None:
        if self._changed:
            write_atomic(self.path, json.dumps(self._entries, indent=1))
            self._changed = False


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
