"""The `tensorboard` tracker (on by default): rank 0's TensorBoard event files in `<run dir>/tb/`,
a sink of `launcher.metrics.sinks`, whose background writer calls it, so a slow or failing
disk never holds up or fails a step. The folder and its file appear with the first record
(after metrics.jsonl has it), so an attempt that never trained leaves no `tb/` behind.
TensorBoard keeps no run id and no status, so it needs nothing of trackers.json (`TrackerSink`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.metrics.record_fields import NOT_METRICS, is_number
from launcher.metrics.tensorboard_events import EventWriter
from launcher.rundir.layout import RunLayout

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec
    from launcher.metrics.sink_types import RunEnd
    from launcher.metrics.trackers.records import TrackerRecords

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
    """A metrics sink (`launcher.metrics.sink_types.Sink`): TensorBoard's scalars, one event file
    per run attempt. The folder and its file appear with the first record."""

    name = "tensorboard"

    def __init__(
        self,
        directory: Path,
        writer: Callable[[Path], EventWriter] = EventWriter,  # tests pass a slow or broken one
    ) -> None:
        self.directory = directory
        self.where = str(directory)
        self._open = writer
        self._writer: EventWriter | None = None

    @classmethod
    def for_run(cls, spec: RunSpec, run_dir: Path, records: TrackerRecords) -> TensorBoardSink:
        """The sink for the run in `run_dir` (how the registry builds it)."""
        return cls(RunLayout(run_dir).tensorboard_dir)

    def start(self) -> None:
        pass  # its file appears with the first record

    def write(self, record: dict[str, Any]) -> None:
        tags = scalar_tags(record)
        if not tags:
            return
        if self._writer is None:
            self._writer = self._open(self.directory)
        self._writer.add_scalars(int(record["step"]), tags, record.get("time"))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def end(self, outcome: RunEnd) -> None:
        pass  # scalars only: TensorBoard has no run status

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
