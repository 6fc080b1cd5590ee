"""The names torch's wrappers add to a model's parameter and state-dict names, and the
recipe's own names without them: one list for the optimizer's groups, the weights' average,
`load.weights` and `train export`."""

from __future__ import annotations

from torch import nn

# The attributes through which wrappers hold a module: torch_xla FSDPv2's, torch.compile's,
# DDP's, FSDP1's and activation checkpointing's. torch's get_state_dict drops them from a
# checkpoint's names (FSDPv2's stays); a file saved from a wrapped model may have them.
WRAPPER_ATTRIBUTES = (
    "_orig_module",
    "_orig_mod",
    "module",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
)
# The launcher's own wrappers of a whole model, by class, with the attribute that holds it.
_MODEL_WRAPPERS = {
    "DistributedDataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "SpmdFullyShardedDataParallel": "_orig_module",
}


def without_wrappers(name: str, wrappers: tuple[str, ...] = WRAPPER_ATTRIBUTES) -> str:
    """`module._orig_mod.0.weight` -> `0.weight`: a name without `wrappers`."""
    return ".".join(part for part in name.split(".") if part not in wrappers)


def bare_model(model: nn.Module) -> nn.Module:
    """The recipe's own module inside the launcher's wrappers."""
    while type(model).__name__ in _MODEL_WRAPPERS:
        model = getattr(model, _MODEL_WRAPPERS[type(model).__name__])
    return model


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters under the names the recipe's own model gives them. Only the
    whole model is unwrapped by class, so that a submodule the recipe calls `module` keeps
    its name; inside, wrappers of parts (compiled or checkpointed blocks) are dropped."""
    inner = tuple(w for w in WRAPPER_ATTRIBUTES if w != "module")
    return [(without_wrappers(n, inner), p) for n, p in bare_model(model).named_parameters()]
