"""How much memory a layout needs on each device, before any process starts.

Counted by torch rather than by a formula for one model family: the model is built on the meta
device and laid out as the run lays it out (tensor parallelism, activation checkpointing,
FSDP/HSDP sharding over a fake process group of the run's world size, as torchtitan's
`scripts/estimate` does), then materialised as fake tensors (`FakeTensorMode`: shapes and
dtypes, no storage). Two training steps run on one micro-batch: the first creates the
optimizer's state (torch creates it lazily) and the gradients, which are counted as this
device's shards; the second runs under torch's `MemTracker` (`FSDPMemTracker` for FSDP),
which gives the activations of forward and backward and the step's peak.

Everything runs in the calling process on rank 0's view and leaves no process group behind.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from launcher.config.fsdp import FSDPSection
from launcher.metrics.memory import local_bytes, optimizer_bytes, size_text
from launcher.parallel.base import map_tensors
from launcher.parallel.dims import ParallelDims
from launcher.parallel.precision import DTYPES

# What the tracker counts as activations: tensors saved for backward, and the temporaries of
# forward and backward (torch's `_MemRefType` / `_FSDPRefType` names).
_ACTIVATION_KINDS = ("ACT", "TEMP")


@dataclass(frozen=True)
class Layout:
    """What the run applies to the model on each device."""

    strategy: str  # "ddp" or "fsdp"
    dims: ParallelDims
    fsdp: FSDPSection
    precision: str = "fp32"  # autocast's dtype, as `train.precision` names it
    batch_size: int = 1  # samples in one micro-batch on one data-parallel rank
    stage: str | None = None  # under a pipeline: which stage, e.g. `stage 1 of 2`

    def describe(self) -> str:
        return (
            f"{self.strategy}, {self.dims.describe()}, {self.precision}, micro-batch of "
            f"{self.batch_size}" + (f", {self.stage}" if self.stage else "")
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device. `params`, `grads` and `optimizer` are this device's shards as they
    stay between steps (`params` with the buffers); `activations`: the most that forward and
    backward of one micro-batch hold at once; `peak`: the most that one whole step (forward,
    backward, the optimizer's update, FSDP's gathered units) holds at once."""

    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    layout: Layout

    @property
    def state(self) -> int:
        """What sharding divides: parameters, gradients and optimizer state."""
        return self.params + self.grads + self.optimizer

    def describe(self) -> str:
        figures = (
            f"params {size_text(self.params)} + grads {size_text(self.grads)} + optimizer "
            f"{size_text(self.optimizer)} + activations {size_text(self.activations)}"
        )
        return (
            f"memory per device (estimate, {self.layout.describe()}): peak "
            f"{size_text(self.peak)} ({figures})"
        )


def estimate_memory(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    batch: Any,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    layout: Layout,
    parallelize: Callable[[nn.Module, Any], Any] | None = None,
) -> MemoryEstimate:
    """The memory one device of `layout` needs to train `build_model()` with the optimizer
    `make_optimizer(model)` on micro-batches like `batch` (`loss(model, batch)` gives the loss
    tensor). `parallelize`: the recipe's tensor-parallel plan, where `layout.dims.tp > 1`.
    Raises whatever the model raises on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # torch's warnings about the fake layout (FSDP's, DTensor's) are the run's to give.
    with fake_process_group(layout.dims.world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _laid_out_model(build_model, layout, parallelize)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model.to_empty(device="cpu")  # shapes and dtypes, no storage
            return _measure(
                model, make_optimizer, map_tensors(batch, fake.from_tensor), loss, layout
            )


def _measure(
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    batch: Any,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    layout: Layout,
) -> MemoryEstimate:
    """Two steps of `model`, laid out and on fake tensors, on `batch` (fake too)."""
    optimizer = make_optimizer(model)
    tracker = _tracker(model, optimizer)
    step = _Step(model, optimizer, batch, loss, layout.precision)
    with tracker:  # the first step creates the gradients and the optimizer's state
        step.forward_backward()
        grads = local_bytes(p.grad for p in model.parameters())
        step.update()
    tracker.reset_mod_stats()  # the tracker measures one forward and backward at a time
    with tracker:  # entering again starts its peak afresh: a step in the steady state
        step.forward_backward()
        activations = sum(_kinds(tracker, _ACTIVATION_KINDS))
        step.update()
        peak = sum(_kinds(tracker, ("Total",)))
    return MemoryEstimate(
        params=local_bytes(itertools.chain(model.parameters(), model.buffers())),
        grads=grads,
        optimizer=optimizer_bytes(optimizer),
        activations=activations,
        peak=peak,
        layout=layout,
    )


class _Step:
    """One training step as the loop takes it, on one micro-batch."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        loss: Callable[[nn.Module, Any], torch.Tensor],
        precision: str,
    ) -> None:
        self.model, self.optimizer, self.batch, self.loss = model, optimizer, batch, loss
        self.dtype = DTYPES[precision]

    def forward_backward(self) -> None:
        autocast = (
            torch.autocast("cpu", dtype=self.dtype)
            if self.dtype != torch.float32
            else contextlib.nullcontext()
        )
        with autocast:
            value = self.loss(self.model, self.batch)
        value.backward()

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _laid_out_model(
    build_model: Callable[[], nn.Module],
    layout: Layout,
    parallelize: Callable[[nn.Module, Any], Any] | None,
) -> nn.Module:
    """The model on the meta device, with what the run applies, as the run applies it
    (`launcher.parallel.fsdp.lay_out`)."""
    with torch.device("meta"):
        model = build_model()
    if layout.strategy != "fsdp":
        return model  # ddp: a whole replica; its buckets are views of the gradients
    from launcher.parallel.fsdp import lay_out

    dims = layout.dims
    # Offloaded shards live in host memory: estimated here as if on the device.
    on_device = layout.fsdp.model_copy(update={"cpu_offload": False})
    if dims.world > 1:
        lay_out(model, dims, dims.build_mesh("cpu"), on_device, parallelize)
    elif on_device.activation_checkpointing:
        lay_out(model, dims, None, on_device, parallelize)
    return model


def _tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    tracker = _MemTrackerWithFrozen()
    tracker.track_external(model, optimizer)
    return tracker


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass


class _MemTrackerWithFrozen(MemTracker):
    """torch's `MemTracker`, for models with frozen parameters. It hooks the gradient of every
    parameter of a module it meets, and torch refuses a hook on a tensor that does not
    require grad (`RuntimeError: cannot register a hook ...`). A frozen parameter never gets
    a gradient, so it is given handles with nothing behind them, which the tracker skips
    hooking and removes on exit as it does its own."""

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def _kinds(tracker: Any, kinds: tuple[str, ...]) -> Iterator[int]:
    """The bytes of those kinds of memory at the tracker's peak, over every device."""
    for device_snapshot in tracker.get_tracker_snapshot("peak").values():
        for kind, count in device_snapshot.items():
            if getattr(kind, "name", kind) in kinds:
                yield count


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[None]:
    """A process group of `world` ranks whose collectives do nothing (torch's own, for
    estimates), destroyed on the way out: this process's later work sees none."""
    if world == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


__all__ = ["Layout", "MemoryEstimate", "estimate_memory", "fake_process_group"]
