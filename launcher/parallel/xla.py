"""Strategy `xla`: torch_xla's classic data parallel. One replica per TPU device, started by
torch_xla's spawn (see launcher.worker.main), each with the whole model; gradients are all-reduced
by `xm.reduce_gradients`."""

from __future__ import annotations

from typing import Any

import torch
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from torch import nn
from torch.utils._pytree import tree_map

from launcher.parallel.control import ControlChannel
from launcher.parallel.steps import PlainSteps
from launcher.parallel.xla_common import XLAStrategyBase, join_checkpoint_group


class XLAStrategy(XLAStrategyBase):
    name = "xla"

    def setup(self) -> None:
        self.rank = xr.global_ordinal()
        self.world_size = xr.world_size()
        self.start_runtime(writes_cache=self.rank == 0)
        join_checkpoint_group(self.world_size)
        self.control = ControlChannel(self.world_size)
        # The first half of xm.optimizer_step, before clipping; `apply_update` is the second.
        # Buffers: rank 0's, as the torch.distributed strategies' (replicas update their own).
        self.steps = PlainSteps(
            self.precision,
            reduce_gradients=xm.reduce_gradients,
            broadcast_buffers=xm.collective_broadcast if self.world_size > 1 else None,
        )

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.world_size > 1:
            # Every replica built it from the same seed; this makes sure, as DDP does.
            xm.broadcast_master_param(model)
        return model

    def loader(self, loader: Any) -> Any:
        # Copies the next batches to the device in background threads while a step runs.
        return pl.MpDeviceLoader(loader, self.device)

    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        values = values.detach().float()
        if self.world_size == 1:
            return values
        return xm.all_reduce(xm.REDUCE_SUM, values, scale=1.0 / self.world_size)

    def barrier(self) -> None:
        if self.world_size > 1:
            xm.rendezvous("launcher")

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # Every replica holds the same values: DCP writes them once, from host copies.
        return tree_map(_to_cpu, super().state_dict(model, optimizer))


def _to_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value
