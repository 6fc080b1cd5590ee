"""Backends behind one interface (`Strategy`). Each lives in its own module, imported on demand
(the registry names it) so that e.g. torch_xla is only imported by the XLA strategies."""

from __future__ import annotations

import importlib
from pathlib import Path

from launcher.config.spec import RunSpec
from launcher.parallel.base import Strategy
from launcher.parallel.registry import strategy_info
from launcher.startup_trace import mark


def build_strategy(spec: RunSpec, accelerator: str, compile_cache: Path | None = None) -> Strategy:
    """The spec's strategy; `compile_cache` is the compile cache the plan chose: XLA's
    persistent cache on TPUs, inductor's under `train.compile`."""
    mark("imports-and-spec")  # the worker's imports and its spec read
    info = strategy_info(spec.launch.strategy)
    options = (getattr(spec, info.section),) if info.section else ()
    cache = {"compile_cache": compile_cache} if compile_cache else {}
    train = {key: getattr(spec.train, key) for key in info.train_options}
    if info.dimensions:
        train["parallel"] = spec.parallel
    return getattr(importlib.import_module(info.module), info.cls)(
        accelerator, spec.train.precision, *options, **train, **cache
    )


__all__ = ["Strategy", "build_strategy"]
