"""`train.compile`: torch.compile (inductor) of each repeated block, as torchtitan and
accelerate's regional compilation do.

A model's repeated blocks (the units fsdp shards: `shard_units`) are compiled in place, each
on its own: one block's graph serves all of its instances, so compiling takes the time of one
block, not of the whole model, and the hooks that DDP and FSDP put around a block stay
outside its graph. A model without repeated blocks is compiled whole. The compiled code is
cached in the run folder (inductor's cache, `RunLayout.compile_cache`), so a resumed run
loads it instead of compiling again.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from torch import nn

from launcher.parallel.compile_guard import CompileGuard


def use_cache(path: Path | None) -> None:
    """Inductor's cache (compiled kernels, graphs and autograd graphs) goes to `path`; a
    user's own TORCHINDUCTOR_CACHE_DIR wins. Before anything compiles."""
    if path is not None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def compile_regions(model: nn.Module, units: list[nn.Module]) -> str:
    """Compiles the forward of each of `units`, or of `model` where there are none; returns
    the line that says which. Each module keeps its place and its parameter names
    (checkpoints, fsdp's units), and the hooks around it (DDP's, FSDP's, activation
    checkpointing's) stay outside its graph. Not `Module.compile()`: it compiles `__call__`,
    which torch.compile skips as torch's own code for torch's own modules (`nn.Linear`)."""
    import torch

    for module in units or [model]:
        module.forward = torch.compile(module.forward)  # type: ignore[method-assign]
    if not units:
        return f"train.compile: {type(model).__name__} compiled whole (no repeated blocks)"
    counts = Counter(type(m).__name__ for m in reversed(units))
    blocks = ", ".join(f"{n} x {name}" for name, n in counts.items())
    return f"train.compile: {blocks} compiled block by block (regional compilation)"


def dynamo_graphs() -> int:
    """Graphs torch.compile has compiled (or loaded from its cache) in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cache_use() -> dict[str, int]:
    """Compiled graphs (forward and backward, AOTAutograd's) loaded from the cache (`hits`)
    and compiled afresh (`misses`) by this process."""
    from torch._dynamo.utils import counters

    autograd = counters["aot_autograd"]
    return {"hits": autograd["autograd_cache_hit"], "misses": autograd["autograd_cache_miss"]}


def compile_guard() -> CompileGuard:
    # The blocks' forward and backward compile at their first compiled micro-batch: the
    # second of step 1, or step 2's where a step has one, since the run's first micro-batch
    # runs eager while its FLOPs are counted (`launcher.worker.flops`). The first evaluation
    # (no gradients, eval mode) compiles its own graphs, which the loop's `phase` expects.
    return CompileGuard(
        dynamo_graphs,
        warmup_steps=2,
        compiler="torch.compile",
        strict_hint="Or mark the changing dimension dynamic, or set train.compile: false.",
    )
