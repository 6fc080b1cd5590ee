"""This rank's pace: each step's time parted into waiting for data, its own compute, and
waiting for the other ranks (`launcher.parallel.waits`), kept per step until the window is
logged, which reads their medians (a median: one step slowed by a save or a collection of
garbage moves no window).

A step is a line of spans on the rank's clock, from the end of its first batch's fetch to its
optimizer's update: the fetches of later micro-batches (data), the waits `WaitMarks` reports,
and the rest, its own work (compute). What the waits wait for is another rank's pace, never
this one's, so they are kept apart and never compared.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from launcher.parallel.waits import HostClock, WaitMarks, clock_for

PARTS = ("compute", "data")  # compared between the ranks
# Kept too (`Pace.window`'s): the waits, and the part of compute the optimizer's update took.
FIGURES = (*PARTS, "wait", "optimizer")
# A window's medians come from its last steps, at most this many: a long `train.log_every`
# holds no more marks (a GPU's events) than this.
KEPT_STEPS = 64


@dataclass
class _Step:
    data: float = 0.0  # host seconds: the loader runs on the host
    work: list[tuple[Any, Any]] = field(default_factory=list)  # spans of marks
    waits: list[tuple[Any, Any]] = field(default_factory=list)
    optimizer: list[tuple[Any, Any]] = field(default_factory=list)  # inside work's spans


class Pace:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.clock = clock_for(device)
        self.host = HostClock()  # the loader's: it runs on the host
        self.marks = WaitMarks(self)
        self.marks.watch(model)
        self._step = _Step()
        self._open: Any = None  # where the current span of own work started
        self._waiting: Any = None  # where the current wait started
        self._done: list[_Step] = []

    def marking(self, loss_of: Callable[..., Any]) -> Callable[..., Any]:
        """The recipe's loss, marking where this rank's own backward ends."""
        return self.marks.marking(loss_of)

    def step_started(self) -> None:
        self._step = _Step()
        self._open = self._waiting = None

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """Around the wait for the next batch: no span of work covers it."""
        self._close_work()
        started = self.host.mark()
        try:
            yield
        finally:
            self._step.data += self.host.seconds(started, self.host.mark())
            self._open = self.clock.mark()

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Around the optimizer's update: compute, also timed apart."""
        started = self.clock.mark()
        try:
            yield
        finally:
            self._step.optimizer.append((started, self.clock.mark()))

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait for the other ranks that no wrapper's hook marks (the replica
        groups' average and vote)."""
        self.wait_started()
        try:
            yield
        finally:
            self.wait_ended()

    def wait_started(self) -> None:
        if self._waiting is None:  # a wait inside a wait is the outer one's
            self._waiting = self._close_work()

    def wait_ended(self) -> None:
        if self._waiting is None:
            return
        self._open = self.clock.mark()
        self._step.waits.append((self._waiting, self._open))
        self._waiting = None

    def backward_returned(self) -> None:
        """What was left of backward after this rank's own gradients was waiting."""
        self.wait_ended()

    def step_done(self) -> None:
        self._close_work()
        self._done.append(self._step)
        del self._done[:-KEPT_STEPS]
        self._step = _Step()

    def _close_work(self) -> Any:
        now = self.clock.mark()
        if self._open is not None:
            self._step.work.append((self._open, now))
        self._open = None
        return now

    def window(self) -> dict[str, float]:
        """The medians of this window's steps, in seconds per step (FIGURES); a new
        window starts."""
        seconds = self.clock.seconds
        parts: dict[str, list[float]] = {name: [] for name in FIGURES}
        for step in self._done:
            parts["compute"].append(sum(seconds(a, b) for a, b in step.work))
            parts["data"].append(step.data)
            parts["wait"].append(sum(seconds(a, b) for a, b in step.waits))
            parts["optimizer"].append(sum(seconds(a, b) for a, b in step.optimizer))
        self._done = []
        return {k: statistics.median(v) if v else 0.0 for k, v in parts.items()}

    def close(self) -> None:
        self.clock.close()
        self.host.close()


class IdlePace(Pace):
    """No timing (`launch.straggler.action: off`, or a rank with no other to compare with)."""

    def __init__(self) -> None:
        pass

    def marking(self, loss_of: Callable[..., Any]) -> Callable[..., Any]:
        return loss_of

    def step_started(self) -> None:
        pass

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        yield

    def backward_returned(self) -> None:
        pass

    def step_done(self) -> None:
        pass

    def window(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
