"""The strategy interface: everything the training loop asks of a backend.

The loop calls these methods and never asks which backend it is. A new backend is one module
with one subclass, plus its entry in `launcher.parallel.registry` (the name `launch.strategy`
takes, its accelerators, how its processes start; a test checks the spec's names against it).
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from launcher.parallel import rng
from launcher.parallel.dims import ParallelDims
from launcher.parallel.pipeline.given import PipelineInput
from launcher.parallel.weight_init import WeightInit
from launcher.replicas.engine import NoReplicas, ReplicaEngine
from launcher.startup_trace import mark


class Strategy(ABC):
    name: str
    rank: int = 0  # this process among all training processes
    world_size: int = 1  # training processes
    # Devices one process drives: 1, except under XLA SPMD (every device of the host). The
    # loader of a process yields `data.batch_size * devices_per_process` samples per batch.
    devices_per_process: int = 1
    device: torch.device
    # The run's dimensions of parallelism (`launcher.parallel.dims`); None: every process is a
    # data-parallel replica of its own.
    dims: ParallelDims | None = None

    @abstractmethod
    def setup(self) -> None:
        """Join the process group and pick this replica's device."""

    def build_model(
        self,
        factory: Callable[[], nn.Module],
        init: WeightInit,
        parallelize: Callable[[nn.Module, Any], Any] | None = None,
        pipeline: PipelineInput | None = None,
    ) -> nn.Module:
        """Build the recipe's model (`factory`), initialise it (`init`), place it and make it
        distributed. `parallelize`: the recipe's tensor-parallel plan, for a backend with a
        `tp` dimension (`launcher.parallel.tensor_parallel`); `pipeline`: what a backend with
        a `pp` dimension cuts the model by (`launcher.parallel.pipeline`)."""
        model = self.wrap_model(init.build(factory))
        mark("model-built")
        return model

    @abstractmethod
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Place a built model on the device and make it distributed."""

    def loader(self, loader: Iterable[Any]) -> Iterable[Any]:
        """Where batches come from; a backend may prefetch onto its device."""
        return (self.to_device(batch) for batch in loader)

    def to_device(self, batch: Any) -> Any:
        non_blocking = self.device.type == "cuda"
        return map_tensors(batch, lambda t: t.to(self.device, non_blocking=non_blocking))

    @abstractmethod
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The mixed-precision context of the forward pass and loss."""

    def sync_gradients(
        self, model: nn.Module, sync: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-step's forward and backward; `sync=False` skips the gradient
        all-reduce on all but the last micro-step of an accumulated step."""
        return contextlib.nullcontext()

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    def forward_backward(
        self,
        model: nn.Module,
        batch: Any,
        loss_of: Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]],
        accum: int,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-batch's forward (`loss_of(model, batch)`: the recipe's loss and metrics)
        and backward, its loss divided by `accum` (the micro-batches of a step) for the
        gradients; returns the loss and metrics. A pipeline runs its schedule instead."""
        with self.autocast():
            loss, metrics = loss_of(model, batch)
        self.backward(loss / accum if accum > 1 else loss)
        return loss, metrics

    def evaluate_batch(
        self,
        model: nn.Module,
        batch: Any,
        evaluate: Callable[[nn.Module, Any], dict[str, Any]],
    ) -> dict[str, Any]:
        """One evaluation batch's metrics (`evaluate(model, batch)`, the recipe's), under
        autocast and no_grad where the caller set it. A pipeline runs its schedule's forward
        and gives the loss alone."""
        with self.autocast():
            return evaluate(model, batch)

    @abstractmethod
    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor | None:
        """Makes the step's gradients final (reduced where the backend does it here, unscaled,
        clipped to `max_norm` when set) and returns their global norm, on the device. None
        where a loss scaler owns overflowing gradients and skips those steps itself."""

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Steps the optimizer and zeroes the gradients."""
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def drop_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Zeroes the gradients without stepping: a skipped update."""
        optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of a small tensor of metrics over all replicas."""

    def on_step_end(self, step: int) -> None:  # noqa: B027 (an optional hook)
        """Called after optimizer step `step` (XLA cuts and runs its graph here)."""

    def read(self, values: torch.Tensor, receive: Callable[[list[float]], None]) -> None:
        """Hands the host values of a small device tensor to `receive`. A backend that runs
        asynchronously (XLA) calls `receive` once the step that computes them has run,
        instead of stalling the loop here."""
        receive(values.tolist())

    def agree_buffers(self, model: nn.Module) -> None:  # noqa: B027 (an optional hook)
        """Makes every replica's buffers (BatchNorm's running statistics) rank 0's, before
        anything reads them: an evaluation, a save. Replicas update their own from their own
        batches; a backend that keeps them equal itself leaves this as it is."""

    def phase(self, name: str, step: int) -> contextlib.AbstractContextManager[None]:
        """Around work outside the training step (`eval`, the `check` before a save): XLA counts the graphs it
        compiles there apart from the step's, and only the first time a phase runs may it
        compile."""
        return contextlib.nullcontext()

    def drain(self) -> None:  # noqa: B027 (an optional hook)
        """Waits until queued device work and every pending `read` are done."""

    def seed(self, seed: int) -> None:
        """Seeds every random number generator of this process, the device's included."""
        rng.seed_everything(seed)

    def rng_state(self) -> dict[str, Any]:
        return rng.rng_state()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        rng.set_rng_state(state)

    def save_planner(self) -> Any:
        """torch.distributed.checkpoint's save planner for this backend's tensors (None: DCP's
        default)."""
        return None

    def load_planner(self) -> Any:
        """torch.distributed.checkpoint's load planner for this backend's tensors; it must
        never unpickle anything but tensors and plain data (None: DCP's default, made so by
        `launcher.checkpoint.format.weights_only_planner`)."""
        return None

    def optimizer_defaults(self) -> dict[str, Any]:
        """Optimizer options this backend needs, where the optimizer has them (the user's
        `optim.kwargs` win)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Backend figures for the end of the run (summary.json and the last line)."""
        return {}

    @abstractmethod
    def barrier(self) -> None: ...

    def control_group(self) -> Any:
        """A CPU (gloo) process group for small control messages; None: the default group."""
        return None

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any process. Collective: every process calls it."""
        return self.any_rank_each([flag])[0]

    def any_rank_each(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether any process sets it: one small all-reduce. Collective."""
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return list(flags)
        value = torch.tensor([int(flag) for flag in flags])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.control_group())
        return [bool(v) for v in value.tolist()]

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (picklable), by rank. Collective; for rare messages."""
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.control_group())
        return out

    def from_main(self, value: Any) -> Any:
        """Rank 0's `value` on every process (picklable). Collective: every process calls it."""
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control_group())
        return box[0]

    def checkpoint_group(self) -> Any:
        """A process group for background checkpoint writes, apart from training's."""
        return None

    @abstractmethod
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Model, optimizer and precision state, as torch.distributed.checkpoint saves it."""

    @abstractmethod
    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None: ...

    def load_whole_weights(
        self, model: nn.Module, read: Callable[[], dict[str, torch.Tensor]]
    ) -> None:
        """Collective: loads weights given whole (`read` reads them from a file: full-size
        tensors, named as torch's `get_model_state_dict(model)` names them) into `model`, whose
        other weights stay as they are. Here every process reads them and keeps what it holds;
        a backend that can broadcast reads them on rank 0 alone (`TorchDistributedStrategy`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, read(), options=StateDictOptions(strict=False))

    def teardown(self) -> None:  # noqa: B027 (an optional hook)
        """Leave the process group."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @functools.cached_property
    def engine(self) -> ReplicaEngine:
        """What happens across replica groups (`launcher.replicas`): the run's engine, which
        `launcher.parallel.build` sets; one group (`NoReplicas`) where none was set."""
        return NoReplicas(self)

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank: which share of the data it takes. The processes
        of one tensor-parallel group, and the stages of one pipeline, share one; the replica
        groups before this process's take the shares before its group's."""
        inner = self.layout.dp_rank(self.rank)
        return self.engine.group_index * self.layout.dp_size + inner

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the processes (groups) that each take their own batches, in
        every replica group."""
        return self.engine.group_count * self.layout.dp_size

    @property
    def layout(self) -> ParallelDims:
        """The run's dimensions; every process a data-parallel replica where the backend has
        none of its own (the xla strategies)."""
        return self.dims or ParallelDims(dp_replicate=self.world_size)

    @property
    def tp_degree(self) -> int:
        """Processes of one tensor-parallel group (1: none): they share one data-parallel
        rank."""
        return self.layout.tp

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the devices that each take `data.batch_size` samples."""
        return self.dp_size * self.devices_per_process


def gradient_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The global norm of the gradients, clipping them to `max_norm` when it is set. Sharded
    gradients (DTensors) give their global norm, the same on every rank."""
    from launcher.parallel.grad_norm import sharded_norm

    params = [p for p in model.parameters() if p.grad is not None]
    sharded = sharded_norm([p.grad for p in params], max_norm)  # type: ignore[misc]
    if sharded is not None:
        return sharded
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard); else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def map_tensors(batch: Any, fn: Any) -> Any:
    """`batch` with `fn` applied to every tensor in it (dicts, lists, tuples, namedtuples)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        mapped = [map_tensors(v, fn) for v in batch]
        return type(batch)(*mapped) if hasattr(batch, "_fields") else type(batch)(mapped)
    return batch
