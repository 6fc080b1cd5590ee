"""Backends behind one interface (`Strategy`). Each lives in its own module, imported on demand
(the registry names it) so that e.g. torch_xla is only imported by the XLA strategies; and
so is the replica engine each strategy holds (`launcher.replicas.registry`)."""

from __future__ import annotations

import importlib
from pathlib import Path

from launcher.config.spec import RunSpec
from launcher.parallel.base import Strategy
from launcher.parallel.registry import strategy_info
from launcher.replicas.registry import engine_class
from launcher.rundir.worker_plan import ReplicaGroup
from launcher.startup_trace import mark


def build_strategy(
    spec: RunSpec,
    accelerator: str,
    compile_cache: Path | None = None,
    replica_group: ReplicaGroup | None = None,  # fault_tolerance's: this process's group
    attempt: int = 0,  # restarts so far (torch.distributed.elastic's count)
) -> Strategy:
    """The spec's strategy, holding the spec's replica engine; `compile_cache` is the compile
    cache the plan chose: XLA's persistent cache on TPUs, inductor's under `train.compile`."""
    mark("imports-and-spec")  # the worker's imports and its spec read
    info = strategy_info(spec.launch.strategy)
    options = (getattr(spec, info.section),) if info.section else ()
    cache = {"compile_cache": compile_cache} if compile_cache else {}
    train = {key: getattr(spec.train, key) for key in info.train_options}
    if info.dimensions:
        train["parallel"] = spec.parallel
    cls = getattr(importlib.import_module(info.module), info.cls)
    strategy: Strategy = cls(accelerator, spec.train.precision, *options, **train, **cache)
    strategy.engine = engine_class(spec.fault_tolerance)(strategy, replica_group, spec, attempt)
    return strategy


__all__ = ["Strategy", "build_strategy"]
