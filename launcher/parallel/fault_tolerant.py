"""Per-step fault tolerance on torchft (`fault_tolerance`): a ddp or fsdp strategy whose
processes form one replica group of several, which average their gradients every step
through torchft's Manager, and heal a restarted group from a live one's memory.

Each group is an ordinary run of the wrapped strategy (its own process group, ranks from 0,
its own DDP or FSDP); torchft adds, for each process, a process group with the processes of
the same rank in the other groups, rebuilt at every change of the quorum. A step:

1. `begin_step`: the quorum (which groups train this step), synchronously. A group behind
   the others (restarted) receives a live group's state here, over HTTP, and the loop takes
   its data from the new position. Random streams are reseeded from (seed, data-parallel
   rank, step), so a healed group draws its own numbers, as it would have.
2. `finish_gradients`: the group's gradients (each process's shard, under fsdp) averaged
   with the other groups' in one flat buffer per dtype, then clipped: the global norm.
3. `commit_step`: torchft's vote. A collective that failed (a group died inside it) makes
   the step void on every group that saw it: the loop drops it and takes it again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launcher.config.fault_tolerance import FaultToleranceSection
from launcher.errors import RunError
from launcher.parallel.base import Strategy, local_shard
from launcher.parallel.peer_state import PeerStateServer, packed, unpacked
from launcher.parallel.rng import rank_seed
from launcher.rundir import fault_events
from launcher.rundir.worker_plan import ReplicaGroup

STATE_KEY = "launcher"  # the Manager's name for what a healing group receives


def fault_tolerant(strategy_cls: type[Strategy]) -> type[Strategy]:
    """`strategy_cls`, as one replica group of a fault-tolerant run."""
    return type(f"FaultTolerant{strategy_cls.__name__}", (FaultTolerantMixin, strategy_cls), {})


class FaultTolerantMixin:
    """Goes before a `TorchDistributedStrategy` subclass in the bases (`fault_tolerant`)."""

    group: ReplicaGroup
    ft: FaultToleranceSection
    seed_base: int

    def configure_replicas(
        self, group: ReplicaGroup, options: FaultToleranceSection, seed: int, attempt: int
    ) -> None:
        self.group, self.ft, self.seed_base = group, options, seed
        self.restarted = attempt > 0
        self.manager: Any = None
        self._healed = False
        self._joined = False
        self._in_quorum = False  # a quorum taken for the step under way: never twice
        self._groups = group.count  # in the last quorum
        self._quorum: object = None  # the last quorum's id
        self._shared: tuple[Any, Any, Any] | None = None

    def setup(self) -> None:
        super().setup()  # type: ignore[misc]
        _quiet_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=self.ft.timeout_s)
        on_gpu = self.device.type == "cuda"  # type: ignore[attr-defined]
        pg = ProcessGroupNCCL(timeout=timeout) if on_gpu else ProcessGroupGloo(timeout=timeout)
        group = self.group
        state_server = PeerStateServer(group.listen, group.host, group.token, timeout)
        with _manager_server_on(group.listen):
            self.manager = Manager(
                pg=pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=self.ft.min_replicas,
                # The quorum before the step's forward: a healing group starts the step
                # healed, on the data of that step, and trains in it.
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                rank=self.rank,  # type: ignore[attr-defined]
                world_size=self.world_size,  # type: ignore[attr-defined]
                lighthouse_addr=group.lighthouse,
                replica_id=group.member_name(group.index),
                hostname=group.host,
                checkpoint_transport=state_server,
                # The groups build their weights alike from the run's seed: nothing to copy
                # at step 0.
                init_sync=False,
            )
        # Every quorum is checked before torchft acts on it (reconfigures its collectives
        # or heals from a member): a stranger in it stops the run instead.
        self.manager._client = _QuorumCheck(self.manager._client, group)

    # -- which process does what ----------------------------------------------------------

    @property
    def log_rank(self) -> int:
        return self.group.index * self.world_size + self.rank  # type: ignore[attr-defined]

    @property
    def writes_records(self) -> bool:
        return self.group.index == 0 and self.is_main  # type: ignore[attr-defined]

    @property
    def heals_from_peers(self) -> bool:
        return True

    @property
    def saves_checkpoints(self) -> bool:
        # The first group of the step's quorum: group 0 while it is there, another while it heals.
        return self.manager is None or self.manager.participating_rank() == 0

    @property
    def dp_rank(self) -> int:
        inner = self.layout.dp_rank(self.rank)  # type: ignore[attr-defined]
        return self.group.index * self.layout.dp_size + inner  # type: ignore[attr-defined]

    @property
    def dp_size(self) -> int:
        return self.group.count * self.layout.dp_size  # type: ignore[attr-defined]

    # -- the step --------------------------------------------------------------------------

    def share_state(self, model: Any, loop: Any, reload: Any) -> None:
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
        self.seed(rank_seed(self.seed_base, self.dp_rank, manager.current_step() + 1))  # type: ignore[attr-defined]
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
        deadline = time.monotonic() + self.ft.timeout_s
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
            self.say(f"step {step + 1}: {groups} of {count} replica groups train")  # type: ignore[attr-defined]

    def _record(self, event: str, **fields: Any) -> None:
        """One event of this group (`launcher.rundir.fault_events`), by its rank 0."""
        if self.is_main and self.group.events:  # type: ignore[attr-defined]
            fault_events.record(Path(self.group.events), event, group=self.group.index, **fields)

    def _reload_without_peers(self) -> bool:
        """A restarted group that found no group ahead of it (every group was lost at once,
        or none has stepped yet) goes on from the newest checkpoint, as a restarted job does."""
        assert self._shared is not None
        _, loop, reload = self._shared
        if not reload():
            return False
        self.manager.load_state_dict({"step": loop.progress.step, "batches_committed": 0})
        return True

    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor | None:
        self._average_across_groups(model)
        return super().finish_gradients(model, optimizer, max_norm)  # type: ignore[misc]

    def _average_across_groups(self, model: nn.Module) -> None:
        """Each process's gradients (its shards) averaged with the same rank's in the other
        groups: one all-reduce per dtype. A failed one leaves the step to `commit_step`."""
        grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()
            offset = 0
            for grad in same:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        # The group's mean, then the groups': metrics and evaluations are the run's, not a
        # group's share. A group lost meanwhile leaves the groups' own (the step then is void).
        mean = super().reduce_mean(values)  # type: ignore[misc]
        self.manager.allreduce(mean).wait()
        return mean

    def commit_step(self) -> bool:
        self._in_quorum = False
        error = self.manager.errored()
        committed = bool(self.manager.should_commit())
        if not committed:
            why = _first_words(str(error.original_exception)) if error else "a peer's vote"
            self.say(f"step {self.manager.current_step() + 1} is void ({why}); taking it again")  # type: ignore[attr-defined]
        return committed

    def teardown(self) -> None:
        if self._shared is not None and self.group.events:  # what the groups should agree on
            step = self._shared[1].progress.step
            digest = _digest(self._shared[0].model)
            fault_events.record(
                Path(self.group.events), "finished", group=self.group.index,
                rank=self.rank, step=step, digest=digest,  # type: ignore[attr-defined]
            )  # fmt: skip
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        super().teardown()  # type: ignore[misc]

    def summary(self) -> dict[str, Any]:
        events = fault_events.read(Path(self.group.events))
        record = {"replica_group": self.group.index, **fault_events.summary(events)}
        return {**super().summary(), "fault_tolerance": record}  # type: ignore[misc]

    # -- what a healing group receives -----------------------------------------------------

    def _peer_state(self) -> dict[str, Any]:
        assert self._shared is not None
        model, loop, _ = self._shared
        return {"model": packed(model.state_dict()), "loop": loop.state_dict()}

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        assert self._shared is not None
        model, loop, _ = self._shared
        mesh = _mesh_of(model.model)
        model.load_state_dict(unpacked(state["model"], mesh))
        loop.load_state_dict(state["loop"], None)
        self._healed = True


def _first_words(message: str, limit: int = 160) -> str:
    """A collective's error in one line that reads: its first line, cut at a word."""
    line = (message.strip().splitlines() or ["no message"])[0]
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def _digest(model: nn.Module) -> str:
    """A hash of this process's parameters (its shards): alike in every group, rank by rank."""
    import hashlib

    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(local_shard(param.detach()).cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def _quiet_torchft() -> None:
    """torchft's own lines (a traceback per failed collective, a warning per quorum on CPU)
    repeat what the launcher says in one line."""
    import logging
    import warnings

    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # Received state is read from a bytes buffer: torch warns it is not writable; it is copied.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _mesh_of(model: nn.Module) -> Any:
    """The mesh of the model's sharded parameters (one mesh for them all); None: none."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return mesh
    return None


class StrangerInQuorum(Exception):
    def __init__(self, replica_id: str) -> None:
        super().__init__(replica_id)
        self.replica_id = replica_id


class _QuorumCheck:
    """torchft's client of the group's Manager, whose quorums are checked as they come: the
    Lighthouse takes any member that asks (it has no authentication), and torchft would
    reach a stranger's store and copy a stranger's state."""

    def __init__(self, client: Any, group: ReplicaGroup) -> None:
        self._client, self._group = client, group

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        stranger = self._group.stranger(list(quorum.replica_ids))
        if stranger is not None:
            raise StrangerInQuorum(stranger)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@contextlib.contextmanager
def _manager_server_on(listen: str) -> Iterator[None]:
    """torchft's Manager, made meanwhile, serves on `listen` alone: torchft 0.2 binds its
    server to every interface (`[::]`) and has no setting for it."""
    import torchft.manager as torchft_manager

    original = torchft_manager.ManagerServer

    def bound(**options: Any) -> Any:
        port = str(options["bind"]).rsplit(":", 1)[1]
        host = f"[{listen}]" if ":" in listen else listen
        return original(**{**options, "bind": f"{host}:{port}"})

    torchft_manager.ManagerServer = bound  # type: ignore[misc]
    try:
        yield
    finally:
        torchft_manager.ManagerServer = original  # type: ignore[misc]
