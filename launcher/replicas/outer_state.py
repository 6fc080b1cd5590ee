"""DiLoCo's outer state (`fault_tolerance.sync.method: diloco`): the weights every group agreed
on at the last sync, and the outer optimizer that moves them by the groups' averaged change.

Each process keeps its own part, as it holds the model: a replica's whole tensors under ddp,
its shards under fsdp (a copy of a DTensor is a DTensor of the same placement, so nothing is
gathered, and a checkpoint saves it sharded, as `outer.synced.<name>` beside `model.<name>`).
The outer optimizer steps plain local tensors: the same arithmetic on every torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from launcher.config.optim import optimizer_class
from launcher.parallel.base import local_shard
from launcher.parallel.wrapper_names import named_parameters


class OuterState:
    def __init__(self, model: nn.Module, outer_optim: dict[str, Any]) -> None:
        named = [(n, p) for n, p in named_parameters(model) if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.synced = [p.detach().clone() for p in self.params]
        # The optimizer's own parameters: the synced weights' local tensors, which alias them.
        self._local = [local_shard(t) for t in self.synced]
        options = {k: v for k, v in outer_optim.items() if k != "name"}
        self.optimizer = optimizer_class(outer_optim["name"])(self._local, **options)
        _start_state(self.optimizer)

    def pseudo_gradients(self, indexes: list[int]) -> list[torch.Tensor]:
        """What each weight of `indexes` (positions in `names`) moved since the last sync, as
        DiLoCo's outer gradient: the synced weight less the trained one (a descent direction,
        as a gradient is)."""
        with torch.no_grad():
            return [self._local[i] - local_shard(self.params[i]) for i in indexes]

    def step(self, indexes: list[int], averaged: list[torch.Tensor]) -> None:
        """The outer optimizer's step on the synced weights of `indexes`, by the groups'
        averaged pseudo-gradients (the others, without a gradient, stay as they are); the
        model then holds the new synced weights there."""
        for i, grad in zip(indexes, averaged, strict=True):
            self._local[i].grad = grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(
                [local_shard(self.params[i]) for i in indexes], [self._local[i] for i in indexes]
            )

    def take_model(self) -> None:
        """The synced weights become the model's (a checkpoint without outer state: the run
        was not a DiLoCo run when it saved)."""
        with torch.no_grad():
            torch._foreach_copy_(self._local, [local_shard(p) for p in self.params])

    def state_dict(self) -> dict[str, Any]:
        """By parameter name: the synced weights, and each one's outer optimizer state
        (tensors shaped as the weight keep its placement: a momentum, an Adam moment)."""
        state = self.optimizer.state
        return {
            "synced": dict(zip(self.names, self.synced, strict=True)),
            "optim": {
                name: {k: _placed_like(v, synced) for k, v in state[local].items()}
                for name, synced, local in zip(self.names, self.synced, self._local, strict=True)
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The checkpointer loads in place into `state_dict()`'s tensors; copy otherwise.
        with torch.no_grad():
            for name, synced, local in zip(self.names, self.synced, self._local, strict=True):
                if state["synced"][name] is not synced:
                    local.copy_(local_shard(state["synced"][name]))
                own = self.optimizer.state[local]
                for key, value in state["optim"][name].items():
                    if isinstance(own.get(key), torch.Tensor):
                        own[key].copy_(local_shard(value))
                    else:
                        own[key] = value


def _start_state(optimizer: torch.optim.Optimizer) -> None:
    """Every state tensor made now, by a step of zero gradients at a rate of 0, so that a
    checkpoint holds the same keys before and after the first sync (as torch's distributed
    checkpoint does for an optimizer: `_init_optim_state`)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rates = [group["lr"] for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def _placed_like(value: Any, synced: torch.Tensor) -> Any:
    """A local state tensor shaped as the weight's shard, as a DTensor placed as the weight
    (a checkpoint saves every rank's shard); scalars (a step count) as they are."""
    if not isinstance(value, torch.Tensor) or value.shape != local_shard(synced).shape:
        return value
    mesh = getattr(synced, "device_mesh", None)
    if mesh is None:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        value, mesh, synced.placements, shape=synced.shape, stride=synced.stride()
    )
