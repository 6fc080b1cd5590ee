"""Per-step fault tolerance on torchft (`fault_tolerance`): the engine of a ddp or fsdp strategy
whose processes form one replica group of several, which average their gradients every step
through torchft's Manager, and heal a restarted group from a live one's memory.

Each group is an ordinary run of its strategy (its own process group, ranks from 0, its own
DDP or FSDP); torchft adds, for each process, a process group with the processes of the same
rank in the other groups, rebuilt at every change of the quorum. A step:

1. `begin_step`: the quorum (which groups train this step), synchronously. A group behind
   the others (restarted) receives a live group's state here, over HTTP, and the loop takes
   its data from the new position. Random streams are reseeded from (seed, data-parallel
   rank, step), so a healed group draws its own numbers, as it would have.
2. `average_gradients`: the group's gradients (each process's shard, under fsdp) averaged
   with the other groups' in one flat buffer per dtype, before the strategy clips them: the
   global norm.
3. `commit_step`: torchft's vote. A collective that failed (a group died inside it) makes
   the step void on every group that saw it: the loop drops it and takes it again.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp
from torchft import Manager

from launcher.checkpoint.state import LoopState, ModelState
from launcher.config.spec import RunSpec
from launcher.errors import RunError
from launcher.parallel.base import Strategy, local_shard
from launcher.parallel.rng import rank_seed
from launcher.replicas.engine import ReplicaEngine
from launcher.replicas.peer_state import packed, unpacked
from launcher.replicas.torchft_manager import StrangerInQuorum, make_manager
from launcher.rundir import fault_events
from launcher.rundir.layout import RunLayout
from launcher.rundir.worker_plan import ReplicaGroup

STATE_KEY = "launcher"  # the Manager's name for what a healing group receives


class TorchftEngine(ReplicaEngine):
    def __init__(
        self, strategy: Strategy, group: ReplicaGroup | None, spec: RunSpec, attempt: int
    ) -> None:
        if group is None:  # the launcher's coordinator writes one into every worker plan
            raise RunError("fault_tolerance: this worker's plan names no replica group")
        self.strategy, self.group, self.options = strategy, group, spec.fault_tolerance
        self.seed_base = spec.run.seed
        self.restarted = attempt > 0
        self._manager: Manager | None = None
        self._healed = False
        self._joined = False
        self._in_quorum = False  # a quorum taken for the step under way: never twice
        self._groups = group.count  # in the last quorum
        self._quorum: object = None  # the last quorum's id
        self._shared: tuple[ModelState, LoopState, Callable[[], bool]] | None = None
        self.bytes_sent = 0  # to the other groups, by this process: the summary's figure
        self.steps_taken = 0  # by this process, in this attempt
        self._recorded = (0, 0)  # bytes sent and steps taken at the last metrics record

    @property
    def manager(self) -> Manager:
        if self._manager is None:
            raise RuntimeError("the replica engine has not started (strategy.engine.start())")
        return self._manager

    def start(self) -> None:
        strategy = self.strategy
        self._manager = make_manager(
            self.group, self.options, strategy.device, strategy.rank, strategy.world_size
        )

    # -- which process does what ----------------------------------------------------------

    @property
    def group_index(self) -> int:
        return self.group.index

    @property
    def group_count(self) -> int:
        return self.group.count

    @property
    def log_rank(self) -> int:
        return self.run_rank(self.strategy.rank)

    def run_rank(self, rank: int) -> int:
        return self.group.global_rank(rank)

    @property
    def paces_together(self) -> bool:
        return True  # the gradients' average, every step

    def figures_across_groups(self, rows: list[list[float]]) -> dict[int, list[float]]:
        """One sum across the groups of a table with a row per rank of the run (group g's
        rank r at g * size + r, as `ReplicaGroup.ranks` numbers them): each group fills its
        own, behind a 1 that says the row is there. A group outside the quorum (lost, or
        healing: torchft zeroes what it sends) leaves its rows out."""
        width = len(rows[0]) if rows else 0
        table = torch.zeros(self.group.count, self.group.size, width + 1, dtype=torch.float64)
        table[self.group.index, :, 0] = 1.0
        table[self.group.index, :, 1:] = torch.tensor(rows, dtype=torch.float64)
        table = table.to(self.strategy.device)
        self.manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored():  # a group lost inside it: this group's own figures
            return super().figures_across_groups(rows)
        ranks = table.reshape(-1, width + 1).tolist()
        return {rank: row[1:] for rank, row in enumerate(ranks) if row[0] > 0.5}

    @property
    def writes_records(self) -> bool:
        return self.group.index == 0 and self.strategy.is_main

    @property
    def heals_from_peers(self) -> bool:
        return True

    @property
    def saves_checkpoints(self) -> bool:
        # The first group of the step's quorum: group 0 while it is there, another while it heals.
        return self._manager is None or self._manager.participating_rank() == 0

    # -- the step --------------------------------------------------------------------------

    def share_state(self, model: ModelState, loop: LoopState, reload: Callable[[], bool]) -> None:
        self._shared = (model, loop, reload)
        self.manager.register_state_dict_fn(STATE_KEY, self._load_peer_state, self._peer_state)

    def begin_step(self, step: int) -> bool:
        manager = self.manager
        if self._in_quorum:  # the loop restarted its data for this step (healed)
            return False
        self._in_quorum = True
        if not self._joined:  # a checkpoint restored, or step 0: where this group stands
            manager.load_state_dict({"step": step, "batches_committed": 0})
        started = time.perf_counter()
        self._start_quorum()
        if not self._joined and not self.restarted:
            self._wait_for_every_group()
        moved, self._healed = self._healed, False
        if moved:
            healed = {"step": manager.current_step(), "heal_s": time.perf_counter() - started}
            self._record("healed", **healed)
        elif not self._joined and self.restarted and manager.current_step() == 0:
            moved = self._reload_without_peers()
        self._joined = True
        self._note_quorum(manager.num_participants())
        seed = rank_seed(self.seed_base, self.strategy.dp_rank, manager.current_step() + 1)
        self.strategy.rng.seed(seed)
        return moved

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except StrangerInQuorum as stranger:
            self._record("stranger", replica=stranger.replica_id)
            raise RunError(
                f"fault_tolerance: a replica that is not one of this run's groups joined its "
                f"quorum ({stranger.replica_id!r}); the run stops rather than trust it"
            ) from None

    def _wait_for_every_group(self) -> None:
        """The run's first step waits for every group (up to `timeout_s`): the nodes of a run
        start seconds apart, and a group that stepped alone meanwhile would have the others
        copy its state, or, lost before they came, leave them to start over."""
        deadline = time.monotonic() + self.options.timeout_s
        while self.manager.num_participants() < self.group.count and time.monotonic() < deadline:
            time.sleep(0.2)
            self._start_quorum()

    def _note_quorum(self, groups: int) -> None:
        """Records each new quorum (a group lost or back, also where their count stays: a
        lost group may be back before the next step), and says each change of their count."""
        step, count = self.manager.current_step(), self.group.count
        quorum = getattr(self.manager, "_quorum_id", None)  # torchft's; no public reader
        if quorum != self._quorum:
            self._quorum = quorum
            self._record("quorum", step=step, groups=groups, of=count)
        if groups != self._groups:
            self._groups = groups
            self._say(f"step {step + 1}: {groups} of {count} replica groups train")

    def _reload_without_peers(self) -> bool:
        """A restarted group that found no group ahead of it (every group was lost at once,
        or none has stepped yet) goes on from the newest checkpoint, as a restarted job does."""
        _, loop, reload = self._state_shared()
        if not reload():
            return False
        self.manager.load_state_dict({"step": loop.progress.step, "batches_committed": 0})
        return True

    def average_gradients(self, model: nn.Module) -> None:
        """Each process's gradients (its shards) averaged with the same rank's in the other
        groups. A failed all-reduce leaves the step to `commit_step`."""
        self.average_across_groups(
            [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
        )

    def average_across_groups(self, tensors: list[torch.Tensor]) -> None:
        """`tensors` (plain, local) averaged in place with the same rank's in the other groups
        of the quorum, one all-reduce per dtype; what this process sent is counted in
        `bytes_sent`. A healing group's are counted as zeros (torchft's rule)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            self.manager.allreduce(flat).wait()
            self.bytes_sent += flat.numel() * flat.element_size()
            offset = 0
            for tensor in same:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def mean_across_groups(self, values: torch.Tensor) -> torch.Tensor:
        # A group lost meanwhile leaves the groups' own mean (the step then is void).
        self.manager.allreduce(values).wait()
        return values

    def commit_step(self) -> bool:
        self._in_quorum = False
        manager = self.manager
        error = manager.errored()
        committed = bool(manager.should_commit())
        self.steps_taken += committed
        if not committed:
            why = first_words(str(error.original_exception)) if error else "a peer's vote"
            self._say(f"step {manager.current_step() + 1} is void ({why}); taking it again")
        return committed

    def stop(self) -> None:
        if self._shared is not None:  # what the groups should agree on
            model, loop, _ = self._shared
            step, weights = loop.progress.step, digest(model.model.parameters())
            self._record(
                "finished", every_rank=True, rank=self.strategy.rank, step=step, digest=weights
            )
        if self._manager is not None:
            self._manager.shutdown(wait=False)

    def metrics(self) -> dict[str, float]:
        """The bytes this process sent to the other groups per step, since the last record."""
        sent, steps = self.bytes_sent - self._recorded[0], self.steps_taken - self._recorded[1]
        self._recorded = (self.bytes_sent, self.steps_taken)
        return {"groups/bytes_per_step": sent / steps} if steps else {}

    def summary(self) -> dict[str, Any]:
        events = fault_events.read(Path(self.group.events))
        sent = {"bytes": self.bytes_sent, "per_step": self.bytes_sent // max(self.steps_taken, 1)}
        return {
            "fault_tolerance": {
                "replica_group": self.group.index,
                **fault_events.summary(events),
                "sent_to_other_groups": sent,  # by rank 0 of the group that writes it
            }
        }

    # -- what this process says and records ------------------------------------------------

    def _say(self, text: str) -> None:
        """One line, from the group's rank 0."""
        if self.strategy.is_main:
            print(text, flush=True)

    def _record(self, event: str, every_rank: bool = False, **fields: Any) -> None:
        """One event of this group (`launcher.rundir.fault_events`), into this process's own
        file: by the group's rank 0, or by `every_rank`."""
        if not self.group.events or not (every_rank or self.strategy.is_main):
            return
        path = RunLayout.rank_events(Path(self.group.events), self.log_rank)
        fault_events.record(path, event, group=self.group.index, **fields)

    # -- what a healing group receives -----------------------------------------------------

    def _state_shared(self) -> tuple[ModelState, LoopState, Callable[[], bool]]:
        if self._shared is None:
            raise RuntimeError("the loop shared no state with the replica engine (share_state)")
        return self._shared

    def _peer_state(self) -> dict[str, Any]:
        model, loop, _ = self._state_shared()
        return {"model": packed(model.state_dict()), "loop": loop.state_dict()}

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        model, loop, _ = self._state_shared()
        mesh = _mesh_of(model.model)
        model.load_state_dict(unpacked(state["model"], mesh))
        loop.load_state_dict(state["loop"], None)
        self._healed = True


def first_words(message: str, limit: int = 160) -> str:
    """A collective's error in one line that reads: its first line, cut at a word."""
    line = (message.strip().splitlines() or ["no message"])[0]
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def digest(params: Iterable[torch.Tensor]) -> str:
    """A hash of this process's part of `params` (its shards): alike in every group, rank by
    rank, where the groups agree."""
    hashed = hashlib.sha256()
    for param in params:
        hashed.update(local_shard(param.detach()).cpu().contiguous().view(torch.uint8).numpy())
    return hashed.hexdigest()[:16]


def _mesh_of(model: nn.Module) -> Any:
    """The mesh of the model's sharded parameters (one mesh for them all); None: none."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return mesh
    return None
