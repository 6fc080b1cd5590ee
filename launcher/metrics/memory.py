"""Measuring what a replica holds: bytes of its own shards of parameters, gradients and
optimizer state, and its process memory."""

from __future__ import annotations

import resource
from collections.abc import Iterable

import psutil
import torch


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank stores: a sharded (DTensor) tensor counts its local shard only."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state on this rank: its tensors, less the scalar step
    counters, which torch keeps in host memory unless the optimizer is fused or capturable."""
    return local_bytes(
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def size_text(n: int) -> str:
    """`n` bytes as a person reads them: 1.2 GiB, 340.0 MiB, 12.5 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
