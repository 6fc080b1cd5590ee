"""Initialising a sharded model exactly as the unsharded one would be, one parameter at a time.

After `to_empty`, each rank holds only its shard of every parameter. An init function calls
in-place random fills (`normal_`, `uniform_`, ...) on parameters in some order, drawing from
the global generator. Here every such fill on a sharded tensor generates the *full* tensor
from the same generator, as the unsharded model would have, and keeps only this rank's slice.
So every rank consumes the same random stream, the weights are bitwise those of the unsharded
model running the same init from the same seed, and the peak extra memory is one full
parameter, never the model. (Whether that init is what the model's constructors do is
`WeightInit`'s question, not this module's.)
Deterministic element-wise ops (`mul_`, `zero_`, `clamp_`, ...) act on shards unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from launcher.errors import UsageError

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
_FILL_NAMES = {fill.__name__ for fill in _WHOLE_TENSOR_FILLS}


def _is_whole_tensor_fill(func: Any) -> bool:
    # transformers' initialisation patches its own copies of torch.nn.init's functions into
    # torch.nn.init (they skip tensors marked `_is_hf_initialized`), and torch hands the mode
    # whatever that module holds at the time.
    return func in _WHOLE_TENSOR_FILLS or (
        getattr(func, "__module__", None) == "transformers.initialization"
        and getattr(func, "__name__", None) in _FILL_NAMES
    )


class UnsetByInit(UsageError):
    """The initialisation left parameters or buffers of a materialised model unset."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        super().__init__(
            f"fsdp.init: meta: the model is built on the meta device, and its initialisation "
            f"left {shown} unset",
            hint="Give the recipe an init_weights(model) (or the model an init_weights()) that "
            "fills every parameter and buffer, or set fsdp.init: cpu (or auto) to build the "
            "model on CPU as ddp does.",
        )


class MetaBuildFailed(UsageError):
    """The model's constructor cannot run on the meta device: it reads a weight's value
    (`.item()`, an `if` on a tensor), which the meta device does not hold."""

    def __init__(self, error: Exception) -> None:
        text = str(error).strip()
        said = f": {text.splitlines()[0][:160]}" if text else ""
        self.reason = f"the model cannot be built on the meta device ({type(error).__name__}{said})"
        super().__init__(
            f"fsdp.init: meta: {self.reason}",
            hint="Its constructor reads a weight's value (.item(), an if on a tensor), which the "
            "meta device does not hold. Set fsdp.init: cpu (or auto) to build it on CPU as ddp "
            "does.",
        )


def build_on_meta(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`factory()` on the meta device: parameters without memory. Raises `MetaBuildFailed`
    where the constructor cannot run there; a `UsageError` of the recipe's passes as it is."""
    try:
        with torch.device("meta"):
            return factory()
    except UsageError:
        raise
    except Exception as exc:
        raise MetaBuildFailed(exc) from exc


class ShardedInit(TorchFunctionMode):
    """Also records every tensor written in place, so that what the init missed is known."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    # Inside __torch_function__ the mode is off, so nn.init.normal_'s own call of
    # Tensor.normal_ is not seen again: each initialiser is handled once, whole.
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        target = args[0] if args else kwargs.get("tensor")
        name = getattr(func, "__name__", "")
        if isinstance(target, torch.Tensor) and (name.endswith("_") or name == "__setitem__"):
            self.written.add(storage_of(target))
        if _is_whole_tensor_fill(func) and isinstance(target, DTensor):
            if getattr(target, "_is_hf_initialized", False):
                return target  # as transformers' own fills do
            return _fill_shard(func, target, args, kwargs)
        return func(*args, **kwargs)


def storage_of(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.data_ptr()


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
    """Runs `init(model)` with sharded random fills made exact. Memory from `to_empty` holds
    garbage, so a parameter or buffer that `init` never wrote is an error (`UnsetByInit`), not a
    silent NaN."""
    mode = ShardedInit()
    with torch.no_grad(), mode:
        init(model)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    missed = [name for name, t in tensors if t.numel() and storage_of(t) not in mode.written]
    if missed:
        raise UnsetByInit(missed)
