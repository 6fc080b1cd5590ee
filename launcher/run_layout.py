"""The run folder: every path inside it, and which folder and checkpoint a launch uses.

This module is the one owner of the layout; no other module joins run-folder path parts.

    RUN_DIR/
      spec.yaml                  the resolved spec the run started with (spec.resume-N.yaml after)
      worker-plan.json           what the launcher hands its workers (nodes/NAME/ with several)
      stop-request               the launcher asks every rank to finish its step, save and exit
      logs/rank-N.log            each rank's whole output
      telemetry/rank-N.jsonl     each rank's progress records (the live table)
      telemetry/rank-N.beat      each rank's heartbeat, rewritten in place (the hang watchdog)
      telemetry/rank-N.failed    when and where a rank failed (the root cause)
      metrics.jsonl              rank 0's metrics, averaged over every rank
      summary.json               rank 0's timings at the end
      checkpoints/step-NNNNNNNN/ published checkpoints; .step-N.partial while one is written
      nodes/NAME/                a node's (or TPU host's) own files when several share RUN_DIR
      xla_cache/                 XLA's persistent compile cache (TPU)
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import UsageError

_STEP = re.compile(r"^step-(\d{8,})$")


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
    def doomed(self) -> Path:
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
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def stop_request(self) -> Path:
        return self.root / "stop-request"

    @property
    def xla_cache(self) -> Path:
        return self.root / "xla_cache"

    @property
    def spec(self) -> Path:
        return self.root / "spec.yaml"

    def next_resumed_spec(self) -> Path:
        """Where a resumed attempt keeps its spec, beside the one the run started with."""
        return self.root / f"spec.resume-{len(list(self.root.glob('spec.resume-*.yaml'))) + 1}.yaml"

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
        return sorted(found, key=lambda p: int(_STEP.match(p.name)[1]))  # type: ignore[index]

    def latest_complete(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def holds_a_run(self) -> bool:
        return self.root.is_dir() and any(self.root.iterdir())


def latest_complete(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder."""
    return RunLayout(run_dir).latest_complete()


def run_of(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint folder belongs to, if it is inside one."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def new_run_dir(output_dir: Path, name: str) -> Path:
    """`<output_dir>/<name>/<YYYYmmdd-HHMMSS>`, never one that exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = output_dir / name / stamp
    n = 1
    while candidate.exists():
        n += 1
        candidate = output_dir / name / f"{stamp}-{n}"
    return candidate


def job_run_dir(output_dir: Path, name: str, job_id: str) -> Path:
    """The folder every node of a job (and a requeued job) shares."""
    return output_dir / name / job_id


def resolve_resume(arg: str, output_dir: Path, name: str) -> Path:
    """`--resume` accepts a checkpoint folder, a run folder, or `latest` (newest run of `name`)."""
    if arg == "latest":
        runs = sorted((output_dir / name).glob("*/"), key=lambda p: p.stat().st_mtime)
        found = [c for c in map(latest_complete, runs) if c is not None]
        if not found:
            raise UsageError(
                f"--resume latest: no run named {name!r} under {output_dir} has a complete "
                "checkpoint",
                hint="Pass a run or checkpoint folder to --resume, or start without it.",
            )
        return found[-1]
    path = Path(arg)
    if not path.exists():
        raise UsageError(f"--resume {arg}: no such folder")
    files = CheckpointFiles(path)
    if files.is_complete:
        return path
    if files.looks_interrupted:
        raise UsageError(
            f"--resume {arg}: this checkpoint is incomplete (its save was interrupted)"
        )
    latest = latest_complete(path)
    if latest is None:
        raise UsageError(
            f"--resume {arg}: neither a checkpoint nor a run folder with a complete checkpoint",
            hint="A checkpoint folder holds a COMPLETE file; a run folder holds checkpoints/.",
        )
    return latest


def own_run(output_dir: Path, name: str, run_dir: Path | None, resume_from: Path | None) -> Path:
    """The folder of a run of one launcher: a new one, or that of the run it resumes."""
    explicit = run_dir is not None
    if run_dir is None:
        # A resumed run continues in its own folder; a new run, or one resumed from a
        # checkpoint that is not inside a run folder, gets a new one.
        run_dir = (resume_from and run_of(resume_from)) or new_run_dir(output_dir, name)
    layout = RunLayout(run_dir)
    newest = layout.latest_complete()
    # Writing into a folder that holds a run is safe only when this run continues exactly
    # where that folder's newest checkpoint left off; anything else would mix two runs and
    # overwrite or prune the other run's checkpoints.
    if layout.holds_a_run() and (resume_from is None or newest != resume_from):
        if not explicit:
            raise UsageError(
                f"--resume {resume_from}: its run already has a newer checkpoint "
                f"({newest}); continuing in place would overwrite it",
                hint="Branch off with --run-dir NEW_FOLDER, or resume the newest checkpoint.",
            )
        raise UsageError(
            f"--run-dir {run_dir}: already holds a run; it is never overwritten",
            hint=f"Continue it with --resume {newest or run_dir}, or choose a new --run-dir.",
        )
    return run_dir


def refuse_finished_job(run_dir: Path, job_id: str) -> None:
    """A job's folder that holds a finished run without checkpoints is never started over:
    there is nothing to continue, and starting again would replace its metrics."""
    layout = RunLayout(run_dir)
    if layout.latest_complete() is None and layout.summary.exists():
        raise UsageError(
            f"run folder {run_dir} (job {job_id}) holds a finished run; it is never overwritten",
            hint="Use another --rdzv-id.",
        )


def check_job_resume(run_dir: Path, job_id: str, resume_from: Path | None) -> None:
    """A job's folder (every node's, a requeued node's) is joined while it has no checkpoint;
    once it has one, every node must continue from the newest."""
    newest = latest_complete(run_dir)
    if newest is not None and newest != resume_from:
        raise UsageError(
            f"run folder {run_dir} (job {job_id}) already has checkpoints; it is never overwritten",
            hint="Continue it with --resume latest on every node, or use another --rdzv-id.",
        )
