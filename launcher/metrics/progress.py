"""A run's progress, kept current and small: its newest step and, for each metric, the last
value and the lowest and highest with their steps. `train runs` reads this (progress.json)
instead of the run's whole metrics.jsonl, so that listing runs costs the same at any length.

Rank 0's background writer keeps it (`ProgressSink`, one of `launcher.metrics.sinks`, with a
thread of its own, so no tracker ever holds it up): every metrics record updates it, and it is
rewritten whole (`write_atomic`) when its queue runs empty, off the training thread. Its size
grows with the number of metrics a run logs, never with its steps.

The same fold reads a metrics file (`from_lines`): a resumed run's sink starts from the file.
(`train runs` reads the end of the metrics file of a run written before progress.json with
numpy, for its few metrics: `launcher.runs.metrics_scan.tail_progress`.) Records before a
resume marker of steps past its step were done again after it, and count once (as in
`launcher.runs.metrics_file`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.metrics.record_fields import NOT_METRICS, RESUMED_AT, is_number
from launcher.rundir.atomic import write_atomic
from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import open_regular, parse_json_or_none, read_json_or_none

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec
    from launcher.metrics.sink_types import RunEnd

_CHUNK = 1 << 20


def value(record: dict[str, Any], metric: str) -> float | None:
    """The record's number for `metric`, or None where it has none: not a number, or not a
    finite one (a run stopped on a NaN loss wrote it; no table or plot can hold it)."""
    found = record.get(metric)
    if not is_number(found):
        return None
    try:
        number = float(found)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return number if math.isfinite(number) else None


@dataclass
class Extremes:
    """One metric's last value, and its lowest and highest with their steps."""

    last: float
    low: float
    low_step: int | None
    high: float
    high_step: int | None

    def add(self, number: float, step: int | None) -> None:
        self.last = number
        if number < self.low:
            self.low, self.low_step = number, step
        if number > self.high:
            self.high, self.high_step = number, step


def monitored(spec: RunSpec | None) -> tuple[str, str]:
    """The evaluation metric a run is judged by, and its mode: checkpoint.monitor, else
    early_stop.monitor, else val/loss (lowest)."""
    for section in (spec.checkpoint, spec.early_stop) if spec is not None else ():
        if section.monitor:
            return section.monitor, section.mode
    return "val/loss", "min"


def about_run(spec: RunSpec) -> dict[str, Any]:
    """What `train runs` would read the spec for, kept in progress.json: reading a spec costs
    more than all the rest of a run's row."""
    metric, mode = monitored(spec)
    return {"name": spec.run.name, "max_steps": spec.train.max_steps, "monitor": metric,
            "mode": mode}  # fmt: skip


