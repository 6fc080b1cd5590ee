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


# Environment a strategy's CPU workers start with. fsdp gathers and frees every block's
# parameters each step; glibc then raises its mmap threshold and keeps those buffers on the
# heap. On the 100M GPT a fixed threshold cut peak RSS per rank from 2265 to 1285 MB at the
# same speed (BENCHMARKS.md).
_CPU_WORKER_ENV = {"fsdp": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}


def worker_env(name: str, accelerator: str) -> dict[str, str]:
    return dict(_CPU_WORKER_ENV.get(name, {})) if accelerator == "cpu" else {}


def available_strategies() -> list[str]:
    return sorted(_STRATEGIES)


__all__ = ["Strategy", "available_strategies", "build_strategy", "worker_env"]
