"""Where rank 0's metrics records go besides metrics.jsonl: sinks (the run's progress.json
always, TensorBoard's event files, experiment trackers next), every one fed by one background
writer.

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
from pathlib import Path
from typing import Any, Protocol

from launcher.config.spec import RunSpec
from launcher.rundir.layout import RunLayout


class Sink(Protocol):
    """A destination for metrics records. Only the background writer's thread calls it, so
    it may block and it may raise."""

    name: str  # the spec key that turns it on, for its warnings: "log.tensorboard"
    where: str  # what it writes to, for its warnings: a folder, a URL

    def write(self, record: dict[str, Any]) -> None:
        """One record: `step` and `time`, then metrics by name (`loss`, `val/loss`, ...)."""

    def flush(self) -> None:
        """Makes what was written visible to readers: called when the queue runs empty."""

    def close(self) -> None: ...


def build_sinks(spec: RunSpec, run_dir: Path) -> list[Sink]:
    """The sinks the `log` section turns on, for rank 0 of a run in `run_dir`, after the
    progress that `train runs` reads (always on)."""
    from launcher.metrics.progress import ProgressSink, about_run

    sinks: list[Sink] = [ProgressSink(run_dir, about_run(spec))]
    if spec.log.tensorboard:
        from launcher.metrics.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(RunLayout(run_dir).tensorboard_dir))
    return sinks


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
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=capacity)
        self._dropping = False
        self._closed = False
        # A daemon: a process that ends without close() (a failed start) never waits for it.
        self._thread = threading.Thread(target=self._drain, name="metrics-sinks", daemon=True)
        self._thread.start()

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
                _warn(
                    "metrics", f"{self._queue.maxsize} records wait for {names}; dropping new ones"
                )

    def close(self) -> None:
        """Writes what is queued, closes the sinks and ends the thread; gives up (with a
        warning) after `close_timeout` seconds rather than hold up the end of the run."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self._close_timeout
        try:
            if self._thread.is_alive():
                self._queue.put(None, timeout=self._close_timeout)  # the end, after the rest
            self._thread.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        if self._thread.is_alive():
            waiting = ", ".join(sink.name for sink in self.sinks)
            _warn(
                "metrics",
                f"{waiting} still writing after {self._close_timeout:g} s; the last records "
                "may be lost",
            )

    def _drain(self) -> None:
        live = list(self.sinks)
        while live and (record := self._queue.get()) is not None:
            live = [sink for sink in live if self._hand(sink, "write", record)]
            if self._queue.empty():  # a burst written: readers may see it now
                live = [sink for sink in live if self._hand(sink, "flush")]
        for sink in live:
            self._hand(sink, "close")

    @staticmethod
    def _hand(sink: Sink, method: str, *args: Any) -> bool:
        """Calls a sink; whether it still works. One that fails is closed and left alone."""
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # a full disk, a lost mount, a tracker down: the run goes on
            _warn(
                sink.name,
                f"could not write to {sink.where} ({type(exc).__name__}: {exc}); nothing more "
                "goes there this run, training goes on",
            )
            with contextlib.suppress(Exception):  # the warning above says what failed
                sink.close()
            return False
        return True


def _warn(who: str, what: str) -> None:
    # One line on this rank's stderr (its log and the display), as the profiler's warnings.
    print(f"WARNING: {who}: {what}", file=sys.stderr, flush=True)
