"""Strategy `ddp`: a full model replica per process, gradients all-reduced by DDP. A run of one
process is not wrapped at all: there is nothing to all-reduce, and DDP's hooks would only cost
time (a quarter of a small model's step)."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.parallel.shard_units import shard_units
from launcher.parallel.torch_distributed import TorchDistributedStrategy


class DDPStrategy(TorchDistributedStrategy):
    name = "ddp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.prepare_layers(model)
        model = model.to(self.device)
        if self.compile:
            self.compile_units(model, shard_units(model, None).modules)
        if self.world_size == 1:
            self.say("ddp: 1 process, nothing to all-reduce: the model runs unwrapped")
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Bucket views save a copy of every gradient into the all-reduce buckets.
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    def sync_gradients(
        self, model: nn.Module, sync: bool
    ) -> contextlib.AbstractContextManager[Any]:
        if sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()
