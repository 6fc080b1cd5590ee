"""Control messages between a run's processes: small host values (a flag, a path, a size) that
every process must agree on, apart from the training step's tensors. Every backend sends them
the same way, over torch.distributed; a strategy holds one (`Strategy.control`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ControlChannel:
    """Collectives on small host values among `world_size` processes, over `group` (a CPU,
    gloo, process group; None: the default group). Every method is collective: every process
    calls it. On one process, or before a process group exists, each answers for this process
    alone."""

    def __init__(self, world_size: int, group: Any = None) -> None:
        self.world_size = world_size
        self.group = group

    def _alone(self) -> bool:
        return self.world_size == 1 or not dist.is_initialized()

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any process."""
        return self.any_rank_each([flag])[0]

    def any_rank_each(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether any process sets it: one small all-reduce."""
        if self._alone():
            return list(flags)
        value = torch.tensor([int(flag) for flag in flags])
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in value.tolist()]

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (picklable), by rank; for rare messages."""
        if self._alone():
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def from_main(self, value: Any) -> Any:
        """Rank 0's `value` (picklable) on every process."""
        if self._alone():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
