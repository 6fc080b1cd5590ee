"""What a metrics sink is, and what every sink shares: the `Sink` interface, how the run ended
(`RunEnd`), how often a tracker delivers (`PUSH_EVERY_S`) and the one-line warning. A leaf:
it imports no other metrics module, so the thread-per-sink machinery
(`launcher.metrics.sinks`), which builds the sinks, and the sinks themselves (progress.json,
the trackers of `launcher.metrics.trackers`) all import it, and never each other."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Literal, Protocol


@dataclass(frozen=True)
class RunEnd:
    """How this process's part of the run ended, for the trackers' run status."""

    # finished: trained to the end (or stopped early); stopped: asked to stop (a preemption,
    # Ctrl-C), to be resumed; failed: an error.
    status: Literal["finished", "stopped", "failed"]
    best_checkpoint: str | None = None


# How often a tracker delivers what it was sent (its `flush_every`): a request per record
# would take a few ms of CPU from training at every step of a fast run.
PUSH_EVERY_S = 1.0


class Sink(Protocol):
    """A destination for metrics records. Only its own thread calls it, so it may block and
    it may raise. It may also have a `flush_every` (seconds, 0 where it has none): the least
    time between two flushes, for a tracker whose flush is a request."""

    name: str  # the spec key that turns it on, for its warnings: "tensorboard", "mlflow"
    where: str  # what it writes to, for its warnings: a folder, a URL

    def start(self) -> None:
        """Before the first record: a tracker connects (from the sink's thread)."""

    def write(self, record: dict[str, Any]) -> None:
        """One record: `step` and `time`, then metrics by name (`loss`, `val/loss`, ...)."""

    def flush(self) -> None:
        """Makes what was written visible to readers (a tracker delivers it): called when the
        queue runs empty, at most once every `flush_every` seconds. A record has reached the
        sink when a flush after it returned."""

    def end(self, outcome: RunEnd) -> None:
        """The run's end, after its last record: a tracker marks its run finished or not."""

    def close(self) -> None: ...


def warn(who: str, what: str) -> None:
    # One line on this rank's stderr (its log and the display), as the profiler's warnings.
    print(f"WARNING: {who}: {what}", file=sys.stderr, flush=True)
