"""What ddp and fsdp share: a torch.distributed process group on CPU (gloo) or GPU (nccl)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.config.parallel import ParallelSection
from launcher.errors import UsageError
from launcher.parallel import float8, regional_compile
from launcher.parallel.base import Strategy, local_shard
from launcher.parallel.control import ControlChannel
from launcher.parallel.dims import resolve_dims
from launcher.parallel.precision import MixedPrecision
from launcher.parallel.steps import PlainSteps
from launcher.startup_trace import mark


class TorchDistributedStrategy(Strategy):
    # Set where GPU runs also need collectives on CPU tensors (e.g. offloaded shards).
    cpu_collectives = False

    def __init__(
        self,
        accelerator: str,
        precision: str,
        *,
        compile: bool = False,  # train.compile
        tf32: bool = True,  # train.tf32
        float8: bool = False,  # train.float8
        compile_cache: Path | None = None,  # inductor's cache: the run folder's
        parallel: ParallelSection | None = None,  # the spec's degrees (launcher.parallel.dims)
    ) -> None:
        self.parallel = parallel or ParallelSection()
        self.accelerator = accelerator
        self.precision_name = precision
        self.compile, self.tf32, self.float8 = compile, tf32, float8
        self.guard = regional_compile.compile_guard() if compile else None
        if compile:
            regional_compile.use_cache(compile_cache)

    def setup(self) -> None:
        # torch.distributed's launcher defines these; nothing else passes between the layers.
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.dims = resolve_dims(self.parallel, self.name, self.world_size, per_node)
        if self.accelerator == "gpu":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            # fp32 matmuls on tensor cores (TF32): what every peer's fast path does.
            torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
            torch.backends.cudnn.allow_tf32 = self.tf32
            backend = "cpu:gloo,cuda:nccl" if self.cpu_collectives else "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        if not dist.is_initialized():
            dist.init_process_group(
                backend,
                device_id=self.device if self.device.type == "cuda" else None,
                timeout=timedelta(minutes=10),
            )
        self.precision = MixedPrecision(self.precision_name, self.device.type)
        # DDP and FSDP reduce the gradients in backward; buffers are rank 0's (`agree_buffers`).
        broadcast = broadcast_from_rank0 if self.world_size > 1 else None
        self.steps = PlainSteps(self.precision, broadcast_buffers=broadcast)
        # nccl reduces only GPU tensors, and a GPU flag read each step would stall the stream.
        control_group = dist.new_group(backend="gloo") if backend != "gloo" else None
        self.control = ControlChannel(self.world_size, control_group)
        mark("process-group")

    def prepare_layers(self, model: nn.Module) -> None:
        """Before the model is placed and distributed: its layers checked, and swapped for
        float8 ones under `train.float8` (`launcher.parallel.float8`)."""
        self.check_layers(model)
        if self.float8:
            capability = (
                torch.cuda.get_device_capability(self.device)
                if self.device.type == "cuda"
                else None
            )
            float8.check(self.accelerator, self.dims.tp if self.dims else 1, capability)
            self.say(float8.convert(model))

    def check_layers(self, model: nn.Module) -> None:
        """Layers torch cannot run on this run's device, refused in one line, before a
        traceback from inside the first forward would say it."""
        if self.device.type == "cpu" and any(
            isinstance(m, nn.SyncBatchNorm) for m in model.modules()
        ):
            raise UsageError(
                "recipe: the model has SyncBatchNorm layers, which torch runs on CUDA only; this "
                "run is on CPU",
                hint="On CPU use BatchNorm (every rank then takes rank 0's running statistics "
                "before an evaluation or a save), or run on GPUs.",
            )

    def compile_units(self, model: nn.Module, units: list[nn.Module]) -> None:
        """`train.compile`: compiles `units` (the model's repeated blocks) in place, or the
        whole model where there are none. Call after activation checkpointing and before
        the model is distributed, so that DDP's and FSDP's hooks stay outside the graphs."""
        if self.compile:
            self.say(regional_compile.compile_regions(model, units))

    def on_step_end(self, step: int) -> None:
        if self.guard is not None:
            self.guard.after_step(step)

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        if self.guard is not None:
            self.guard.absorb()
        yield
        if self.guard is not None:
            self.guard.after_phase(name, step)

    def summary(self) -> dict[str, Any]:
        if self.guard is None:
            return {}
        return {**self.guard.summary("dynamo"), "compile_cache": regional_compile.cache_use()}

    def say(self, text: str) -> None:
        """One line from rank 0."""
        if self.is_main:
            print(text, flush=True)

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    def drop_update(self, optimizer: torch.optim.Optimizer) -> None:
        self.precision.skip()
        optimizer.zero_grad(set_to_none=True)

    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        values = values.detach().to(self.device, torch.float64).clone()
        # gloo has no AVG, so sum and divide everywhere.
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        # The group's mean; then the groups' (one group: as it is).
        return self.engine.mean_across_groups(values / self.world_size)

    def barrier(self) -> None:
        dist.barrier()

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd, "precision": self.precision.state_dict()}

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        self.precision.load_state_dict(state.get("precision", {}))

    def load_whole_weights(
        self, model: nn.Module, read: Callable[[], dict[str, torch.Tensor]]
    ) -> None:
        # Rank 0 alone reads the file; each tensor is broadcast in turn and every rank keeps
        # its part (fsdp: its shard), so no other process ever holds the whole model.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(model, read() if self.is_main else {}, options=options)

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        mark("teardown")


def broadcast_from_rank0(buffers: list[torch.Tensor]) -> None:
    """Every process's `buffers` made rank 0's (each rank's local shard of a sharded one).

    Rank 0's, as DDP's rule is: DDP takes them at each forward, FSDP2 never does, and a
    checkpoint keeps whichever rank's DCP picks. So a run's evaluations, checkpoints and
    exports do not depend on its strategy, nor on where it was resumed."""
    for buffer in buffers:
        dist.broadcast(local_shard(buffer), src=0)
