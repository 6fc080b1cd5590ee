"""The replica engine: what happens across replica groups, a part every strategy holds
(`Strategy.engine`), built by `launcher.parallel.build` from the registry's entry
(`launcher.replicas.registry`). A run without replica groups is one group: `NoReplicas`.

The loop meets it at four points of a step, and never asks which engine it is:

1. `begin_step(step)`, before the step's first micro-batch: True where this process's state
   was replaced meanwhile (healed from a peer group), so the loop takes its data from there;
2. `average_gradients(model)`, right before the strategy finishes the gradients (the group's
   own reduction done): the average across the groups;
3. `commit_step()`, once the gradients are final: whether the step counts (False: a peer
   group was lost inside it, and the loop takes the step again);
4. `end_step(step, last)`, once the update is applied, before the step's checkpoint: where
   an engine that syncs the groups every few steps (LocalSGD, DiLoCo) syncs them; True, as
   from `begin_step`, where this process's state was replaced.

State of its own that checkpoints keep (DiLoCo's outer weights and optimizer) it hands the
loop once, from `extra_state(model)`; the loop saves and heals it with the model's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from launcher.checkpoint.state import EngineState, LoopState, ModelState
from launcher.rundir.worker_plan import ReplicaGroup

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


class ReplicaEngine(ABC):
    """What happens across replica groups. Built as `cls(strategy, group, spec, attempt)`:
    the strategy that holds it, this process's group as the worker plan says (None: one
    group), the run's spec, and the restarts of this process's group so far."""

    # -- where this process stands ---------------------------------------------------------

    @property
    @abstractmethod
    def group_index(self) -> int:
        """This process's replica group, from 0: the strategy's `dp_rank` counts the groups
        before it."""

    @property
    @abstractmethod
    def group_count(self) -> int:
        """Replica groups of the run (the strategy's `dp_size` is that many groups')."""

    @property
    @abstractmethod
    def log_rank(self) -> int:
        """This process's rank in the run's logs and heartbeats: the strategy's rank, which
        each group counts from 0, counted across the groups."""

    def run_rank(self, rank: int) -> int:
        """The run's rank (`log_rank`'s numbering) of this group's process of rank `rank`."""
        return rank

    @property
    def paces_together(self) -> bool:
        """Whether the groups wait for each other at every step (an average every step), so
        that a slow rank of one group sets every group's pace: the straggler watch then
        compares the ranks of the whole run (`figures_across_groups`), not a group's own."""
        return False

    def figures_across_groups(self, rows: list[list[float]]) -> dict[int, list[float]]:
        """Collective across the groups where `paces_together`: `rows`, each of this group's
        ranks' figures (the same on each of its processes), with every other group's of the
        step's quorum; by the run's rank."""
        return {self.run_rank(rank): row for rank, row in enumerate(rows)}

    @property
    @abstractmethod
    def writes_records(self) -> bool:
        """Whether this process writes the run's metrics and trackers: one process of all."""

    @property
    @abstractmethod
    def heals_from_peers(self) -> bool:
        """Whether a restarted process takes its state from a live peer group instead of the
        newest checkpoint."""

    @property
    @abstractmethod
    def saves_checkpoints(self) -> bool:
        """Whether this process's group takes part in a checkpoint's save (collective)."""

    # -- its life ----------------------------------------------------------------------------

    @abstractmethod
    def start(self) -> None:
        """Once the strategy is set up (its process group joined, its device picked)."""

    @abstractmethod
    def stop(self) -> None:
        """At the end of a run that trained to it, before the strategy's teardown."""

    @abstractmethod
    def share_state(self, model: ModelState, loop: LoopState, reload: Callable[[], bool]) -> None:
        """What a peer group copies to heal this one (the model's state and the loop's), and
        `reload`, which restores the newest checkpoint where no peer is left to heal from
        (collective; whether it found one)."""

    # -- the step ----------------------------------------------------------------------------

    @abstractmethod
    def begin_step(self, step: int) -> bool:
        """Before step `step`'s first micro-batch. True where this process's state was
        replaced meanwhile, so the loop takes its data from the new position."""

    @abstractmethod
    def average_gradients(self, model: nn.Module) -> None:
        """The step's gradients (each process's shards) averaged with the other groups',
        in place, before the strategy finishes them (unscales, clips)."""

    @abstractmethod
    def mean_across_groups(self, values: torch.Tensor) -> torch.Tensor:
        """`values`, a group's mean of metrics (the strategy's `reduce_mean`), as the mean of
        every group's: a run's metrics and evaluations are the run's, not a group's share."""

    @abstractmethod
    def commit_step(self) -> bool:
        """Once the step's gradients are final, on every process: whether the step counts."""

    def end_step(self, step: int, last: bool) -> bool:
        """After step `step`'s update (`last`: the run's last step), before its checkpoint.
        True where this process's state was replaced meanwhile (healed from a peer group)."""
        return False

    def metrics(self) -> dict[str, float]:
        """Figures of the engine's own for the next metrics record (its bytes between
        groups, a sync's losses); asked once per record, from the process that writes it."""
        return {}

    def extra_state(self, model: nn.Module) -> EngineState | None:
        """State of the engine's own that a checkpoint keeps beside the model's, and a healing
        group receives with it (made once, from the built model); None: none."""
        return None

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """The engine's part of summary.json (nothing for one group)."""


class RankedProcess(Protocol):
    """What `NoReplicas` reads of the strategy that holds it (`launcher.parallel.base.
    Strategy`, whose module imports this one: so a protocol, not the class)."""

    @property
    def rank(self) -> int: ...

    @property
    def is_main(self) -> bool: ...


class NoReplicas(ReplicaEngine):
    """One group, which is the whole run: nothing is shared, averaged or voted on."""

    def __init__(
        self,
        strategy: RankedProcess,
        group: ReplicaGroup | None = None,
        spec: RunSpec | None = None,
        attempt: int = 0,
    ) -> None:
        self.strategy = strategy

    @property
    def group_index(self) -> int:
        return 0

    @property
    def group_count(self) -> int:
        return 1

    @property
    def log_rank(self) -> int:
        return self.strategy.rank

    @property
    def writes_records(self) -> bool:
        return self.strategy.is_main

    @property
    def heals_from_peers(self) -> bool:
        return False

    @property
    def saves_checkpoints(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def share_state(self, model: ModelState, loop: LoopState, reload: Callable[[], bool]) -> None:
        pass

    def begin_step(self, step: int) -> bool:
        return False

    def average_gradients(self, model: nn.Module) -> None:
        pass

    def mean_across_groups(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def commit_step(self) -> bool:
        return True

    def summary(self) -> dict[str, Any]:
        return {}
