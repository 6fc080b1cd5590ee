"""Reading the JSON-lines files a run writes while it runs (metrics.jsonl, a rank's status
records) without waiting for it: a line still being written, or cut short by a killed
process, is skipped, never an error; a missing file holds no records.

A resumed run's metrics.jsonl holds a marker where it resumed (`RESUMED_AT`); the steps after
its checkpoint that the run had done before it was killed are done again after the marker.
Every reader sees each step once, with the newer values, and never the marker itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.metrics.progress import value
from launcher.metrics.record_fields import NOT_METRICS, RESUMED_AT
from launcher.rundir.reading import parse_json_or_none, read_tail

# The most of a metrics file read: its newest records (over a million steps of a few metrics).
MAX_METRICS_BYTES = 256 << 20


def read_records(path: Path, limit: int = MAX_METRICS_BYTES) -> list[dict[str, Any]]:
    """Every whole record of the file, oldest first (of its last `limit` bytes)."""
    return without_replays(_parse((read_tail(path, limit) or b"").splitlines()))


def tail_records(path: Path, size: int = 16384) -> list[dict[str, Any]]:
    """The whole records among the file's last `size` bytes: the newest, read at once from a
    file of any length."""
    return read_records(path, size)


def _parse(lines: list[bytes]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        record = parse_json_or_none(line)  # None: half-written, or not JSON at all
        if isinstance(record, dict):
            records.append(record)
    return records


def without_replays(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records without the resume markers, and without the records before each marker
    of steps past its step: those steps were done again after it."""
    kept: list[dict[str, Any]] = []
    for record in records:
        if RESUMED_AT not in record:
            kept.append(record)
        elif (resumed_at := value(record, RESUMED_AT)) is not None:
            kept = [r for r in kept if (step := value(r, "step")) is None or step <= resumed_at]
    return kept


def metric_names(records: list[dict[str, Any]]) -> list[str]:
    """The metrics the records hold, in the order they first appear."""
    names: dict[str, None] = {}
    for record in without_replays(records):
        for key in record:
            if key not in NOT_METRICS and value(record, key) is not None:
                names.setdefault(key)
    return list(names)


def series(
    records: list[dict[str, Any]], metric: str, x: str = "step"
) -> tuple[list[float], list[float]]:
    """One metric's curve: by `step` (a step a resumed run did again keeps its newest value)
    or by `time` (seconds since the first record)."""
    records = without_replays(records)
    if x == "time":
        start = next((value(r, "time") for r in records if value(r, "time") is not None), 0.0)
        points = [(value(r, "time"), value(r, metric)) for r in records]
        pairs = [(t - (start or 0.0), y) for t, y in points if t is not None and y is not None]
    else:
        newest: dict[float, float] = {}
        for record in records:
            step, y = value(record, "step"), value(record, metric)
            if step is not None and y is not None:
                newest[step] = y
        pairs = sorted(newest.items())
    return [p[0] for p in pairs], [p[1] for p in pairs]
