"""What every experiment tracker shares as a sink of rank 0's background writer
(`launcher.metrics.sinks`): it connects from its own thread, is sent each record's
metrics once (a resume does steps again that an earlier attempt sent), and keeps its run's id
and its newest step sent in trackers.json, so that a resumed or restarted run goes on with the
same tracker run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.config.spec import RunSpec
from launcher.metrics.record_fields import NOT_METRICS, is_number
from launcher.metrics.sink_types import PUSH_EVERY_S, RunEnd
from launcher.metrics.trackers.records import SentSteps, TrackerRecords
from launcher.rundir.layout import RunLayout


def record_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's metrics, by their metrics.jsonl names (`loss`, `val/loss`, `lr`)."""
    return {k: float(v) for k, v in record.items() if k not in NOT_METRICS and is_number(v)}


def flat_params(spec: RunSpec) -> dict[str, str]:
    """The resolved spec as `section.key` -> text, for trackers whose hyperparameters are flat
    strings (MLflow): a list or mapping as JSON, unset keys as `null`."""
    import json

    flat: dict[str, str] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value if isinstance(value, str) else json.dumps(value)

    add("", spec.model_dump(mode="json", by_alias=True))
    return flat


class TrackerSink:
    """A tracker as a `Sink`. Subclasses say how to connect to the tracker and go on with an
    earlier run (`connect`), send metrics (`send`), flush, mark the run's end and disconnect."""

    name = "tracker"  # the tracker's name in log.trackers: also its warnings' and entry's
    # A push at most once a second: a tracker's request per log line, a few ms each, would
    # take that much CPU from training at every step of a fast run. The sink's thread flushes
    # when its queue has been empty that long, so nothing waits longer than that.
    flush_every = PUSH_EVERY_S

    def __init__(self, spec: RunSpec, run_dir: Path, records: TrackerRecords) -> None:
        self.spec = spec
        self.layout = RunLayout(run_dir)
        self.records = records
        self.where = self.name  # until connected: then the server or folder
        self._sent = SentSteps({})  # until connected

    @classmethod
    def for_run(cls, spec: RunSpec, run_dir: Path, records: TrackerRecords) -> TrackerSink:
        """The sink of this tracker for the run in `run_dir` (how the registry builds it)."""
        return cls(spec, run_dir, records)

    def connect(self, earlier: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Opens the tracker's run: the one `earlier` (this tracker's trackers.json entry, of
        an earlier attempt) names where there is one. Returns the fields that name the run
        now, and whether it is the earlier one."""
        raise NotImplementedError

    def already_sent(self, earlier: dict[str, Any]) -> SentSteps:
        """What the tracker run that `connect` went on with holds: by default what the
        earlier attempts recorded having sent it."""
        return SentSteps(earlier)

    def send(self, step: int, metrics: dict[str, float], record: dict[str, Any]) -> None:
        raise NotImplementedError

    def push(self) -> None:
        """Delivers what `send` buffered, and makes it visible (the tracker's own flush):
        at most once every PUSH_EVERY_S seconds, and at the end."""

    def finish(self, outcome: RunEnd) -> None:
        raise NotImplementedError

    def disconnect(self) -> None:
        """Closes what `connect` opened."""

    # The Sink interface, called by this sink's own thread only.

    def start(self) -> None:
        earlier = self.records.get(self.name)
        fields, same_run = self.connect(earlier)
        # A new tracker run has been sent nothing.
        self._sent = self.already_sent(earlier) if same_run else SentSteps({})
        self.records.update(self.name, **fields, **self._sent.fields())
        self.records.save()

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        metrics = self._sent.unsent(step, record_metrics(record))
        if metrics:
            self.send(step, metrics, record)
            self._sent.sent(step, metrics)

    def flush(self) -> None:
        self.push()
        # After the tracker has them: a record of steps sent that it lost would skip them.
        self.records.update(self.name, **self._sent.fields())
        self.records.save()

    def end(self, outcome: RunEnd) -> None:
        self.finish(outcome)  # the sink's thread flushed what it was sent just before

    def close(self) -> None:
        self.disconnect()
