"""Semi-synchronous replica groups on torchft (`fault_tolerance.sync.method: local_sgd` or
`diloco`): each group trains `every` steps on its own, as a run of its strategy (ddp, or fsdp
sharded inside the group), then the groups sync, through the same Manager, Lighthouse and
state server as per-step fault tolerance (`launcher.replicas.torchft_engine`):

- `local_sgd` averages the groups' weights;
- `diloco` averages what each group's weights moved since the last sync (DiLoCo's pseudo-
  gradient) and applies it to the weights of the last sync with the outer optimizer
  (`launcher.replicas.outer_state`).

Each process exchanges only its own part (its shards under fsdp) with the same rank of the
other groups. Between syncs nothing crosses groups: a run's metrics are group 0's.

A sync is a torchft step: the quorum, the all-reduce, the vote. It comes after the update of
every `every`-th step and of the last one (`end_step`), before that step's checkpoint, so a
checkpoint saved at a sync holds the one model of every group. A sync that fails (a group
lost inside it) is taken again with the groups left. A restarted group joins the next sync
(`begin_step`): it copies a live group's state there (model, inner and outer optimizer,
data position), takes part in the sync with nothing of its own, and trains on from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from launcher.checkpoint.state import LoopState, ModelState
from launcher.config.spec import RunSpec
from launcher.metrics.memory import size_text
from launcher.parallel.base import Strategy, local_shard
from launcher.parallel.rng import rank_seed
from launcher.parallel.wrapper_names import named_parameters
from launcher.replicas.engine import ReplicaEngine
from launcher.replicas.fragments import fragments_of
from launcher.replicas.outer_state import OuterState
from launcher.replicas.torchft_engine import TorchftEngine, digest, first_words
from launcher.rundir.worker_plan import ReplicaGroup

# A sync that fails is taken again with the groups left, at most this many times in a row.
SYNC_ATTEMPTS = 5


class SemiSyncEngine(TorchftEngine):
    def __init__(
        self, strategy: Strategy, group: ReplicaGroup | None, spec: RunSpec, attempt: int
    ) -> None:
        super().__init__(strategy, group, spec, attempt)
        self.sync = spec.fault_tolerance.sync
        self.outer: OuterState | None = None  # diloco's, made with the model (`extra_state`)
        self.syncs = 0
        self._sync_losses: dict[str, float] = {}  # for the next metrics record
        self._spec = spec
        self._fragments: list[list[int]] | None = None  # positions in `_named()`, by fragment
        self._syncing: list[int] = []  # the fragments of the sync under way (a healer's too)

    def share_state(self, model: ModelState, loop: LoopState, reload: Callable[[], bool]) -> None:
        super().share_state(model, loop, reload)
        self._fragments_by_index()  # a count that does not divide the blocks: refused now

    def extra_state(self, model: torch.nn.Module) -> OuterState | None:
        """diloco's outer state; local_sgd has none."""
        if self.sync.method == "diloco":
            self.outer = OuterState(model, self.sync.outer_optim)
        return self.outer

    # -- the step --------------------------------------------------------------------------

    def begin_step(self, step: int) -> bool:
        if not self._joined:
            self._joined = True
            if self._join(step):
                return True  # the loop starts again at the healed position
        # Random streams from (seed, data-parallel rank, step): a healed group draws its own.
        self.strategy.rng.seed(rank_seed(self.seed_base, self.strategy.dp_rank, step + 1))
        return False

    def average_gradients(self, model: torch.nn.Module) -> None:
        pass  # the group's own gradients: the groups meet at syncs only

    def mean_across_groups(self, values: torch.Tensor) -> torch.Tensor:
        return values  # no exchange between syncs: the group's own figures

    @property
    def paces_together(self) -> bool:
        return False  # the groups meet at syncs only: a slow group waits for no other between

    def figures_across_groups(self, rows: list[list[float]]) -> dict[int, list[float]]:
        return ReplicaEngine.figures_across_groups(self, rows)  # the group's own alone

    def commit_step(self) -> bool:
        self.steps_taken += 1
        return True

    def end_step(self, step: int, last: bool) -> bool:
        due = self._due(step, last)
        return self._sync(step, due) if due else False

    def _due(self, step: int, last: bool) -> list[int]:
        """The fragments synced after step `step`: with F fragments, fragment i every
        `every` steps, (i + 1) * every / F steps into each round; all of them after the last
        step, so that the run ends with one model."""
        count = len(self._fragments_by_index())
        if last:
            return list(range(count))
        into, spacing = step % self.sync.every, self.sync.every // count
        if into % spacing:
            return []
        return [(into // spacing - 1) % count]

    # -- the sync --------------------------------------------------------------------------

    def _join(self, step: int) -> bool:
        """The first quorum of this process: with every group at a run's start (or a resume
        from disk); a restarted group's, with the others at their next sync."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        started = time.perf_counter()
        self._start_quorum()
        if not self.restarted:
            self._wait_for_every_group()
        if self._healed:  # the others are inside a sync: take part, with nothing of its own
            self._healed = False
            healed = {"step": self.manager.current_step(), "heal_s": time.perf_counter() - started}
            self._record("healed", **healed)
            if not self._exchange(self._syncing):
                self._say("the sync this group joined failed; it joins the next one")
            return True
        self._note_quorum(self.manager.num_participants())
        if self.restarted:  # no group ahead of it: every group was lost at once
            return self._reload_without_peers()
        return False

    def _sync(self, step: int, fragments: list[int]) -> bool:
        """The groups' sync of `fragments` after step `step`; True where this group's state
        was replaced by a live group's meanwhile (it was behind: it then syncs what that
        group syncs)."""
        for attempt in range(SYNC_ATTEMPTS):
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
            started, sent = time.perf_counter(), self.bytes_sent
            self._syncing = fragments
            self._start_quorum()  # a heal replaces `_syncing` with the live group's
            healed, self._healed = self._healed, False
            self._note_quorum(self.manager.num_participants())
            if self._exchange(self._syncing):
                took = time.perf_counter() - started
                self._announce(step, self.bytes_sent - sent, took, attempt)
                return healed
            why = self._void_reason()
            self._say(f"the sync after step {step} is void ({why}); taking it again")
        raise RuntimeError(
            f"fault_tolerance.sync: the sync after step {step} failed {SYNC_ATTEMPTS} times"
        )

    def _exchange(self, fragments: list[int]) -> bool:
        """The all-reduce of `fragments` and the vote; on a committed vote, the model holds
        their synced weights (a healing group's share counts as zeros: torchft counts it
        out)."""
        by_fragment = self._fragments_by_index()
        indexes = sorted(i for f in fragments for i in by_fragment[f])
        params = [self._named()[i][1] for i in indexes]
        if self.outer is None:  # local_sgd: the weights' average
            averaged = [local_shard(p).detach().clone() for p in params]
        else:
            averaged = self.outer.pseudo_gradients(indexes)
        self.average_across_groups(averaged)
        losses = self._losses_of_groups()
        if not self.manager.should_commit():
            return False
        self._sync_losses = losses
        if self.outer is None:
            with torch.no_grad():
                torch._foreach_copy_([local_shard(p) for p in params], averaged)
        else:
            self.outer.step(indexes, averaged)
        self.syncs += 1
        return True

    def _losses_of_groups(self) -> dict[str, float]:
        """Each group's mean loss over its steps since the last log line (`sync/loss/groupN`),
        and the mean of them (`sync/loss`): one small all-reduce, its slots by group. A healing
        group sends zeros, and has no slot."""
        _, loop, _ = self._state_shared()
        count, own = self.group.count, loop.recent_loss()
        slots = torch.zeros(2 * count, dtype=torch.float64, device=self.strategy.device)
        if own is not None:
            slots[self.group.index] = own.double()
            slots[count + self.group.index] = 1.0  # this group's slot is set
        self.average_across_groups([slots])  # the mean over the groups present
        slots = (slots * self.manager.num_participants()).tolist()
        losses = {f"sync/loss/group{g}": slots[g] for g in range(count) if slots[count + g] > 0.5}
        if losses:
            losses["sync/loss"] = sum(losses.values()) / len(losses)
        return losses

    def metrics(self) -> dict[str, float]:
        """The bytes per step, and the groups' losses at the sync since the last record."""
        figures = {**super().metrics(), **self._sync_losses}
        self._sync_losses = {}
        return figures

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        """The trained parameters, by name, in the model's order (`outer_state`'s too)."""
        model, _, _ = self._state_shared()
        return [(n, p) for n, p in named_parameters(model.model) if p.requires_grad]

    def _fragments_by_index(self) -> list[list[int]]:
        """Each fragment's parameters, as positions in `_named()` (one fragment: all)."""
        if self._fragments is None:
            model, _, _ = self._state_shared()
            fsdp = self._spec.fsdp.wrap
            names = fragments_of(model.model, self.sync.fragments, fsdp)
            position = {name: i for i, (name, _) in enumerate(self._named())}
            self._fragments = [[position[n] for n in fragment] for fragment in names]
        return self._fragments

    # -- what a healing group receives: the fragments of the sync under way too ---------------

    def _peer_state(self) -> dict[str, Any]:
        return {**super()._peer_state(), "syncing": list(self._syncing)}

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        super()._load_peer_state(state)
        self._syncing = list(state["syncing"])

    def _void_reason(self) -> str:
        error = self.manager.errored()
        return first_words(str(error.original_exception)) if error else "a peer's vote"

    def _announce(self, step: int, sent: int, took: float, attempt: int) -> None:
        groups = self.manager.num_participants()
        by_fragment, named = self._fragments_by_index(), self._named()
        synced = [named[i][1] for f in self._syncing for i in by_fragment[f]]
        self._record(
            "sync", every_rank=True, rank=self.strategy.rank, step=step, groups=groups,
            fragments=self._syncing, bytes=sent, sync_s=took, attempt=attempt,
            digest=digest(synced),  # of the weights the sync set: alike in every group
        )  # fmt: skip
        count = self.sync.fragments
        what = "" if count == len(self._syncing) else f" of fragment {self._syncing[0] + 1}/{count}"
        if self.saves_checkpoints:  # said once, by the group leading the quorum
            self._say(
                f"sync{what} after step {step}: {groups} of {self.group.count} replica groups, "
                f"{size_text(sent)} sent, {took:.2f} s"
            )

    def summary(self) -> dict[str, Any]:
        summary = super().summary()
        # Per-step syncing sends the gradients, as large as the weights, every step.
        weights = sum(local_shard(p).numel() * p.element_size() for _, p in self._named())
        every_step = weights * self.steps_taken
        summary["fault_tolerance"]["sync"] = {
            "method": self.sync.method,
            "every": self.sync.every,
            "fragments": self.sync.fragments,
            "syncs": self.syncs,
            "bytes_saved": round(1 - self.bytes_sent / every_step, 4) if every_step else None,
        }
        return summary
