"""What a checkpoint holds, as objects with `state_dict`/`load_state_dict` (torchtitan's
`Stateful`): the checkpointer is handed them and never packs state by hand."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from launcher.parallel.base import Strategy


class ModelState:
    """Model, optimizer and precision state, as torch.distributed.checkpoint saves them:
    each rank writes its own shards."""

    def __init__(self, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state_dict(self.model, self.optimizer, state)


class LoopState(Protocol):
    """The training loop's state (`launcher.worker.state.TrainState`): what every rank shares
    (`state_dict`, into meta.json) and each rank's own (`rank_state_dict`, rank-N.pt)."""

    def state_dict(self) -> dict[str, Any]: ...

    def rank_state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], own: dict[str, Any] | None) -> None:
        """`own` is this rank's saved state, or None when saved with another world size."""
