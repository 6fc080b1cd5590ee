"""Where a step waits for the other ranks, apart from its own work, and the clocks that time
both.

A rank that is slow makes every other rank wait for it inside what looks like compute: DDP's
backward ends by waiting for the gradients' all-reduce, which ends when the slowest rank's
gradients arrive. Timed as a whole, a fast rank's backward is then as slow as the straggler's,
and no rank stands out. `WaitMarks` tells a `Timeline` where the waits start and end:

- DDP's backward: when backward starts, a pre-hook on the loss's node queues a callback on
  autograd's engine. Callbacks run in the order they were queued once the graph is done, and
  DDP queues its own (which waits for the all-reduce) only when the first gradient is ready:
  ours runs first, the moment this rank's own gradients are computed. From there to the end
  of backward (`Timeline.backward_returned`) is waiting.
- DDP's forward: its buffer broadcast (a collective on a model with buffers), between a
  forward pre-hook on the wrapper and one on the module it wraps.
- fully_shard's gathers of parameters (forward and backward) and its gradients'
  reduce-scatters: each group's methods that run them, wrapped (`_FSDP_WAITS`).

The clocks: on the CPU, `HostClock`, wall time less the time this thread sat on a run queue
waiting for a core (Linux's schedstat), so that a rank the scheduler left waiting on a loaded
machine is not counted slow at its work. On a GPU, `DeviceClock`: events on the current
stream, read only when a window is logged (whose values the host reads anyway): the device's
own time, with no synchronisation per step.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Clock(Protocol):
    def mark(self) -> Any:
        """A point in time on this clock."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks (of steps whose window is over)."""

    def close(self) -> None: ...


class HostClock:
    """Made on the thread that runs the steps: schedstat is that thread's."""

    def __init__(self) -> None:
        self._schedstat: int | None = None
        with contextlib.suppress(OSError):  # not Linux, or /proc not mounted: wall time alone
            self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def mark(self) -> float:
        wall = time.perf_counter()
        if self._schedstat is None:
            return wall
        try:  # "<on cpu ns> <waiting on a run queue ns> <time slices>"
            queued_ns = int(os.pread(self._schedstat, 64, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return wall
        return wall - queued_ns / 1e9

    def seconds(self, start: float, end: float) -> float:
        return max(0.0, end - start)

    def close(self) -> None:
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None


class DeviceClock:
    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # long done: its window was logged after it
        return max(0.0, start.elapsed_time(end) / 1000)

    def close(self) -> None:
        pass


def clock_for(device: torch.device) -> Clock:
    return DeviceClock() if device.type == "cuda" else HostClock()


class Timeline(Protocol):
    def wait_started(self) -> None: ...

    def wait_ended(self) -> None: ...


class WaitMarks:
    """Tells `timeline` where this rank starts and stops waiting for the others."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def marking(self, loss_of: Callable[..., Any]) -> Callable[..., Any]:
        """`loss_of` (the recipe's loss), whose loss marks the end of this rank's own
        backward: the rest of it waits for the others (`Timeline.backward_returned`)."""

        def marked(model: nn.Module, batch: Any) -> Any:
            loss, metrics = loss_of(model, batch)
            node = getattr(loss, "grad_fn", None)
            if node is not None:
                node.register_prehook(self._queue_mark)
            return loss, metrics

        return marked

    def _queue_mark(self, grads: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.timeline.wait_started)

    def watch(self, model: nn.Module) -> None:
        """Times the collectives that `model`'s wrappers run inside forward and backward:
        DDP's buffer broadcast, and fully_shard's gathers and reduce-scatters."""
        if isinstance(model, DistributedDataParallel):
            model.register_forward_pre_hook(lambda module, args: self.timeline.wait_started())
            model.module.register_forward_pre_hook(lambda module, args: self.timeline.wait_ended())
        for group in _fsdp_groups(model):
            for name in _FSDP_WAITS:
                setattr(group, name, self._waiting(getattr(group, name)))

    def _waiting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def waiting(*args: Any, **kwargs: Any) -> Any:
            self.timeline.wait_started()
            try:
                return method(*args, **kwargs)
            finally:
                self.timeline.wait_ended()

        return waiting


# fully_shard's parameter groups' methods that run its collectives and wait for them (on a
# GPU, post_backward only queues its reduce-scatter): set on each group, which its hooks
# look up at every call. Private to torch, and so looked up with care: a torch that renamed
# them leaves the collectives in compute (docs/resume-and-faults.md).
_FSDP_WAITS = ("unshard", "wait_for_unshard", "post_backward")


def _fsdp_groups(model: nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    groups = []
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None and all(callable(getattr(group, n, None)) for n in _FSDP_WAITS):
            groups.append(group)
    return groups
