"""The hang watchdog's clock, moved by hand in tests of its timing rules."""

from __future__ import annotations

import pytest


class WatchdogClock:
    """Stands in for the `time` module in launcher.launch.watchdog: the rules are checked
    without sleeping, so a loaded machine's late wake-ups cannot change the gaps it sees."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("launcher.launch.watchdog.time", self)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
