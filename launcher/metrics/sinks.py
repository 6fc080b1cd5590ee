"""Where rank 0's metrics records go besides metrics.jsonl: sinks (the run's progress.json
always, then the trackers `log.trackers` names: TensorBoard's event files, W&B, MLflow, a CSV
file), each fed by a thread of its own.

A slow disk or tracker must not be a slow step, nor hold up another sink: the step only puts
each record on every sink's queue, and each sink's own thread hands it its records, so a sink
that blocks (a tracker whose server stopped answering) only ever delays itself. A sink that
cannot keep up drops its own oldest records (its queue is bounded) and says so once; a sink
that raises warns once and gets nothing more. The other sinks and the run go on,
metrics.jsonl (`launcher.metrics.telemetry`) keeps every record whatever happens here, and the
end of the run says how many records each sink missed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.config.spec import RunSpec
from launcher.metrics.progress import ProgressSink, about_run
from launcher.metrics.sink_types import RunEnd, Sink, warn
from launcher.metrics.trackers.records import TrackerRecords
from launcher.metrics.trackers.registry import tracker_class
from launcher.rundir.layout import RunLayout

# The longest the first step waits for the sinks to start (a tracker's import and connection,
# seconds of CPU that would otherwise be taken from the first steps); a tracker still
# connecting after it goes on in the background.
START_WAIT_S = 15.0
# The records each sink's queue holds: past it, its oldest are dropped.
QUEUE_RECORDS = 10_000
# The longest the end of a run waits for the sinks to write what they were given.
CLOSE_TIMEOUT_S = 10.0


def build_sinks(spec: RunSpec, run_dir: Path) -> list[Sink]:
    """The sinks the `log` section turns on, for rank 0 of a run in `run_dir`: the progress
    that `train runs` reads (always on), then the trackers `log.trackers` names, in its order,
    each built by its class in the registry (`launcher.metrics.trackers.registry`), whose
    module is imported only now."""
    records = TrackerRecords(RunLayout(run_dir).trackers)  # one for all: each rewrites it whole
    trackers = [tracker_class(name).for_run(spec, run_dir, records) for name in spec.log.trackers]
    return [ProgressSink(run_dir, about_run(spec)), *trackers]


class BackgroundWriter:
    """Takes records at once (`write`) and hands each to every sink, each from a thread of its
    own (`SinkThread`); `close` has each write what is left and waits for them all together,
    for at most `close_timeout` seconds."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        capacity: int = QUEUE_RECORDS,  # records waiting per sink; past it, its oldest go
        close_timeout: float = CLOSE_TIMEOUT_S,
    ) -> None:
        self.sinks = list(sinks)
        self._close_timeout = close_timeout
        self._threads = [SinkThread(sink, capacity) for sink in self.sinks]
        self._closed = False

    def wait_started(self, timeout: float = START_WAIT_S) -> None:
        """Waits, at most `timeout` seconds, for every sink to have started."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.started.wait(max(0.0, deadline - time.monotonic()))

    def write(self, record: dict[str, Any]) -> None:
        """Queues one record for every sink; never blocks, never raises."""
        if not self._closed:
            for thread in self._threads:
                thread.put(record)

    def close(self, outcome: RunEnd | None = None) -> None:
        """Has every sink write what is queued, tells them how the run ended (`outcome`: None
        where it did not end here, a failed start) and closes them; gives up on those still
        writing after `close_timeout` seconds (with a warning) rather than hold up the end of
        the run. Then says, for each sink that missed records, how many."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self._close_timeout
        for thread in self._threads:
            thread.finish(outcome)
        for thread in self._threads:  # together: the wait is the slowest sink's, not the sum
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = ", ".join(t.sink.name for t in self._threads if t.is_alive())
        if stuck:
            warn("metrics", f"{stuck} still writing after {self._close_timeout:g} s; the last "
                 "records may be lost")  # fmt: skip
        for thread in self._threads:
            if missed := thread.missed:
                warn(thread.sink.name, f"{missed} of {thread.offered} records did not reach "
                     f"{thread.sink.where} (metrics.jsonl has every one)")  # fmt: skip

    def missed(self) -> dict[str, int]:
        """By sink name: the records that did not reach it (dropped, or lost with a failure,
        or still unwritten when `close` gave up)."""
        return {thread.sink.name: thread.missed for thread in self._threads}


