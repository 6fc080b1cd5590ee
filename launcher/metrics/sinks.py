"""Where rank 0's metrics records go besides metrics.jsonl: sinks (the run's progress.json
always, then the trackers `log.trackers` names: TensorBoard's event files, W&B, MLflow, a CSV
file), every one fed by one background writer.

A slow disk or tracker must not be a slow step, and one that fails must not fail the run: the
step only puts each record on a queue, and a thread of its own hands it to every sink. A sink
that raises warns once and gets nothing more; the other sinks and the run go on, and
metrics.jsonl (`launcher.metrics.telemetry`) keeps every record whatever happens here.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from launcher.config.spec import RunSpec


@dataclass(frozen=True)
class RunEnd:
    """How this process's part of the run ended, for the trackers' run status."""

    # finished: trained to the end (or stopped early); stopped: asked to stop (a preemption,
    # Ctrl-C), to be resumed; failed: an error.
    status: Literal["finished", "stopped", "failed"]
    best_checkpoint: str | None = None


# The longest the first step waits for the sinks to start (a tracker's import and connection,
# seconds of CPU that would otherwise be taken from the first steps); a tracker still
# connecting after it goes on in the background.
START_WAIT_S = 15.0
# How often a tracker delivers what it was sent (`launcher.metrics.trackers.base`), and how
# long the writer waits for a record before it has the sinks flush anyway.
PUSH_EVERY_S = 1.0


class Sink(Protocol):
    """A destination for metrics records. Only the background writer's thread calls it, so
    it may block and it may raise."""

    name: str  # the spec key that turns it on, for its warnings: "tensorboard", "mlflow"
    where: str  # what it writes to, for its warnings: a folder, a URL

    def start(self) -> None:
        """Before the first record: a tracker connects (from the writer's thread)."""

    def write(self, record: dict[str, Any]) -> None:
        """One record: `step` and `time`, then metrics by name (`loss`, `val/loss`, ...)."""

    def flush(self) -> None:
        """Makes what was written visible to readers: called when the queue runs empty."""

    def end(self, outcome: RunEnd) -> None:
        """The run's end, after its last record: a tracker marks its run finished or not."""

    def close(self) -> None: ...


def build_sinks(spec: RunSpec, run_dir: Path) -> list[Sink]:
    """The sinks the `log` section turns on, for rank 0 of a run in `run_dir`, after the
    progress that `train runs` reads (always on)."""
    from launcher.metrics.progress import ProgressSink, about_run
    from launcher.metrics.trackers import build_trackers

    return [ProgressSink(run_dir, about_run(spec)), *build_trackers(spec, run_dir)]


class BackgroundWriter:
    """Takes records at once (`write`) and hands each to every sink from a thread of its own;
    `close` writes what is left and waits for it, for at most `close_timeout` seconds."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        capacity: int = 10_000,  # records waiting; more are dropped (with one warning)
        close_timeout: float = 10.0,
    ) -> None:
        self.sinks = list(sinks)
        self._close_timeout = close_timeout
        # None ends the queue; a RunEnd before it is the run's end, for the trackers.
        self._queue: queue.Queue[dict[str, Any] | RunEnd | None] = queue.Queue(maxsize=capacity)
        self._dropping = False
        self._closed = False
        # A daemon: a process that ends without close() (a failed start) never waits for it.
        self._thread = threading.Thread(target=self._drain, name="metrics-sinks", daemon=True)
        self._started = threading.Event()
        self._thread.start()

    def wait_started(self, timeout: float = START_WAIT_S) -> None:
        """Waits, at most `timeout` seconds, for every sink to have started."""
        self._started.wait(timeout)

    def write(self, record: dict[str, Any]) -> None:
        """Queues one record; never blocks, never raises."""
        if self._closed or not self._thread.is_alive():  # closed, or every sink gave up
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            if not self._dropping:
                self._dropping = True
                names = ", ".join(sink.name for sink in self.sinks)
                warn(
                    "metrics", f"{self._queue.maxsize} records wait for {names}; dropping new ones"
                )

    def close(self, outcome: RunEnd | None = None) -> None:
        """Writes what is queued, tells the sinks how the run ended (`outcome`: None where
        it did not end here, a failed start), closes them and ends the thread; gives up (with
        a warning) after `close_timeout` seconds rather than hold up the end of the run."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self._close_timeout
        try:
            if self._thread.is_alive():
                if outcome is not None:  # after the rest
                    self._queue.put(outcome, timeout=self._close_timeout)
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            self._thread.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        if self._thread.is_alive():
            waiting = ", ".join(sink.name for sink in self.sinks)
            warn(
                "metrics",
                f"{waiting} still writing after {self._close_timeout:g} s; the last records "
                "may be lost",
            )

    def _drain(self) -> None:
        live = [sink for sink in self.sinks if self._hand(sink, "start")]
        self._started.set()
        while live and (record := self._next()) is not None:
            if record == "idle":  # what a sink holds back for its next push goes now
                live = [sink for sink in live if self._hand(sink, "flush")]
                continue
            if isinstance(record, RunEnd):
                live = [sink for sink in live if self._hand(sink, "end", record)]
                continue
            live = [sink for sink in live if self._hand(sink, "write", record)]
            if self._queue.empty():  # a burst written: readers may see it now
                live = [sink for sink in live if self._hand(sink, "flush")]
        for sink in live:
            self._hand(sink, "close")

    def _next(self) -> dict[str, Any] | RunEnd | str | None:
        try:
            return self._queue.get(timeout=PUSH_EVERY_S)
        except queue.Empty:
            return "idle"

    @staticmethod
    def _hand(sink: Sink, method: str, *args: Any) -> bool:
        """Calls a sink; whether it still works. One that fails is closed and left alone."""
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # a full disk, a lost mount, a tracker down: the run goes on
            warn(
                sink.name,
                f"could not write to {sink.where} ({type(exc).__name__}: {exc}); nothing more "
                "goes there this run, training goes on",
            )
            with contextlib.suppress(Exception):  # the warning above says what failed
                sink.close()
            return False
        return True


def warn(who: str, what: str) -> None:
    # One line on this rank's stderr (its log and the display), as the profiler's warnings.
    print(f"WARNING: {who}: {what}", file=sys.stderr, flush=True)
