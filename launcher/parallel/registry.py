"""The strategies, as both processes know them: their names, the module that implements each
(imported by name inside the workers only, so that e.g. torch_xla is never imported by the
launcher), the accelerators each runs on and how its processes are started."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from launcher.errors import UsageError

# How a node's replicas come to be:
# - per_device: the elastic agent starts one worker process per device (torchrun's way);
# - xla_spawn: the agent starts one worker, which starts a replica per TPU device through
#   torch_xla's spawn (`xmp.spawn`), as torch_xla's multi-process data parallel requires;
# - per_host: the agent starts one worker that drives every device of the host (XLA SPMD).
Processes = Literal["per_device", "xla_spawn", "per_host"]


@dataclass(frozen=True)
class StrategyInfo:
    module: str
    cls: str
    accelerators: tuple[str, ...]
    processes: Processes = "per_device"
    section: str | None = None  # the spec section of its own options
    async_checkpoints: bool = True
    # Environment of its CPU workers. fsdp gathers and frees every block's parameters each
    # step; glibc then raises its mmap threshold and keeps those buffers on the heap. On the
    # 100M GPT a fixed threshold cut peak RSS per rank from 2265 to 1285 MB at the same speed
    # (BENCHMARKS.md).
    cpu_env: dict[str, str] = field(default_factory=dict)
    # The `train` keys its constructor takes as keyword arguments, besides the precision.
    train_options: tuple[str, ...] = ()
    # Whether it takes the `parallel` section's dimensions (launcher.parallel.dims).
    dimensions: bool = False


STRATEGIES = {
    "ddp": StrategyInfo(
        "launcher.parallel.ddp",
        "DDPStrategy",
        ("cpu", "gpu"),
        train_options=("compile", "tf32", "float8"),
        dimensions=True,
    ),
    "fsdp": StrategyInfo(
        "launcher.parallel.fsdp",
        "FSDPStrategy",
        ("cpu", "gpu"),
        section="fsdp",
        cpu_env={"MALLOC_MMAP_THRESHOLD_": "1048576"},
        train_options=("compile", "tf32", "float8"),
        dimensions=True,
    ),
    "xla": StrategyInfo(
        "launcher.parallel.xla",
        "XLAStrategy",
        ("tpu",),
        processes="xla_spawn",
        section="xla",
        async_checkpoints=False,
    ),
    "xla_spmd": StrategyInfo(
        "launcher.parallel.xla_spmd",
        "XLASpmdStrategy",
        ("tpu",),
        processes="per_host",
        section="xla",
        async_checkpoints=False,
    ),
    "xla_fsdp": StrategyInfo(
        "launcher.parallel.xla_spmd",
        "XLAFSDPStrategy",
        ("tpu",),
        processes="per_host",
        section="xla",
        async_checkpoints=False,
    ),
}


def strategy_info(name: str) -> StrategyInfo:
    if name not in STRATEGIES:
        raise UsageError(
            f"launch.strategy: {name!r} is not a strategy (available: "
            f"{', '.join(sorted(STRATEGIES))})"
        )
    return STRATEGIES[name]


def worker_env(name: str, accelerator: str) -> dict[str, str]:
    return dict(strategy_info(name).cpu_env) if accelerator == "cpu" else {}


__all__ = [
    "STRATEGIES",
    "StrategyInfo",
    "strategy_info",
    "worker_env",
]
