"""The global gradient norm, and clipping to it (`gradient_norm`: any model's), for sharded
(DTensor) gradients at the cost of one all-reduce per mesh axis they are sharded on (FSDP: one;
HSDP and tensor parallelism: each of theirs), and for a pipeline's stages (`pipeline_norm`).

torch's `clip_grad_norm_` over DTensors sends every per-parameter norm, the stack, the
coefficient and every multiplication through DTensor's dispatch (sharding propagation, on the
host, for each of hundreds of tensors), which stalls a GPU's launch queue: on an H100, fsdp's
step took 89 ms with clipping against 62 ms without. Here the norms and the scaling run on each
rank's local shards as plain tensors, and only the sum of squares crosses ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def gradient_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The global norm of the gradients, clipping them to `max_norm` when it is set. Sharded
    gradients (DTensors) give their global norm, the same on every rank."""
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = sharded_norm([p.grad for p in params], max_norm)  # type: ignore[misc]
    if sharded is not None:
        return sharded
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm


def sharded_norm(grads: list[torch.Tensor], max_norm: float | None) -> torch.Tensor | None:
    """The global L2 norm of `grads`, clipping them to `max_norm` when set: DTensors sharded or
    replicated over any mesh (FSDP's, HSDP's, tensor parallelism's, or several: under FSDP
    with TP, layer norms are sharded over the data axes only), and beside them plain tensors,
    whole on every process. None where there is no DTensor or one is partial (the caller uses
    torch's own path)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(g, DTensor) for g in grads):
        return None
    groups: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = {}
    for grad in grads:
        if not isinstance(grad, DTensor):  # whole on every process (tensor parallelism alone)
            groups.setdefault((None, ()), []).append(grad)
            continue
        if any(p.is_partial() for p in grad.placements):
            return None
        # The mesh axes it is sharded over (FSDP's over TP's is a `_StridedShard`, which is
        # not `is_shard()` in every torch): its local squares add up across them; across the
        # others (replicated) they are copies, counted once.
        sharded = tuple(axis for axis, p in enumerate(grad.placements) if not p.is_replicate())
        # The local tensors themselves: `to_local()` is an autograd function, a few
        # microseconds of host time per parameter and step, and gradients need no autograd.
        groups.setdefault((grad.device_mesh, sharded), []).append(grad._local_tensor)
    total = sum(_squares(shards, mesh, axes) for (mesh, axes), shards in groups.items())
    total = total.sqrt()  # type: ignore[union-attr]
    if max_norm is not None:
        # As torch's clip_grads_with_norm_: no host sync, a coefficient of at most 1.
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for shards in groups.values():
            torch._foreach_mul_(shards, coefficient.to(shards[0].device))
    return total


def _squares(shards: list[torch.Tensor], mesh: Any, axes: tuple[int, ...]) -> torch.Tensor:
    """The sum of squares of the whole tensors whose local shards are `shards`, sharded over
    the mesh `axes`: one all-reduce per axis."""
    device = shards[0].device
    # As torch's get_total_norm: each tensor's norm in its own dtype, then their norm in fp32.
    norms = torch._foreach_norm(shards, 2.0)
    if any(n.dtype != torch.float32 or n.device != device for n in norms):
        norms = [n.to(device, torch.float32) for n in norms]
    squares = torch.stack(norms).square().sum()
    for axis in axes:
        if mesh.size(axis) > 1:  # an axis of 1 (the experts' `efsdp`, say) has none to add
            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=mesh.get_group(axis))
    return squares


def pipeline_norm(
    grads: list[torch.Tensor],
    max_norm: float | None,
    group: Any,
    device: torch.device,
    counted: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The global norm of a pipeline's gradients, clipping them to `max_norm` when set: each
    process holds its stages' (sharded or whole), whose squares add up over the pipeline's
    `group` (the stages hold different parameters). `counted`: the gradients this process
    counts, where another process counts some of `grads` (a tied weight's); else all."""
    from torch.distributed.tensor import DTensor

    counted = grads if counted is None else counted
    local = sharded_norm(counted, None)  # over the stage's data and tensor-parallel axes
    if local is None:
        plain = [g.full_tensor() if isinstance(g, DTensor) else g for g in counted]
        local = torch.nn.utils.get_total_norm(plain) if plain else torch.zeros((), device=device)
    squares = local.to(device, torch.float32).square()
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    total = squares.sqrt()
    if max_norm is not None and grads:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        shards = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(shards, coefficient.to(shards[0].device))
    return total
