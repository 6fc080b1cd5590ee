"""Initialising a sharded model exactly as the unsharded one would be, one parameter at a time.

After `to_empty`, each rank holds only its shard of every parameter. An init function calls
in-place random fills (`normal_`, `uniform_`, ...) on parameters in some order, drawing from
the global generator. Here every such fill on a sharded tensor generates the *full* tensor
from the same generator, as the unsharded model would have, and keeps only this rank's slice.
So every rank consumes the same random stream, the weights equal a plain `build_model()` under
the same seed bitwise, and the peak extra memory is one full parameter, never the model.
Deterministic element-wise ops (`mul_`, `zero_`, `clamp_`, ...) act on shards unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

# Functions that fill a whole tensor at once: random fills, and torch.nn.init's initialisers
# (some of which, like orthogonal_ and eye_, are not element-wise either).
_WHOLE_TENSOR_FILLS = {
    getattr(torch.nn.init, name)
    for name in dir(torch.nn.init)
    if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.nn.init, name))
} | {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.Tensor.random_,
}


class ShardedInit(TorchFunctionMode):
    # Inside __torch_function__ the mode is off, so nn.init.normal_'s own call of
    # Tensor.normal_ is not seen again: each initialiser is handled once, whole.
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func in _WHOLE_TENSOR_FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, DTensor):
                return _fill_shard(func, target, args, kwargs)
        return func(*args, **kwargs)


def _fill_shard(func: Any, target: DTensor, args: tuple, kwargs: dict) -> DTensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = torch.empty(target.shape, dtype=target.dtype, device="cpu")
    if args:
        func(full, *args[1:], **kwargs)
    else:
        func(**{**kwargs, "tensor": full})
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    local = target.to_local()
    with torch.no_grad():
        local.copy_(full[index].to(local.device))
    return target


def initialize(model: torch.nn.Module, init: Any) -> None:
    """Runs `init(model)` with sharded random fills made exact."""
    with torch.no_grad(), ShardedInit():
        init(model)