@dataclass
class Progress:
    step: int | None = None  # of the newest record
    metrics: dict[str, Extremes] = field(default_factory=dict)
    about: dict[str, Any] = field(default_factory=dict)  # `about_run`: none in a fallback

    def add(self, record: dict[str, Any]) -> None:
        """One metrics record (a resume marker is not one: see `from_lines`)."""
        found = value(record, "step")
        step = int(found) if found is not None else None
        if step is not None:
            self.step = step
        for key in record:
            if key in NOT_METRICS or (number := value(record, key)) is None:
                continue
            if (extremes := self.metrics.get(key)) is None:
                self.metrics[key] = Extremes(number, number, step, number, step)
            else:
                extremes.add(number, step)

    def best(self, metric: str, mode: str = "min") -> tuple[float, int | None] | None:
        """The metric's best value ("min" or "max") and its step."""
        found = self.metrics.get(metric)
        if found is None:
            return None
        return (found.high, found.high_step) if mode == "max" else (found.low, found.low_step)

    def last(self, metric: str) -> float | None:
        found = self.metrics.get(metric)
        return found.last if found is not None else None

    def to_json(self) -> str:
        metrics = {
            name: [e.last, e.low, e.low_step, e.high, e.high_step]
            for name, e in self.metrics.items()
        }
        return json.dumps({"step": self.step, "metrics": metrics, "about": self.about})

    @classmethod
    def from_record(cls, record: Any) -> Progress:
        """progress.json's record, parsed; raises ValueError, TypeError, KeyError or
        AttributeError where it is not one."""
        step = record["step"]
        about = record.get("about") or {}
        progress = cls(int(step) if step is not None else None, about=_about(about))
        for name, (last, low, low_step, high, high_step) in record["metrics"].items():
            progress.metrics[str(name)] = Extremes(
                float(last), float(low), _step(low_step), float(high), _step(high_step)
            )
        return progress

    @classmethod
    def from_lines(cls, lines: Callable[[], Iterable[bytes]]) -> Progress:
        """The progress a metrics file's lines hold (`lines` gives them, once per pass). Two
        passes: the first finds the resume markers, the second leaves out the records they
        replaced. Memory: the markers, never the lines."""
        markers = [(i, r) for i, line in enumerate(lines()) if (r := _marker(line)) is not None]
        # A record is replaced where any later marker resumed before its step.
        limits, later_min = [], math.inf
        for index, resumed_at in reversed(markers):
            later_min = min(later_min, resumed_at)
            limits.append((index, later_min))
        limits.reverse()
        progress, upcoming = cls(), 0
        for index, line in enumerate(lines()):
            while upcoming < len(limits) and limits[upcoming][0] < index:
                upcoming += 1
            limit = limits[upcoming][1] if upcoming < len(limits) else math.inf
            record = _record(line)
            if record is None or RESUMED_AT in record:
                continue
            step = value(record, "step")
            if step is None or step <= limit:
                progress.add(record)
        return progress

    @classmethod
    def from_file(cls, path: Path) -> Progress:
        """The progress of a metrics file, read a chunk at a time."""
        return cls.from_lines(lambda: file_lines(path))


def _about(found: dict[str, Any]) -> dict[str, Any]:
    """The labels as read, each checked: anyone who can write into the run folder wrote them."""
    kinds = {"name": str, "max_steps": int, "monitor": str, "mode": str}
    about = {key: found[key] for key, kind in kinds.items() if isinstance(found.get(key), kind)}
    return about if len(about) == len(kinds) and about["mode"] in ("min", "max") else {}


def _step(found: Any) -> int | None:
    return int(found) if found is not None else None


def _record(line: bytes) -> dict[str, Any] | None:
    record = parse_json_or_none(line)  # None: half-written, not JSON at all, nested too deep
    return record if isinstance(record, dict) else None


def _marker(line: bytes) -> float | None:
    if RESUMED_AT.encode() not in line or (record := _record(line)) is None:
        return None
    return value(record, RESUMED_AT)


def read_progress(layout: RunLayout) -> Progress | None:
    """The run's progress.json, or None where it has none or it cannot be read (damaged, cut
    short, too large, nested too deep, not a regular file): its reader then falls back to the
    metrics file."""
    record = read_json_or_none(layout.progress, "record")
    if record is None:
        return None
    try:
        return Progress.from_record(record)
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
        return None


def file_lines(path: Path) -> Iterator[bytes]:
    """The whole lines of a metrics file, read a chunk at a time (a regular file only)."""
    with open_regular(path) as file:
        if file is None:
            return
        rest = b""
        while chunk := file.read(_CHUNK):
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            yield from lines
        if rest:
            yield rest


class ProgressSink:
    """progress.json, kept by rank 0's background writer (`launcher.metrics.sinks`)."""

    name = "progress.json"

    def __init__(self, run_dir: Path, about: dict[str, Any] | None = None) -> None:
        self.layout = RunLayout(run_dir)
        self.about = about or {}
        self.where = str(self.layout.progress)
        self._progress: Progress | None = None
        self._changed = False

    def start(self) -> None:
        pass  # its file appears with the first record

    def write(self, record: dict[str, Any]) -> None:
        if self._progress is None:
            # The file so far (a resumed run's earlier attempts; records of this one written
            # meanwhile count twice, which changes no last, lowest or highest value).
            self._progress = Progress.from_file(self.layout.metrics)
            self._progress.about = self.about
        self._progress.add(record)
        self._changed = True

    def flush(self) -> None:
        if self._progress is not None and self._changed:
            write_atomic(self.layout.progress, self._progress.to_json())
            self._changed = False

    def end(self, outcome: RunEnd) -> None:
        pass  # outcome.json, the launcher's, says how the run ended

    def close(self) -> None:
        self.flush()
