"""`train.profile`: a torch.profiler trace of a few steps, per rank, in the run folder.

Each rank writes `RunLayout.profile_trace(rank)`, Chrome trace JSON that Perfetto
(ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin read; on a GPU also a CUDA
memory snapshot (`RunLayout.memory_snapshot(rank)`, for pytorch.org/memory_viz). Profiling is
a diagnosis: it never fails the run, whatever goes wrong with it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from launcher.run_layout import RunLayout
from launcher.spec import ProfileSection


def profiled_steps(options: ProfileSection | None) -> range:
    """The steps (1-based) the profile covers."""
    if options is None:
        return range(0)
    return range(options.start_step, options.start_step + options.steps)


class StepProfiler:
    def __init__(
        self, options: ProfileSection | None, layout: RunLayout, rank: int, device: torch.device
    ) -> None:
        self.window = profiled_steps(options)
        self.layout, self.rank, self.device = layout, rank, device
        self._profile: Any = None
        self._marker: Any = None  # the running step's range in the trace
        self._traced: list[int] = []
        self._last: int | None = None

    def before_step(self, step: int) -> None:
        """`step` (1-based) is about to run. A resumed run that starts inside the window
        profiles the rest of it."""
        if step in self.window and self._profile is None and not self._traced:
            self._guarded(self._start)
        if self._profile is not None:
            self._marker = torch.profiler.record_function(f"step {step}")
            self._marker.__enter__()

    def after_step(self, step: int) -> None:
        """`step` has run (its device work may still be queued)."""
        self._last = step
        if self._profile is None:
            return
        self._marker.__exit__(None, None, None)
        self._traced.append(step)
        if step == self.window[-1]:
            self._guarded(self._stop)

    def close(self) -> None:
        """The run ends, perhaps inside the window: write what was recorded."""
        if self._profile is not None:
            self._guarded(self._stop)
        elif self.rank == 0 and self._last is not None and self._last < self.window.start:
            print(
                f"train.profile: the run ended at step {self._last}, before start_step "
                f"{self.window.start}: nothing was profiled",
                flush=True,
            )

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profile = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profile.__enter__()

    def _stop(self) -> None:
        profile, self._profile = self._profile, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the traced steps' kernels, whole
        profile.__exit__(None, None, None)
        self.layout.profile_dir.mkdir(exist_ok=True)
        profile.export_chrome_trace(str(self.layout.profile_trace(self.rank)))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.layout.memory_snapshot(self.rank)))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0 and self._traced:
            first, last = self._traced[0], self._traced[-1]
            steps = f"step {first}" if first == last else f"steps {first}-{last}"
            where = self.layout.profile_dir
            print(
                f"profile: {steps} traced to {where} (open a trace in ui.perfetto.dev, or "
                f"tensorboard --logdir {where})",
                flush=True,
            )

    def _guarded(self, action: Any) -> None:
        try:
            action()
        except Exception as exc:  # a diagnosis must not end the run it diagnoses
            self._profile = None
            print(
                f"WARNING: train.profile: {type(exc).__name__}: {exc}; training goes on",
                file=sys.stderr,
                flush=True,
            )
