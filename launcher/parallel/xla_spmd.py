"""Strategies `xla_spmd` and `xla_fsdp`: torch_xla SPMD. One process per host drives every
device; the global batch is sharded over a mesh of all devices, and the XLA compiler inserts
the collectives.

- `xla_spmd`: data parallel; parameters are replicated on every device.
- `xla_fsdp`: parameters (and so gradients and optimizer state) are sharded over the same
  mesh too, by FSDPv2 (`SpmdFullyShardedDataParallel`).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn

from launcher.parallel.base import Planners
from launcher.parallel.control import ControlChannel
from launcher.parallel.steps import PlainSteps
from launcher.parallel.xla_common import XLAStrategyBase, join_checkpoint_group

# FSDPv2 shards over the mesh axis named "fsdp"; the batch is split along the same axis.
_AXES = ("fsdp", "model")


class XLASpmdStrategy(XLAStrategyBase):
    name = "xla_spmd"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        xr.use_spmd()  # before the runtime starts: one process sees all of the host's devices

    def setup(self) -> None:
        self.rank = xr.process_index()
        self.world_size = xr.process_count()
        self.start_runtime(writes_cache=self.rank == 0)
        self.devices_per_process = xr.addressable_runtime_device_count()
        n = xr.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(n), (n, 1), _AXES)
        join_checkpoint_group(self.world_size)
        self.control = ControlChannel(self.world_size)
        # The gradients are global tensors (the compiler has already reduced them), and so
        # are the buffers: nothing to reduce or agree.
        self.steps = PlainSteps(self.precision)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def loader(self, loader: Any) -> Any:
        # Each host loads its own part of the global batch; every tensor is split along its
        # first dimension over all devices, straight from host memory.
        sharding = _BatchSharding(self.mesh, minibatch=self.world_size > 1)
        return pl.MpDeviceLoader(loader, self.device, input_sharding=sharding)

    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        # Computed from the global batch already, and the same on every host.
        return values.detach().float()

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def planners(self) -> Planners:
        # Each host writes and reads its own shards, straight from the devices.
        return Planners(save=_flat_save_planner(), load=_weights_only_load_planner())


class XLAFSDPStrategy(XLASpmdStrategy):
    name = "xla_fsdp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel,
        )

        # FSDPv2's own backward hooks fire for outputs whose inputs need no gradient (the
        # batch), which is expected; the warning would print once on every run.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        return SpmdFullyShardedDataParallel(model.to(self.device), mesh=self.mesh)


class _BatchSharding:
    """A ShardingSpec for whole batches: dimension 0 of every tensor over the mesh, whatever
    the tensor's rank (torch_xla's own spec fits one rank and leaves other tensors whole)."""

    def __init__(self, mesh: xs.Mesh, minibatch: bool) -> None:
        self.mesh = mesh
        self.minibatch = minibatch  # each host passes its own part of the global batch
        self._specs: dict[int, xs.ShardingSpec] = {}

    def xla_spec(self, tensor: torch.Tensor) -> Any:
        if tensor.dim() == 0:
            return None
        if tensor.dim() not in self._specs:
            # Dimension 0 over both axes (the model axis has size 1): torch_xla's ShardingSpec
            # cannot tile a 1-D tensor (class labels, say) over one axis of a 2-D mesh.
            partition = (_AXES,) + (None,) * (tensor.dim() - 1)
            self._specs[tensor.dim()] = xs.ShardingSpec(self.mesh, partition, self.minibatch)
        return self._specs[tensor.dim()].xla_spec(tensor)


def _flat_save_planner() -> Any:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class FlatSPMDSavePlanner(SPMDSavePlanner):
        """torch_xla's planner flattens less than DCP's (optimizer param_groups would be one
        pickled blob), so the state is flattened DCP's way first: the same keys as every
        other checkpoint."""

        def set_up_planner(
            self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
        ) -> None:
            super().set_up_planner(flatten_state_dict(state_dict)[0], is_coordinator)

    return FlatSPMDSavePlanner()


def _weights_only_load_planner() -> Any:
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    class WeightsOnlySPMDLoadPlanner(SPMDLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            obj = torch.load(value, weights_only=True)  # never unpickle code
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    return WeightsOnlySPMDLoadPlanner()
