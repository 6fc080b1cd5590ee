"""Backends behind one interface (`Strategy`). Each lives in its own module, imported on demand
so that e.g. torch_xla is only imported by the XLA strategies."""

from __future__ import annotations

import importlib

from launcher.errors import UsageError
from launcher.spec import RunSpec
from launcher.strategies.base import Strategy

# name -> (module, class, the spec section of its own options or None)
_STRATEGIES = {
    "ddp": ("launcher.strategies.ddp", "DDPStrategy", None),
    "fsdp": ("launcher.strategies.fsdp", "FSDPStrategy", "fsdp"),
}


def build_strategy(spec: RunSpec, accelerator: str) -> Strategy:
    name = spec.launch.strategy
    if name not in _STRATEGIES:
        available = ", ".join(sorted(_STRATEGIES))
        raise UsageError(
            f"launch.strategy: {name!r} is not available in this version (available: {available})"
        )
    module, cls, section = _STRATEGIES[name]
    options = (getattr(spec, section),) if section else ()
    return getattr(importlib.import_module(module), cls)(
        accelerator, spec.train.precision, *options
    )


def available_strategies() -> list[str]:
    return sorted(_STRATEGIES)


__all__ = ["Strategy", "available_strategies", "build_strategy"]
