"""The strategy interface: everything the training loop asks of a backend.

The loop calls these methods, and the parts a strategy holds (`steps`: how a step runs;
`control`: messages between the processes; `rng`: the random streams), and never asks which
backend it is. A new backend is one module with one subclass, plus its entry in
`launcher.parallel.registry` (the name `launch.strategy` takes, its accelerators, how its
processes start; a test checks the spec's names against it).
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from launcher.parallel.control import ControlChannel
from launcher.parallel.dims import ParallelDims
from launcher.parallel.pipeline.given import PipelineInput
from launcher.parallel.rng import RandomStreams
from launcher.parallel.steps import StepRunner
from launcher.parallel.weight_init import WeightInit
from launcher.replicas.engine import NoReplicas, ReplicaEngine
from launcher.startup_trace import mark


@dataclass(frozen=True)
class Planners:
    """torch.distributed.checkpoint's save and load planners (None: DCP's default). A load
    planner must never unpickle anything but tensors and plain data (DCP's default is made so
    by `launcher.checkpoint.format.weights_only_planner`)."""

    save: Any = None
    load: Any = None


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
    # How a step runs (`launcher.parallel.steps`): set by `setup`, or by `build_model` where
    # the layout has pipeline stages.
    steps: StepRunner
    # Control messages between the processes (`launcher.parallel.control`): set by `setup`.
    control: ControlChannel
    # Every random number generator of this process; a backend with its own extends it.
    rng: RandomStreams = RandomStreams()

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
        return (to_device(batch, self.device) for batch in loader)

    def sync_gradients(
        self, model: nn.Module, sync: bool
    ) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-step's forward and backward; `sync=False` skips the gradient
        all-reduce on all but the last micro-step of an accumulated step."""
        return contextlib.nullcontext()

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

    def phase(self, name: str, step: int) -> contextlib.AbstractContextManager[None]:
        """Around work outside the training step (`eval`, the `check` before a save): XLA counts the graphs it
        compiles there apart from the step's, and only the first time a phase runs may it
        compile."""
        return contextlib.nullcontext()

    def drain(self) -> None:  # noqa: B027 (an optional hook)
        """Waits until queued device work and every pending `read` are done."""

    def planners(self) -> Planners:
        """torch.distributed.checkpoint's planners for this backend's tensors, new ones at each
        call; DCP's defaults where it has none of its own."""
        return Planners()

    def optimizer_defaults(self) -> dict[str, Any]:
        """Optimizer options this backend needs, where the optimizer has them (the user's
        `optim.kwargs` win)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Backend figures for the end of the run (summary.json and the last line)."""
        return {}

    @abstractmethod
    def barrier(self) -> None: ...

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
    def replicas(self) -> int:
        """Data-parallel replicas: the devices that each take `data.batch_size` samples."""
        return self.dp_size * self.devices_per_process


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard); else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device` (copied asynchronously to a GPU)."""
    non_blocking = device.type == "cuda"
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


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
