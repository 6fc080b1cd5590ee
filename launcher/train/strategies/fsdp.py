"""Strategy `fsdp`: parameters, gradients and optimizer state sharded with FSDP2 (`fully_shard`).

The model is built on the meta device, sharded unit by unit, then materialised: each rank
allocates only its shards (`to_empty`) and the recipe's init fills them, exactly as the
unsharded model would be filled (see `sharded_init`). No rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from launcher.errors import UsageError
from launcher.spec import FSDPSection
from launcher.train.precision import dtype_of
from launcher.train.recipe import WeightInit
from launcher.train.strategies.sharded_init import initialize
from launcher.train.strategies.torch_distributed import TorchDistributedStrategy


class FSDPStrategy(TorchDistributedStrategy):
    name = "fsdp"

    def __init__(self, accelerator: str, precision: str, options: FSDPSection) -> None:
        super().__init__(accelerator, precision)
        self.options = options
        self.cpu_collectives = options.cpu_offload

    def build_model(self, factory: Callable[[], nn.Module], init: WeightInit) -> nn.Module:
        with torch.device("meta"):
            model = factory()
        self.wrap_model(model)
        # Offloaded shards live in CPU memory; FSDP moves them to the GPU when it needs them.
        model.to_empty(device="cpu" if self.options.cpu_offload else self.device)
        initialize(model, init)
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        units = shard_units(model, self.options.wrap)
        kwargs: dict[str, Any] = {
            "reshard_after_forward": self.options.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=dtype_of(self.options.param_dtype),
                reduce_dtype=dtype_of(self.options.reduce_dtype),
            ),
        }
        if self.options.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for unit in units:
            if self.options.activation_checkpointing:
                from torch.distributed._composable import checkpoint

                checkpoint(unit)
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def sync_gradients(
        self, model: nn.Module, sync: bool
    ) -> contextlib.AbstractContextManager[Any]:
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        return contextlib.nullcontext()


def shard_units(model: nn.Module, wrap: list[str] | None) -> list[nn.Module]:
    """The submodules that become their own FSDP unit, innermost first (FSDP2 shards bottom-up)."""
    if wrap is None:
        units = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
        return units[::-1]
    present = {type(m).__name__ for m in model.modules()}
    unknown = [name for name in wrap if name not in present]
    if unknown:
        raise UsageError(
            f"fsdp.wrap: {', '.join(unknown)} matches no module of the model",
            hint=f"Module classes in this model: {', '.join(sorted(present))}",
        )
    return [m for m in model.modules() if type(m).__name__ in wrap and m is not model][::-1]
