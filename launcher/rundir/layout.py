"""The run folder: every path inside it, and which of its checkpoints are which.

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
      .outcome.reserve           room for outcome.json, held while the run runs
      checkpoints/step-NNNNNNNN/ published checkpoints; .step-N.partial while one is written
      nodes/NAME/                a node's (or TPU host's) own files when several share RUN_DIR
      xla_cache/                 XLA's persistent compile cache (TPU)
      compile_cache/             torch.compile's (inductor's) cache (train.compile)
      profile/                   torch.profiler traces (train.profile): rank-N.pt.trace.json,
                                 rank-N.memory.pickle (CUDA memory snapshots)
"""

from __future__ import annotations

import math
import os
import re
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.errors import UsageError
from launcher.rundir.reading import UnreadableJson, read_json

_STEP = re.compile(r"^step-(\d{8,})$")
_DELETING = re.compile(r"^\.step-\d{8,}\.deleting$")  # CheckpointFiles.unpublished
# How often `best` looks for the newest checkpoint again when a live run prunes the one it
# found before its record is read: each look finds a newer one, so a few are plenty.
_LOOKS = 5


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
        return self.checkpoints / f"step-{step:08d}"

    def staging(self, step: int) -> Path:
        """Where a checkpoint is written until every rank is done: hidden, never complete."""
        return self.checkpoints / f".step-{step:08d}.partial"

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [
            p
            for p in self.checkpoints.iterdir()
            if _STEP.match(p.name) and CheckpointFiles(p).is_complete
        ]
        return sorted(found, key=lambda p: step_of(p) or 0)

    def complete_steps(self) -> set[int]:
        return {step_of(p) or 0 for p in self.complete_checkpoints()}

    def latest_complete(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def cut_short_deletions(self) -> list[Path]:
        """The pruned checkpoints that their launcher, stopped mid-delete, left unpublished
        (`CheckpointFiles.unpublished`): folders, never a link."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(
            p for p in self.checkpoints.iterdir() if _DELETING.match(p.name) and _is_folder(p)
        )

    def prunable(self, keep_last: int | None, protected: Iterable[int] = ()) -> list[Path]:
        """The pruning rule: complete checkpoints other than the newest `keep_last` and the
        `protected` steps (the best ones). None: keep everything."""
        if not keep_last:
            return []
        keep = set(protected)
        return [p for p in self.complete_checkpoints()[:-keep_last] if step_of(p) not in keep]

    def best(self) -> Best | None:
        """The best complete checkpoint by `checkpoint.monitor`, as the newest checkpoint's
        record of scores says (the record survives resumes; pruned ones are passed over).
        UnreadableJson where the newest one's meta.json is missing or malformed."""
        newest = self._newest_meta()
        if newest is None:
            return None
        meta, record = newest
        monitor, kept = _best_record(record, meta)
        for step, score in kept:
            path = self.checkpoint(step)
            if CheckpointFiles(path).is_complete:
                return Best(path, step, score, monitor)
        return None

    def _newest_meta(self) -> tuple[Path, Any] | None:
        """The newest complete checkpoint's meta.json and what it holds; None without one."""
        for look in range(1, _LOOKS + 1):
            newest = self.latest_complete()
            if newest is None:
                return None
            meta = CheckpointFiles(newest).meta
            try:
                return meta, read_json(meta, "checkpoint meta")
            except FileNotFoundError:
                # A live run that keeps few checkpoints prunes its newest one once a newer
                # one is published, maybe while this reads it: the newer one's is read then.
                # One still published without its meta.json is damaged.
                if look == _LOOKS or CheckpointFiles(newest).is_complete:
                    raise UnreadableJson(meta, "missing") from None
        raise AssertionError("unreachable: the last look returns or raises")

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
        startup += [self.outcome, self.outcome_reserve]  # an attempt that never trained ends
        if self.checkpoints.is_dir() and not any(self.checkpoints.iterdir()):
            startup.append(self.checkpoints)  # made, and found writable, at the start
        return any(p not in startup for p in self.root.iterdir())


@dataclass(frozen=True)
class Best:
    path: Path
    step: int
    score: float
    monitor: str

    def describe(self) -> str:
        return f"{self.path} ({self.monitor} {self.score:.6g} at step {self.step})"


def _best_record(meta: Any, where: Path) -> tuple[str, list[tuple[int, float]]]:
    """The monitor and the (step, score) pairs, best first, of a checkpoint's meta.json (its
    `best` entry, which `launcher.worker.monitors` writes); UnreadableJson where malformed."""
    record = meta.get("best") if isinstance(meta, dict) else None
    if not record:
        return "", []
    try:
        monitor, pairs = record["monitor"], [(step, score) for step, score in record["kept"]]
    except (TypeError, KeyError, ValueError):  # not a mapping, not a list of pairs
        monitor, pairs = None, []
    if not isinstance(monitor, str) or not all(map(_is_step_and_score, pairs)):
        raise UnreadableJson(where, "its record of the best checkpoints is malformed")
    return monitor, pairs


def _is_step_and_score(pair: tuple[Any, Any]) -> bool:
    step, score = pair
    numbers = all(isinstance(n, int | float) and not isinstance(n, bool) for n in pair)
    # A step of 400 digits would make a file name too long to look up.
    return numbers and isinstance(step, int) and 0 <= step < 10**15 and not math.isnan(score)


def _is_folder(path: Path) -> bool:
    """A folder itself, not a link to one."""
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def step_of(checkpoint: Path) -> int | None:
    """The step a published checkpoint folder holds."""
    found = _STEP.match(checkpoint.name)
    return int(found[1]) if found else None


def latest_complete(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder."""
    return RunLayout(run_dir).latest_complete()


def checkpoint_in(path: Path, what: str) -> Path:
    """The checkpoint a folder names: itself (a complete checkpoint folder), or a run
    folder's newest complete one. `what` names the flag or command, for the errors."""
    files = CheckpointFiles(path)
    if files.is_complete:
        return path
    if files.looks_interrupted:
        raise UsageError(f"{what} {path}: this checkpoint is incomplete (its save was interrupted)")
    newest = latest_complete(path)
    if newest is None:
        raise UsageError(
            f"{what} {path}: neither a checkpoint nor a run folder with a complete checkpoint",
            hint="A checkpoint folder holds a COMPLETE file; a run folder holds checkpoints/.",
        )
    return newest


def run_of(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint folder belongs to, if it is inside one."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
