"""Files between workers and the launcher: a worker never blocks on a terminal or a pipe.

Workers write (paths: `launcher.rundir.layout`):
- their status records (telemetry/rank-N.jsonl), each with its pid: the live table;
- their heartbeat (telemetry/rank-N.beat), one short line rewritten in place after every step
  and save (`step beats pid start busy`, `Beat`; busy: 0, 1 saving, 2 evaluating): what the
  launcher's hang watchdog follows;
- a failure record (telemetry/rank-N.failed) when they fail: the root cause;
- rank 0's metrics averaged over all ranks (metrics.jsonl), and its timings (summary.json,
  the same size at any run length: `launcher.metrics.step_times`); each metrics record also
  goes to rank 0's sinks (`launcher.metrics.sinks`: the run's progress.json, TensorBoard's
  event files, the trackers), each fed by a thread of its own; summary.json ends with how many
  records each sink missed (`records_missed`). The fields of a record that are not metrics, and
  the resume marker, are `launcher.metrics.record_fields`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

from launcher.metrics.record_fields import RESUMED_AT
from launcher.metrics.step_times import StepTimes
from launcher.rundir.atomic import write_atomic
from launcher.rundir.layout import RunLayout
from launcher.rundir.reading import read_head

if TYPE_CHECKING:
    from launcher.metrics.sink_types import RunEnd, Sink


class Beat(NamedTuple):
    step: int  # the newest step done
    beats: int  # heartbeats so far: each one is news
    pid: int  # of the process: another one is a restart
    start: int  # the step this process started training from; -1 while it builds and restores
    busy: bool = False  # saving or evaluating: between steps, for as long as that takes
    evaluating: bool = False  # busy evaluating: it beats after every batch

    @property
    def stepped(self) -> bool:
        """Whether this process has finished two steps of its own (not one it restored): the
        first steps may compile (XLA compiles the second step's graph again)."""
        return self.start >= 0 and self.start + 1 < self.step


def read_beat(path: Path) -> Beat | None:
    """A heartbeat file's record, or None while there is none."""
    try:
        step, beats, pid, start, busy = (read_head(path, 256) or b"").split()
        return Beat(int(step), int(beats), int(pid), int(start), busy != b"0", busy == b"2")
    except ValueError:
        return None


class Telemetry:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        is_main: bool,
        attempt: int = 0,
        sinks: Sequence[Sink] = (),  # rank 0's: get every metrics record; closed by close()
    ) -> None:
        self.rank = rank
        self.is_main = is_main
        self.attempt = attempt
        self.started = time.time()
        self.first_step_end: float | None = None
        self.step_times = StepTimes()  # bounded: a list of every step would grow forever
        self.checkpoint_times: list[float] = []
        self.layout = layout = RunLayout(run_dir)
        layout.telemetry_dir.mkdir(exist_ok=True)
        # Held open for the whole run (closed by close()); line-buffered so each record lands whole.
        self._status: TextIO | None = open(layout.telemetry(rank), "a", buffering=1)  # noqa: SIM115
        self._metrics: TextIO | None = (
            open(layout.metrics, "a", buffering=1)  # noqa: SIM115
            if is_main
            else None
        )
        # One write in place per step: cheap at any step rate, and the file never grows.
        self._beat = os.open(layout.beat(rank), os.O_WRONLY | os.O_CREAT, 0o644)
        self._beats = 0
        self._start = -1
        self._summary: dict[str, Any] | None = None  # as written: the sinks' count joins it
        self._sinks = None
        if is_main and sinks:
            from launcher.metrics.sinks import BackgroundWriter

            self._sinks = BackgroundWriter(sinks)

    def sinks_started(self) -> None:
        """Before the first step: the sinks' start (a tracker's import and connection, seconds
        of CPU) overlaps the build, not the steps; bounded by START_WAIT_S."""
        if self._sinks is not None:
            self._sinks.wait_started()

    def beat(self, step: int, busy: bool = False, evaluating: bool = False) -> None:
        """The heartbeat: alive, and step `step` is done; `busy`: saving or evaluating,
        `evaluating`: busy evaluating (a beat after every batch)."""
        self._beats += 1
        state = 2 if evaluating else int(busy)
        record = f"{step:>12} {self._beats:>12} {os.getpid():>10} {self._start:>12} {state}\n"
        os.pwrite(self._beat, record.encode(), 0)

    def start_from(self, step: int) -> None:
        """Built and restored: training starts after `step` (the watchdog then knows a step of
        this process's own from a restored one, however fast steps go)."""
        self._start = step
        self.beat(step)

    def step_done(self, seconds: float) -> None:
        if self.first_step_end is None:
            self.first_step_end = time.time()
        self.step_times.add(seconds)

    def checkpoint_blocked(self, seconds: float, same_save: bool = False) -> None:
        """How long training waited for a checkpoint save (`same_save`: more of the last one)."""
        if same_save and self.checkpoint_times:
            self.checkpoint_times[-1] += seconds
        else:
            self.checkpoint_times.append(seconds)

    def status(self, **fields: Any) -> None:
        """A record of this rank's progress (step, loss, throughput) for the live table."""
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "attempt": self.attempt,
            "time": time.time(),
            **fields,
        }
        record["elapsed_s"] = round(record["time"] - self.started, 3)
        self._status = self._append(self._status, record)

    def metrics(self, **fields: Any) -> None:
        if self.is_main:
            record = {**fields, "time": round(time.time(), 3)}
            self._metrics = self._append(self._metrics, record)
            if self._sinks is not None:
                self._sinks.write(record)

    def _append(self, file: TextIO | None, record: dict[str, Any]) -> TextIO | None:
        """Appends a record; a file that fails (a full disk, a quota) is warned of once and
        written no more, as the sinks do: the records are a view of the run, not the run."""
        if file is None:
            return None
        try:
            file.write(json.dumps(record) + "\n")
            return file
        except OSError as exc:
            with contextlib.suppress(OSError):
                file.close()
            _warn(f"{file.name}: cannot write it ({exc.strerror or exc}); training goes on, "
                  "without these records from now on")  # fmt: skip
            return None

    def mark_resumed(self, step: int) -> None:
        """Rank 0: marks in metrics.jsonl that the run resumed from step `step`'s checkpoint,
        so that its readers count the steps done again after it once. Not for the sinks:
        TensorBoard drops a resumed run's orphaned steps itself."""
        marker = {RESUMED_AT: step, "time": round(time.time(), 3)}
        self._metrics = self._append(self._metrics, marker)

    def write_summary(self, **fields: Any) -> None:
        if not self.is_main:
            return
        times = self.step_times
        summary = {
            "steps_run": times.count,
            "first_step_end_unix": self.first_step_end,
            "median_step_s": times.median,
            "step_time_s": times.summary(),
            "checkpoint_blocked_s": self.checkpoint_times,
            "wall_s": time.time() - self.started,
            **fields,
        }
        sample = {"steps": times.count, "sample": times.sample_in_order()}
        self._summary = summary
        self._write(self.layout.summary, json.dumps(summary, indent=1))
        self._write(self.layout.step_times, json.dumps(sample))

    def _write(self, path: Path, text: str) -> None:
        try:
            write_atomic(path, text)
        except OSError as exc:  # the run is done: a disk that filled must not fail it now
            _warn(f"{path}: cannot write it ({exc.strerror or exc})")

    def close(self, outcome: RunEnd | None = None) -> None:
        """`outcome`: how the run ended here, for the trackers (None: it never started)."""
        # The sinks first: they never raise, and a file that fails to close (a full disk) must
        # not cost the records still queued for them.
        if self._sinks is not None:
            self._sinks.close(outcome)
            if self._summary is not None:  # what did not reach each sink, known only now
                self._summary["records_missed"] = self._sinks.missed()
                self._write(self.layout.summary, json.dumps(self._summary, indent=1))
        os.close(self._beat)
        for file in (self._status, self._metrics):
            if file is not None:
                with contextlib.suppress(OSError):  # said already, or the disk just filled
                    file.close()


def _warn(what: str) -> None:
    # One line on this rank's stderr (its log and the display), as the sinks' warnings; a log
    # on the same full disk takes none, and that must not fail the run either.
    with contextlib.suppress(OSError):
        print(f"WARNING: {what}", file=sys.stderr, flush=True)


def record_failure(run_dir: Path, rank: int) -> None:
    """When this rank failed, to the microsecond: the launcher names the rank that failed
    first as the root cause (peers that lost it fail a moment later)."""
    record = {"rank": rank, "pid": os.getpid(), "failed_at": time.time()}
    with contextlib.suppress(OSError):
        RunLayout(run_dir).failure(rank).write_text(json.dumps(record) + "\n")
