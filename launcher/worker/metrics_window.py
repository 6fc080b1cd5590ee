"""Metrics of the steps since the last log line, kept on the device until they are logged.

Part of a checkpoint, so that a resumed run logs the same averages an uninterrupted one would.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class MetricsWindow:
    def __init__(self) -> None:
        self.steps = 0
        self.sums: dict[str, torch.Tensor] = {}
        # The step count, on the device too: dividing by a Python number would make a window
        # of 1 step (a special constant to XLA) a graph of its own.
        self.count: torch.Tensor | None = None
        self.restart_clock()

    def restart_clock(self) -> None:
        self.started = time.perf_counter()
        self.timed_steps = 0  # steps since `started`, for throughput

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        self.steps += 1
        self.timed_steps += 1
        self.count = torch.ones((), device=loss.device) if self.count is None else self.count + 1
        for k, v in {"loss": loss, **metrics}.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def mean(self) -> dict[str, torch.Tensor]:
        return {k: v / self.count for k, v in self.sums.items()}

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self.started) / max(1, self.timed_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "sums": {k: v.detach().cpu() for k, v in self.sums.items()}}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.steps = state["steps"]
        self.sums = {k: v.to(device) for k, v in state["sums"].items()}
        self.count = torch.tensor(float(self.steps), device=device) if self.steps else None
        self.restart_clock()
