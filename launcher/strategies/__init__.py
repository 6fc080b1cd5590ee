"""Backends behind one interface (`Strategy`). Each lives in its own module, imported on demand
so that e.g. torch_xla is only imported by the XLA strategies."""

from __future__ import annotations

import importlib

from launcher.errors import UsageError
from launcher.strategies.base import Strategy

_STRATEGIES = {
    "ddp": ("launcher.strategies.ddp", "DDPStrategy"),
}


def build_strategy(name: str, accelerator: str, precision: str) -> Strategy:
    if name not in _STRATEGIES:
        available = ", ".join(sorted(_STRATEGIES))
        raise UsageError(
            f"launch.strategy: {name!r} is not available in this version (available: {available})"
        )
    module, cls = _STRATEGIES[name]
    return getattr(importlib.import_module(module), cls)(accelerator, precision)


def available_strategies() -> list[str]:
    return sorted(_STRATEGIES)


__all__ = ["Strategy", "available_strategies", "build_strategy"]
