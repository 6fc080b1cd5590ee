"""Rank 0's step times in a fixed amount of memory, at any run length: the exact count, mean,
minimum and maximum, and a uniform sample of at most `capacity` steps (reservoir sampling,
Vitter's algorithm R) from which the median and percentiles are read. Runs of up to
`capacity` steps keep every step, so their percentiles are exact.

summary.json holds `summary()`: the same keys whatever the length. The sample, each entry
`[step index, seconds]`, goes to its own file for the benchmarks, which leave out the first
steps (warm-up) by index."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from launcher.rundir.reading import read_json_or_none

# Enough for a median within about 1.5 percentile points (95%) of the true one.
SAMPLE_SIZE = 1024
PERCENTILES = (10, 50, 90, 99)


class StepTimes:
    def __init__(self, capacity: int = SAMPLE_SIZE, seed: int = 0) -> None:
        self.capacity = capacity
        self.count = 0
        self.total = 0.0
        self.low = math.inf
        self.high = -math.inf
        self.sample: list[tuple[int, float]] = []  # (index of the step, its seconds)
        # A seeded stream of its own: the run's RNG streams are left alone.
        self._random = random.Random(seed)

    def add(self, seconds: float) -> None:
        index, self.count = self.count, self.count + 1
        self.total += seconds
        self.low, self.high = min(self.low, seconds), max(self.high, seconds)
        if len(self.sample) < self.capacity:
            self.sample.append((index, seconds))
        elif (slot := self._random.randrange(self.count)) < self.capacity:
            self.sample[slot] = (index, seconds)

    def percentile(self, q: float) -> float | None:
        """The `q`th percentile (0-100) of the sampled steps, interpolated between the two
        nearest (q=50: the median, as `statistics.median` gives it)."""
        ordered = sorted(seconds for _, seconds in self.sample)
        if not ordered:
            return None
        at = (len(ordered) - 1) * q / 100
        below = math.floor(at)
        above = min(below + 1, len(ordered) - 1)
        return ordered[below] + (ordered[above] - ordered[below]) * (at - below)

    @property
    def median(self) -> float | None:
        return _micro(self.percentile(50))

    def summary(self) -> dict[str, Any]:
        """summary.json's `step_time_s`: the same keys at any run length (None before the
        first step)."""
        seen = self.count > 0
        figures = {
            "mean": self.total / self.count if seen else None,
            "min": self.low if seen else None,
            **{f"p{q}": self.percentile(q) for q in PERCENTILES},
            "max": self.high if seen else None,
        }
        # To the microsecond (a timer's noise is coarser): each figure a bounded width.
        return {"count": self.count, **{k: _micro(v) for k, v in figures.items()}}

    def sample_in_order(self) -> list[list[float]]:
        """The sample, by step: `[index, seconds]` each (every step of a short run)."""
        return [[index, seconds] for index, seconds in sorted(self.sample)]


def _micro(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


def read_sample(path: Path) -> list[float]:
    """The seconds of the steps a run's step-time sample holds, by step (every step of a run
    of up to SAMPLE_SIZE steps): for the benchmarks, which leave out the first ones."""
    record = read_json_or_none(path, "record")
    sample = record.get("sample") if isinstance(record, dict) else None
    return [seconds for _, seconds in sample or []]
