"""The replica engines, as both processes know them: the worker's engine (module and class,
imported by name by `launcher.parallel.build` in the workers) and the launcher's coordinator
(module and functions, imported by name by `launcher.launch`). Torch-free: the launcher reads
it before anything starts.

An engine is built as `cls(strategy, group, spec, attempt)` (`ReplicaEngine`'s contract). A
coordinator module has two functions: `check(spec, processes, nodes, listen)`, which refuses
before launch what the engine cannot run (UsageError), and `supervise(plan, console, spare)`,
which runs this machine's groups to their end and returns the `Outcome`. An engine without a
coordinator runs as one group, under the launcher's one agent.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from launcher.config.fault_tolerance import FaultToleranceSection
from launcher.errors import UsageError


@dataclass(frozen=True)
class EngineInfo:
    module: str  # the worker's engine: its module ...
    cls: str  # ... and its `ReplicaEngine` class
    # The launcher's side: the module of its `check` and `supervise`; None: one group, run
    # by the launcher's own agent.
    coordinator: str | None = None


ENGINES = {
    "none": EngineInfo("launcher.replicas.engine", "NoReplicas"),
    "torchft": EngineInfo(
        "launcher.replicas.torchft_engine",
        "TorchftEngine",
        coordinator="launcher.replicas.torchft_coordinator",
    ),
    # LocalSGD and DiLoCo: the same groups and coordinator, synced every few steps.
    "torchft_semi_sync": EngineInfo(
        "launcher.replicas.semi_sync",
        "SemiSyncEngine",
        coordinator="launcher.replicas.torchft_coordinator",
    ),
}


def engine_name(options: FaultToleranceSection) -> str:
    """The engine the spec's `fault_tolerance` section asks for."""
    if not options.enabled:
        return "none"
    return "torchft_semi_sync" if options.sync.semi_synchronous else "torchft"


def engine_info(options: FaultToleranceSection) -> EngineInfo:
    name = engine_name(options)
    if name not in ENGINES:  # `engine_name` gives only these: a name missing here is a bug
        raise UsageError(
            f"fault_tolerance: no replica engine {name!r} (available: {', '.join(sorted(ENGINES))})"
        )
    return ENGINES[name]


def engine_class(options: FaultToleranceSection) -> Any:
    """The class of the worker's engine, its module imported now (in a worker only: it
    imports torch)."""
    info = engine_info(options)
    return getattr(importlib.import_module(info.module), info.cls)


def coordinator_function(
    options: FaultToleranceSection, function: Literal["check", "supervise"]
) -> Callable[..., Any] | None:
    """The coordinator's `check` or `supervise` for the spec's engine, its module imported
    now; None where the engine has no coordinator (one group)."""
    info = engine_info(options)
    if info.coordinator is None:
        return None
    return getattr(importlib.import_module(info.coordinator), function)