class SinkThread:
    """One sink, its bounded queue, and the thread that hands it its records: a sink that
    blocks only ever delays itself, and one that cannot keep up drops its own oldest records."""

    def __init__(self, sink: Sink, capacity: int = QUEUE_RECORDS) -> None:
        self.sink = sink
        self._capacity = capacity
        self._flush_every = float(getattr(sink, "flush_every", 0.0))
        self._queue: deque[dict[str, Any]] = deque()
        # Guards the queue, the end asked for and the counts (the step puts, the thread takes).
        self._ready = threading.Condition()
        self._closing = False
        self._outcome: RunEnd | None = None
        self._gave_up = False
        self.offered = 0  # records put
        self._reached = 0  # records written and flushed
        self._dropped = 0
        self._unflushed = 0  # written since the last flush (this and the next: the thread's)
        self._flushed_at = time.monotonic()
        self.started = threading.Event()
        # A daemon: a process that ends without close() (a failed start) never waits for it.
        self._thread = threading.Thread(
            target=self._serve, name=f"metrics-{sink.name}", daemon=True
        )
        self._thread.start()

    @property
    def missed(self) -> int:
        with self._ready:
            return self.offered - self._reached

    def put(self, record: dict[str, Any]) -> None:
        """Queues a record; never blocks. A full queue drops its oldest first."""
        with self._ready:
            self.offered += 1
            if self._gave_up or self._closing:
                return
            first_drop = False
            if len(self._queue) >= self._capacity:
                self._queue.popleft()
                self._dropped += 1
                first_drop = self._dropped == 1
            self._queue.append(record)
            self._ready.notify()
        if first_drop:
            warn("metrics", f"{self._capacity} records wait for {self.sink.name}; dropping the "
                 "oldest ones (metrics.jsonl keeps every record)")  # fmt: skip

    def finish(self, outcome: RunEnd | None) -> None:
        """Asks for the rest of the queue, then the run's end (`outcome`, where there is one),
        then the sink's close; `join` waits for them."""
        with self._ready:
            self._closing, self._outcome = True, outcome
            self._ready.notify()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        try:
            working = self._call("start")
        finally:
            self.started.set()
        while working:
            records, closing = self._take()
            working = self._write(records) and self._flush_if_due(closing)
            if closing:
                break
        if working and self._outcome is not None:
            working = self._call("end", self._outcome)
        if working:
            self._call("close")

    def _take(self) -> tuple[list[dict[str, Any]], bool]:
        """What is queued (waiting for something, or until a flush is due), and whether the
        end was asked for."""
        wait = None
        if self._unflushed:
            wait = max(0.0, self._flushed_at + self._flush_every - time.monotonic())
        with self._ready:
            self._ready.wait_for(lambda: self._queue or self._closing, timeout=wait)
            records = list(self._queue)
            self._queue.clear()
            return records, self._closing

    def _write(self, records: list[dict[str, Any]]) -> bool:
        for record in records:
            if not self._call("write", record):
                return False
            self._unflushed += 1
        return True

    def _flush_if_due(self, closing: bool) -> bool:
        if not self._unflushed:
            return True
        if not closing and time.monotonic() - self._flushed_at < self._flush_every:
            return True
        if not self._call("flush"):
            return False
        with self._ready:
            self._reached += self._unflushed
        self._unflushed, self._flushed_at = 0, time.monotonic()
        return True

    def _call(self, method: str, *args: Any) -> bool:
        """Calls the sink; whether it still works. One that fails is closed and left alone."""
        sink = self.sink
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # a full disk, a lost mount, a tracker down: the run goes on
            with self._ready:
                self._gave_up = True
                self._queue.clear()
            warn(
                sink.name,
                f"could not write to {sink.where} ({type(exc).__name__}: {exc}); nothing more "
                "goes there this run, training goes on",
            )
            with contextlib.suppress(Exception):  # the warning above says what failed
                sink.close()
            return False
        return True
