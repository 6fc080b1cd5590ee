"""Rank 0's TensorBoard event files (`log.tensorboard`), written in the background.

A slow disk must not be a slow step, and a disk that fails must not fail the run: the step
only puts each metrics record on a queue, and a thread of its own encodes and writes it. A
write that fails warns once and turns the events off; the run goes on. The folder and its
file appear with the first record (after metrics.jsonl has it), so an attempt that never
trained leaves no `tb/` behind.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from launcher.config.spec import LogSection
from launcher.metrics.telemetry import NOT_METRICS, is_number
from launcher.metrics.tensorboard_events import EventWriter
from launcher.rundir.layout import RunLayout

# An evaluation's own timing goes with its metrics, not under train/.
_RENAMED = {"eval_s": "val/eval_s"}


def scalar_tags(record: Mapping[str, Any]) -> dict[str, float]:
    """TensorBoard's tags for a metrics record: `val/...` as they are, `eval_s` as
    `val/eval_s`, every other number under `train/` (loss, lr, samples_per_s, TFLOP/s,
    memory); the step, epoch, time and anything not a number are left out."""
    tags = {}
    for key, value in record.items():
        if key in NOT_METRICS or not is_number(value):
            continue
        tag = _RENAMED.get(key) or (key if key.startswith("val/") else f"train/{key}")
        tags[tag] = float(value)
    return tags


class TensorBoardSink:
    """Takes metrics records at once (`write`), whatever the disk does; `close` writes what
    is left and waits for it, for at most `close_timeout` seconds."""

    def __init__(
        self,
        directory: Path,
        writer: Callable[[Path], EventWriter] = EventWriter,  # tests pass a slow or broken one
        capacity: int = 10_000,  # records waiting; more are dropped (with one warning)
        close_timeout: float = 10.0,
    ) -> None:
        self.directory = directory
        self._open = writer
        self._close_timeout = close_timeout
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=capacity)
        self._dropping = False
        self._closed = False
        # A daemon: a process that ends without close() (a failed start) never waits for it.
        self._thread = threading.Thread(target=self._drain, name="tensorboard", daemon=True)
        self._thread.start()

    @classmethod
    def for_rank(cls, log: LogSection, run_dir: Path, is_main: bool) -> TensorBoardSink | None:
        """Rank 0's sink into RUN_DIR/tb/, or None: another rank, or `log.tensorboard: false`."""
        if not (is_main and log.tensorboard):
            return None
        return cls(RunLayout(run_dir).tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        """Queues one metrics record (a dict with `step`); never blocks, never raises."""
        if self._closed or not self._thread.is_alive():  # closed, or the writer gave up
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            if not self._dropping:
                self._dropping = True
                _warn(f"{self._queue.maxsize} records wait for the disk; dropping new ones")

    def close(self) -> None:
        """Writes what is queued, closes the file and ends the thread; gives up (with a
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
            _warn(f"still writing after {self._close_timeout:g} s; the last events may be lost")

    def _drain(self) -> None:
        writer = None
        try:
            while (record := self._queue.get()) is not None:
                tags = scalar_tags(record)
                if not tags:
                    continue
                if writer is None:
                    writer = self._open(self.directory)
                writer.add_scalars(int(record["step"]), tags, record.get("time"))
                if self._queue.empty():  # a burst written: TensorBoard may read it now
                    writer.flush()
            if writer is not None:
                writer.close()
        except Exception as exc:  # a full disk, a lost mount: the run goes on without events
            _warn(
                f"could not write to {self.directory} ({type(exc).__name__}: {exc}); no more "
                "events this run, training goes on"
            )
            if writer is not None:
                with contextlib.suppress(Exception):  # the warning above says what failed
                    writer.close()


def _warn(what: str) -> None:
    # One line on this rank's stderr (its log and the display), as the profiler's warnings.
    print(f"WARNING: log.tensorboard: {what}", file=sys.stderr, flush=True)
