"""What a checkpoint holds, as objects with `state_dict`/`load_state_dict` (torchtitan's
`Stateful`): the checkpointer is handed them and never packs state by hand."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class StateDicts(Protocol):
    """What a checkpoint asks of the strategy (`launcher.parallel.base.Strategy`): its state
    dicts. A protocol, since the strategy's replica engine is typed by this module."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None: ...


class WeightAverage(Protocol):
    """`train.ema`'s average of the weights (`launcher.worker.ema.WeightAverage`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def restart(self) -> None: ...


class EngineState(Protocol):
    """The replica engine's own state (`ReplicaEngine.extra_state`: DiLoCo's outer weights
    and optimizer, `launcher.replicas.outer_state.OuterState`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def take_model(self) -> None:
        """Starts from the model's weights as they are (a checkpoint that holds none)."""


class ModelState:
    """Model, optimizer and precision state, the weights' average (`train.ema`) and the
    replica engine's state where there are, as torch.distributed.checkpoint saves them: each
    rank writes its own shards."""

    def __init__(
        self,
        strategy: StateDicts,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        average: WeightAverage | None = None,
        engine: EngineState | None = None,
    ) -> None:
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.average, self.engine = average, engine

    def state_dict(self) -> dict[str, Any]:
        state = self.strategy.state_dict(self.model, self.optimizer)
        if self.average is not None:
            state["ema"] = self.average.state_dict()
        if self.engine is not None:
            state["engine"] = self.engine.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`state` without an `ema` (or `engine`) entry, where the run has one: the
        checkpoint has none (`train.ema` or `fault_tolerance.sync` was set on resume), so it
        starts from the loaded weights."""
        self.strategy.load_state_dict(self.model, self.optimizer, state)
        if self.average is not None:
            if "ema" in state:
                self.average.load_state_dict(state["ema"])
            else:
                self.average.restart()
        if self.engine is not None:
            if "engine" in state:
                self.engine.load_state_dict(state["engine"])
            else:
                self.engine.take_model()


class StepCount(Protocol):
    """Where the loop stands (`launcher.worker.state.Progress`)."""

    step: int  # optimizer steps taken


class LoopState(Protocol):
    """The training loop's state (`launcher.worker.state.TrainState`): what every rank shares
    (`state_dict`, into meta.json) and each rank's own (`rank_state_dict`, rank-N.pt), and
    where it stands (`progress`: a replica engine heals a group to a peer's step)."""

    @property
    def progress(self) -> StepCount: ...

    def recent_loss(self) -> torch.Tensor | None:
        """The mean loss of this process's steps since the last log line, on the device
        (None: no step since)."""

    def state_dict(self) -> dict[str, Any]: ...

    def rank_state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], own: dict[str, Any] | None) -> None:
        """`own` is this rank's saved state, or None when saved with another world size."""
