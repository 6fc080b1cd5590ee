"""Strategy `ddp`: a full model replica per process, gradients all-reduced by DDP."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.train.strategies.torch_distributed import TorchDistributedStrategy


class DDPStrategy(TorchDistributedStrategy):
    name = "ddp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Bucket views save a copy of every gradient into the all-reduce buckets.
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    def sync_gradients(
        self, model: nn.Module, sync: bool
    ) -> contextlib.AbstractContextManager[Any]:
        assert isinstance(model, DistributedDataParallel)
        return contextlib.nullcontext() if sync else model.no_sync()
