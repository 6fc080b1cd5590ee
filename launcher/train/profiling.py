"""`train.profile`: a torch.profiler trace of a few steps per rank (stub: being written)."""

from __future__ import annotations

import torch

from launcher.run_layout import RunLayout
from launcher.spec import ProfileSection


class StepProfiler:
    def __init__(
        self, options: ProfileSection | None, layout: RunLayout, rank: int, device: torch.device
    ) -> None:
        self.options = options

    def before_step(self, step: int) -> None:
        """`step` (1-based) is about to run."""

    def after_step(self, step: int) -> None:
        """`step` has run (its device work may still be queued)."""

    def close(self) -> None:
        """The run ends (perhaps inside the window): write what was recorded."""
