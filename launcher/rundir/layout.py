"""The run folder: every path inside it (which of its checkpoints are which:
`launcher.checkpoint.store`).

This module is the one owner of the layout; no other module joins run-folder path parts.

    RUN_DIR/
      launcher.lock              locked by the one launcher that writes the run: its host, pid
      spec.yaml                  the resolved spec the run started with (spec.resume-N.yaml after)
      worker-plan.json           what the launcher hands its workers (nodes/NAME/ with several)
      stop-request               the launcher asks every rank to finish its step, save and exit
      logs/rank-N.log            each rank's whole output
      telemetry/rank-N.jsonl     each rank's progress records (the live table)
      telemetry/rank-N.beat      each rank's heartbeat, rewritten in place (the hang watchdog)
      telemetry/rank-N.failed    when and where a rank failed (the root cause)
      telemetry/step-times.json  a fixed-size sample of rank 0's step times (the benchmarks)
      metrics.jsonl              rank 0's metrics, averaged over every rank
      progress.json              rank 0's newest step and last and best values, kept current
      summary.json               rank 0's timings at the end
      trackers.json              each experiment tracker's run id and last step sent (a
                                 resume continues the same tracker run)
      metrics.csv                rank 0's metrics, a column each (log.trackers: csv)
      wandb/                     W&B's own files (log.trackers: wandb): offline runs to sync
      outcome.json               how the run ended: status, exit code, when (the launcher)
      fault-tolerance/           the replica groups' losses and heals (fault_tolerance): each
                                 launcher's launcher-N.jsonl, each process's rank-N.jsonl
      stragglers.jsonl           rank 0's record of the slow ranks it named, and their recoveries
      .outcome.reserve           room for outcome.json, held while the run runs
      checkpoints/step-NNNNNNNN/ published checkpoints; .step-N.partial while one is written
      checkpoint-store.json      where checkpoints go instead when checkpoint.dir names a store
                                 (launcher.checkpoint.store reads both)
      nodes/NAME/                a node's (or TPU host's) own files when several share RUN_DIR
      xla_cache/                 XLA's persistent compile cache (TPU)
      compile_cache/             torch.compile's (inductor's) cache (train.compile)
      profile/                   torch.profiler traces (train.profile): rank-N.pt.trace.json,
                                 rank-N.memory.pickle (CUDA memory snapshots)
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint folder, besides DCP's own."""

    path: Path

    @property
    def marker(self) -> Path:
        """Written last: a folder without it is not a checkpoint."""
        return self.path / "COMPLETE"

    @property
    def meta(self) -> Path:
        """The state every rank shares (progress, scheduler, spec), as JSON."""
        return self.path / "meta.json"

    @property
    def dcp_metadata(self) -> Path:
        return self.path / ".metadata"

    def rank_state(self, rank: int) -> Path:
        """One rank's own state (RNG streams, metrics window, recipe state)."""
        return self.path / f"rank-{rank}.pt"

    @property
    def is_complete(self) -> bool:
        return self.marker.is_file()

    @property
    def looks_interrupted(self) -> bool:
        return self.path.name.endswith(".partial") or self.dcp_metadata.is_file()

    @property
    def unpublished(self) -> Path:
        """Where a pruned checkpoint is moved first (atomically) before it is deleted."""
        return self.path.with_name(f".{self.path.name}.deleting")


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    @property
    def telemetry_dir(self) -> Path:
        return self.root / "telemetry"

    def telemetry(self, rank: int) -> Path:
        return self.telemetry_dir / f"rank-{rank}.jsonl"

    def beat(self, rank: int) -> Path:
        return self.telemetry_dir / f"rank-{rank}.beat"

    def failure(self, rank: int) -> Path:
        return self.telemetry_dir / f"rank-{rank}.failed"

    def failures(self) -> list[Path]:
        return sorted(self.telemetry_dir.glob("rank-*.failed"))

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def progress(self) -> Path:
        """What `train runs` shows of the run, rewritten whole at each log line."""
        return self.root / "progress.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def step_times(self) -> Path:
        return self.telemetry_dir / "step-times.json"

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tb"

    @property
    def trackers(self) -> Path:
        return self.root / "trackers.json"

    @property
    def metrics_csv(self) -> Path:
        return self.root / "metrics.csv"

    @property
    def wandb_parent(self) -> Path:
        """Where W&B makes its `wandb/` folder (wandb.init's `dir`)."""
        return self.root

    @property
    def outcome(self) -> Path:
        return self.root / "outcome.json"

    @property
    def outcome_reserve(self) -> Path:
        """Disk space held while the run runs, for outcome.json on a disk that filled up."""
        return self.root / ".outcome.reserve"

    @property
    def lock(self) -> Path:
        """Locked (flock) by the launcher that writes the run; it records its host and pid."""
        return self.root / "launcher.lock"

    def shared_probe(self, token: str) -> Path:
        """Rank 0's token, read back by every rank at start (the run folder is shared). Named
        after the token: no node can have cached an earlier answer for this name."""
        return self.root / f".shared-check-{token}"

    @property
    def fault_events(self) -> Path:
        """The replica groups' losses and heals (`launcher.rundir.fault_events`): a folder of
        files, each written by one process (`launcher_events`, `rank_events`)."""
        return self.root / "fault-tolerance"

    @property
    def stragglers(self) -> Path:
        """The ranks named slow, and their recoveries (`launcher.worker.stragglers`)."""
        return self.root / "stragglers.jsonl"

    @staticmethod
    def launcher_events(events: Path, node: int) -> Path:
        """The events node `node`'s launcher records in the folder `events` (`lost`, ...)."""
        return events / f"launcher-{node}.jsonl"

    @staticmethod
    def rank_events(events: Path, rank: int) -> Path:
        """The events the process of rank `rank` (the run's rank, as in its log's name)
        records in the folder `events` (`quorum`, `healed`, ...)."""
        return events / f"rank-{rank}.jsonl"

    @staticmethod
    def event_files(events: Path) -> list[Path]:
        """Every file of the folder `events`; for a run of an earlier version, its one file
        beside where the folder would be (`fault-tolerance.jsonl`)."""
        earlier = _earlier_fault_events(events)
        found = sorted(events.glob("*.jsonl")) if events.is_dir() else []
        return found + ([earlier] if earlier.is_file() else [])

    @staticmethod
    def replica_group(node_dir: Path, group: int) -> Path:
        """A replica group's own files (worker plan, agent logs) under `fault_tolerance`."""
        return node_dir / "groups" / f"group-{group}"

    @property
    def stop_request(self) -> Path:
        return self.root / "stop-request"

    @property
    def xla_cache(self) -> Path:
        return self.root / "xla_cache"

    @property
    def compile_cache(self) -> Path:
        return self.root / "compile_cache"

    @property
    def profile_dir(self) -> Path:
        return self.root / "profile"

    def profile_trace(self, rank: int) -> Path:
        # TensorBoard's profiler plugin (torch-tb-profiler) reads `*.pt.trace.json`.
        return self.profile_dir / f"rank-{rank}.pt.trace.json"

    def memory_snapshot(self, rank: int) -> Path:
        return self.profile_dir / f"rank-{rank}.memory.pickle"

    @property
    def spec(self) -> Path:
        return self.root / "spec.yaml"

    def next_resumed_spec(self) -> Path:
        """Where a resumed attempt keeps its spec, beside the one the run started with."""
        return self.root / f"spec.resume-{len(self.resumed_specs()) + 1}.yaml"

    def resumed_specs(self) -> list[Path]:
        return list(self.root.glob("spec.resume-*.yaml"))

    def node(self, rank: int | None = None, *, tpu_host: int = 0, elastic: bool = False) -> Path:
        """A node's own folder (spec copy, worker plan, agent logs) in a run folder that
        several nodes or TPU hosts share: by node rank, by TPU host index, or, for an elastic
        node without a rank, by host name and pid. The run folder itself for one machine."""
        if rank is not None:
            return self.root / "nodes" / f"node-{rank}"
        if elastic:
            return self.root / "nodes" / f"{socket.gethostname()}-{os.getpid()}"
        return self.root / "nodes" / f"host-{tpu_host}" if tpu_host else self.root

    @staticmethod
    def node_spec(node_dir: Path) -> Path:
        return node_dir / "spec.yaml"

    @staticmethod
    def worker_plan(node_dir: Path) -> Path:
        return node_dir / "worker-plan.json"

    @staticmethod
    def agent_logs(node_dir: Path) -> Path:
        return node_dir / ".elastic"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return checkpoint_folder(self.checkpoints, step)

    @property
    def checkpoint_store(self) -> Path:
        """The store (`checkpoint.dir`) that holds the run's checkpoints, when not `checkpoints`."""
        return self.root / "checkpoint-store.json"

    def staging(self, step: int) -> Path:
        """Where a checkpoint is written until every rank is done: hidden, never complete."""
        return staging_folder(self.checkpoints, step)

    def holds_a_run(self) -> bool:
        """Whether the folder holds more than what a launcher writes before the first step. A
        folder that holds only that, lock file included (a launcher wrote it, not a user), was
        left by an attempt that never trained (it failed to load its checkpoint, say): a retry
        may take it over."""
        if not self.root.is_dir() or not any(self.root.iterdir()):
            return False
        if not self.lock.is_file() or (self.metrics.is_file() and self.metrics.stat().st_size):
            return True
        startup = [self.lock, self.spec, self.stop_request, self.logs, self.telemetry_dir]
        startup += [self.metrics, self.xla_cache, self.compile_cache, self.node(0).parent]
        startup += [self.worker_plan(self.root), self.agent_logs(self.root), *self.resumed_specs()]
        startup += [
            self.root / "groups",
            self.fault_events,
            _earlier_fault_events(self.fault_events),
        ]
        startup += [
            self.outcome,
            self.outcome_reserve,
            self.checkpoint_store,
        ]  # an attempt that never trained ends
        if self.checkpoints.is_dir() and not any(self.checkpoints.iterdir()):
            startup.append(self.checkpoints)  # made, and found writable, at the start
        return any(p not in startup for p in self.root.iterdir())


