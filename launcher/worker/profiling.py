"""`train.profile`: a torch.profiler trace of a few steps, per rank, in the run folder.

Each rank writes `RunLayout.profile_trace(rank)`, Chrome trace JSON that Perfetto
(ui.perfetto.dev), chrome://tracing and TensorBoard's profiler plugin read; on a GPU also a CUDA
memory snapshot (`RunLayout.memory_snapshot(rank)`, for pytorch.org/memory_viz). Profiling is
a diagnosis: it never fails the run, whatever goes wrong with it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from launcher.config.spec import ProfileSection
from launcher.rundir.layout import RunLayout


def profiled_steps(options: ProfileSection | None) -> range:
    """The steps (1-based) the profile covers."""
    if options is None:
        return range(0)
    return range(options.start_step, options.start_step + options.steps)


class StepProfiler:
    """Profiles the steps of `profiled_steps`: the loop calls `before_step`/`after_step` around
    every step and `close` at the end of the run."""

    def __init__(
        self, options: ProfileSection | None, layout: RunLayout, rank: int, device: torch.device
    ) -> None:
        self.window = profiled_steps(options)
        self.layout, self.rank, self.device = layout, rank, device
        self._profile: Any = None
        self._marker: Any = None  # the running step's range in the trace
        self._traced: list[int] = []
        self._last: int | None = None
        self._memory = False  # CUDA memory history is being recorded (process-wide)
        self._gave_up = False  # a start failed: one warning, not one per step of the window

    def before_step(self, step: int) -> None:
        """`step` (1-based) is about to run. A resumed run that starts inside the window
        profiles the rest of it."""
        starts = step in self.window and not self._traced and not self._gave_up
        if starts and self._profile is None:
            self._gave_up = not self._attempt("start", self._start)
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
            self._finish()

    def close(self) -> None:
        """The run ends, perhaps inside the window: write what was recorded."""
        if self._profile is not None:
            self._finish()
        elif self.rank == 0 and self._last is not None and self._last < self.window.start:
            print(
                f"train.profile: the run ended at step {self._last}, before start_step "
                f"{self.window.start}: nothing was profiled",
                flush=True,
            )

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        # XLA devices get CPU activity only: the host side of each step, without torch_xla.
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        started = profile(activities=activities, record_shapes=True, profile_memory=True)
        started.__enter__()
        self._profile = started
        if cuda:  # a trace without the snapshot is still worth having
            self._memory = self._attempt("record CUDA memory history", _record_memory_history)

    def _finish(self) -> None:
        """Stops the profiler and writes its files; each part that fails only warns, and the
        CUDA memory history is turned off whatever happens (it slows every allocation)."""
        profile, self._profile = self._profile, None
        stopped = self._attempt("stop", lambda: self._stop(profile))
        wrote = stopped and self._attempt("write the trace", lambda: self._export(profile))
        if self._memory:
            self._attempt("write the CUDA memory snapshot", self._dump_snapshot)
            self._attempt("stop the CUDA memory history", _stop_memory_history)
            self._memory = False
        if wrote and self.rank == 0:
            self._announce()

    def _stop(self, profile: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the traced steps' kernels, whole
        profile.__exit__(None, None, None)

    def _export(self, profile: Any) -> None:
        self.layout.profile_dir.mkdir(exist_ok=True)
        profile.export_chrome_trace(str(self.layout.profile_trace(self.rank)))

    def _dump_snapshot(self) -> None:
        self.layout.profile_dir.mkdir(exist_ok=True)  # also where the trace could not be written
        torch.cuda.memory._dump_snapshot(str(self.layout.memory_snapshot(self.rank)))

    def _announce(self) -> None:
        first, last = self._traced[0], self._traced[-1]
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        where = self.layout.profile_dir
        print(
            f"profile: {steps} traced to {where} (open a trace in ui.perfetto.dev, or "
            f"tensorboard --logdir {where})",
            flush=True,
        )

    def _attempt(self, what: str, action: Callable[[], object]) -> bool:
        """Runs `action`; whether it worked. A failure is a warning on this rank's stderr."""
        try:
            action()
        except Exception as exc:  # a diagnosis must not end the run it diagnoses
            print(
                f"WARNING: train.profile: could not {what} ({type(exc).__name__}: {exc}); "
                "training goes on",
                file=sys.stderr,
                flush=True,
            )
            return False
        return True


# torch.cuda.memory's recorder is private API (there since torch 2.1), looked up only when
# called: a build without it costs the snapshot, never the import of this module or the trace.
def _record_memory_history() -> None:
    torch.cuda.memory._record_memory_history(max_entries=100_000)


def _stop_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)
