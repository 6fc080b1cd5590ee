"""Each metrics sink has its own queue and thread (`launcher.metrics.sinks`): one that blocks
forever never delays another, one that cannot keep up drops its own oldest records and counts
them, the end of a run waits for the healthy ones to finish and gives up on a stuck one, and a
tracker's flushes stay at most one per `flush_every`."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from launcher.metrics.sink_types import RunEnd
from launcher.metrics.sinks import BackgroundWriter

pytestmark = [pytest.mark.launcher_only, pytest.mark.timeout(60)]


def _records(n: int) -> list[dict[str, Any]]:
    return [{"step": s, "loss": 1.0 / s, "time": 1000.0 + s} for s in range(1, n + 1)]


class _Kept:
    """A sink that keeps what it gets, and counts its flushes."""

    where = "memory"

    def __init__(self, name: str = "kept") -> None:
        self.name = name
        self.records: list[dict[str, Any]] = []
        self.flushes = 0
        self.ended: str | None = None
        self.closed = False

    def start(self) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def flush(self) -> None:
        self.flushes += 1

    def end(self, outcome: RunEnd) -> None:
        self.ended = outcome.status

    def close(self) -> None:
        self.closed = True


class _Stuck(_Kept):
    """A tracker whose server stopped answering: its writes block until the test ends."""

    def __init__(self, name: str, gate: threading.Event, where: str = "nowhere") -> None:
        super().__init__(name)
        self.where = where
        self.gate = gate

    def write(self, record: dict[str, Any]) -> None:
        self.gate.wait(timeout=60)
        super().write(record)


class _SlowToStart(_Kept):
    """A tracker still connecting: it takes its first record once the test lets it."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__("slow")
        self.gate = gate

    def start(self) -> None:
        self.gate.wait(timeout=60)


def test_a_sink_that_blocks_forever_never_delays_another(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gate = threading.Event()
    stuck, kept = _Stuck("stuck", gate), _Kept()
    try:
        writer = BackgroundWriter([stuck, kept], close_timeout=0.5)
        for record in _records(50):
            writer.write(record)
        writer.close(RunEnd("finished"))
        # The healthy sink got everything, its end and its close, while the other one blocked.
        assert [r["step"] for r in kept.records] == list(range(1, 51))
        assert kept.ended == "finished" and kept.closed
        assert stuck.records == [] and not stuck.closed
        assert writer.missed() == {"stuck": 50, "kept": 0}
    finally:
        gate.set()  # lets its thread end
    err = capsys.readouterr().err
    assert err.count("WARNING: metrics: stuck still writing after 0.5 s") == 1, err
    assert err.count("WARNING: stuck: 50 of 50 records did not reach nowhere") == 1, err
    assert "kept" not in err


def test_a_sink_that_cannot_keep_up_drops_its_oldest_records(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gate = threading.Event()
    slow = _SlowToStart(gate)
    writer = BackgroundWriter([slow], capacity=5)
    for record in _records(20):  # all queued before it starts: its queue holds 5
        writer.write(record)
    gate.set()
    writer.close(RunEnd("finished"))
    assert [r["step"] for r in slow.records] == [16, 17, 18, 19, 20]  # the newest
    assert writer.missed() == {"slow": 15}
    err = capsys.readouterr().err
    assert err.count("WARNING: metrics: 5 records wait for slow; dropping the oldest") == 1, err
    assert err.count("WARNING: slow: 15 of 20 records did not reach memory") == 1, err


def test_a_failing_sink_counts_what_it_missed(capsys: pytest.CaptureFixture[str]) -> None:
    class Broken(_Kept):
        def flush(self) -> None:
            raise OSError(28, "No space left on device")

    broken, kept = Broken("broken"), _Kept()
    writer = BackgroundWriter([broken, kept])
    for record in _records(10):
        writer.write(record)
    writer.close(RunEnd("failed"))
    assert writer.missed() == {"broken": 10, "kept": 0}  # none was flushed
    assert kept.ended == "failed" and len(kept.records) == 10
    err = capsys.readouterr().err
    assert err.count("WARNING: broken: could not write to memory") == 1, err
    assert "WARNING: broken: 10 of 10 records did not reach memory" in err


def test_a_tracker_flushes_at_most_once_per_flush_every() -> None:
    """A tracker's flush is a request: records that come in bursts go in one."""
    tracker = _Kept("tracker")
    tracker.flush_every = 60.0  # type: ignore[attr-defined]
    writer = BackgroundWriter([tracker])
    for record in _records(10):
        writer.write(record)
        time.sleep(0.01)  # bursts of one record: a file sink flushes after each
    writer.close(RunEnd("finished"))
    assert tracker.flushes == 1  # at the end
    assert len(tracker.records) == 10 and writer.missed() == {"tracker": 0}