# The names inside a folder of checkpoints (the run folder's `checkpoints/`, or a store's
# prefix: `launcher.checkpoint.store`).
_STEP = re.compile(r"^step-(\d{8,})$")
_DELETING = re.compile(r"^\.step-\d{8,}\.deleting$")  # CheckpointFiles.unpublished


def _earlier_fault_events(events: Path) -> Path:
    """Where a run of an earlier version kept its fault-tolerance events: one file, appended
    by every process, beside the folder that holds them now."""
    return events.with_name("fault-tolerance.jsonl")


def checkpoint_folder(root: Any, step: int) -> Any:
    """The checkpoint of `step` in the folder (or store prefix) `root`."""
    return root / f"step-{step:08d}"


def staging_folder(root: Any, step: int) -> Any:
    """Where a checkpoint is written until every rank is done: hidden, never complete."""
    return root / f".step-{step:08d}.partial"


def checkpoint_step(name: str) -> int | None:
    """The step of a published checkpoint's folder name; None for any other name."""
    found = _STEP.match(name)
    return int(found[1]) if found else None


def is_cut_short(name: str) -> bool:
    """Whether a name is that of a pruned checkpoint left unpublished (`.step-N.deleting`)."""
    return bool(_DELETING.match(name))


def run_holding(checkpoint: Path) -> Path | None:
    """The run folder whose `checkpoints/` holds a local checkpoint folder, if one does."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
