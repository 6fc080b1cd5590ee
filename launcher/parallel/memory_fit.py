"""Whether an estimated layout fits a device, and if not, a layout that would.

A pure function of the estimate (`launcher.parallel.memory_estimate`) and the device's bytes,
so that the decision a GPU launch makes is tested without a GPU. Other layouts are projected
from the one estimated: sharding divides parameters, gradients and optimizer state and
leaves the rest; activations grow with the micro-batch.
"""

from __future__ import annotations

import math

from launcher.metrics.memory import size_text
from launcher.parallel.memory_estimate import MemoryEstimate

# Of a device's memory, what a run may plan to use: the CUDA context, the caching
# allocator's fragmentation and the communication buffers take the rest.
USABLE_FRACTION = 0.9


def fit_advice(estimate: MemoryEstimate, device_bytes: int) -> str | None:
    """None where `estimate` fits a device of `device_bytes`; else one line that says so and
    names a layout that would fit (or what to change, where none of these would)."""
    usable = int(device_bytes * USABLE_FRACTION)
    if estimate.peak <= usable:
        return None
    head = (
        f"memory: {estimate.layout.describe()} needs about {size_text(estimate.peak)} per "
        f"device, more than the {size_text(usable)} a run can use of this GPU's "
        f"{size_text(device_bytes)}"
    )
    return f"{head}; {_layout_that_fits(estimate, usable)}"


def _layout_that_fits(estimate: MemoryEstimate, usable: int) -> str:
    layout, dims = estimate.layout, estimate.layout.dims
    shards = dims.dp_size  # every data-parallel rank a shard: fsdp, with no replicas
    sharded = _sharded_over(estimate, shards)
    shard_change = ""
    if shards > dims.dp_shard:
        shard_change = (
            f"launch.strategy: fsdp (sharded over all {shards} processes)"
            if layout.strategy == "ddp"
            else f"parallel.dp_shard: {shards} with parallel.dp_replicate: 1"
        )
        if sharded <= usable:
            return f"{shard_change} needs about {size_text(sharded)}"
    smaller_batch = _batch_that_fits(estimate, sharded, usable)
    if smaller_batch:
        per_sample = estimate.activations / layout.batch_size
        projected = sharded - estimate.activations + int(per_sample * smaller_batch)
        change = f"data.batch_size: {smaller_batch}" + (
            f" and {shard_change}" if shard_change else ""
        )
        return (
            f"{change} needs about {size_text(projected)} (raise train.grad_accum_steps to "
            "keep the batch per step)" + _checkpointing(estimate)
        )
    rest = estimate.peak - estimate.state  # what sharding leaves as it is
    if rest < usable:
        needed = math.ceil(estimate.state * dims.dp_shard / (usable - rest))
        return (
            f"fsdp sharded over at least {needed} processes (parallel.dp_shard: {needed}, on "
            "more devices or nodes)" + _checkpointing(estimate)
        )
    return "its activations alone do not fit: " + _checkpointing(estimate, first=True)


def _sharded_over(estimate: MemoryEstimate, shards: int) -> int:
    """The peak with the state sharded over `shards` processes, the rest as it is."""
    state_now = estimate.state
    return estimate.peak - state_now + state_now * estimate.layout.dims.dp_shard // shards


def _batch_that_fits(estimate: MemoryEstimate, peak: int, usable: int) -> int:
    """The largest micro-batch below the estimated one whose activations fit beside the rest
    of `peak`; 0 where none does."""
    batch = estimate.layout.batch_size
    per_sample = estimate.activations / batch
    if batch <= 1 or per_sample <= 0:
        return 0
    fits = int((usable - (peak - estimate.activations)) // per_sample)
    return min(fits, batch - 1) if fits >= 1 else 0


def _checkpointing(estimate: MemoryEstimate, first: bool = False) -> str:
    layout = estimate.layout
    if layout.strategy != "fsdp" or layout.fsdp.activation_checkpointing:
        return "" if not first else "lower data.batch_size, or use more devices"
    text = "fsdp.activation_checkpointing: true keeps only each unit's inputs"
    return text if first else f"; or {text}"
