"""The one resume rule: which checkpoint an attempt of a run starts from.

The launcher asks it once, for the first attempt (`launcher.launch.resume_decision`), and
hands the answer to the workers in their plan; a worker asks it again only when its attempt
restarts (`attempt_start`; rank 0's answer wins). It reads only the run folders, so it is
torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.checkpoint.catalog import catalog_of, checkpoint_in, latest_complete, run_of
from launcher.checkpoint.damage import refuse_damaged
from launcher.checkpoint.format import meta_damage
from launcher.checkpoint.store_check import readable
from launcher.errors import UsageError
from launcher.storage_url import location


@dataclass(frozen=True)
class ResumeRequest:
    """What `--resume` asked for, before it names a checkpoint."""

    arg: str  # `latest`, `best`, or a checkpoint or run folder
    output_dir: Path  # where the runs of `name` live (run.output_dir)
    name: str  # run.name
    job: bool = False  # a job's shared folder (--rdzv-id, SLURM): `latest` means its own


def resume_point(asked: ResumeRequest | Path | None, run_dir: Path | None = None) -> Path | None:
    """The checkpoint to start from, or None to start anew.

    1. A run folder that holds a complete checkpoint continues from its newest: a restarted
       attempt, a requeued job, nodes that join later. The plan sees to it that a first
       attempt writes into such a folder only to continue from that newest checkpoint.
    2. Else what was asked: a checkpoint already chosen (the plan's, handed to the workers),
       or `--resume`'s `latest` (the newest complete checkpoint among the runs of run.name;
       for a job, only its own folder, which rule 1 covers), `best` (the best checkpoint of
       that newest run, by checkpoint.monitor), or a folder (a checkpoint, or a run folder's
       newest).
    """
    if run_dir is not None:
        newest = latest_complete(run_dir)
        if newest is not None:
            return newest
    if not isinstance(asked, ResumeRequest):
        return asked
    if asked.arg == "latest":
        return None if asked.job else _newest_of(asked.output_dir, asked.name)
    if asked.arg == "best":
        return _best_of(_newest_of(asked.output_dir, asked.name), asked.name)
    path = location(asked.arg, what="--resume")
    if not readable(path, "--resume").exists():
        raise UsageError(f"--resume {asked.arg}: no such folder")
    return checkpoint_in(path, "--resume")


def attempt_start(decided: Path | None, run_dir: Path, attempt: int) -> Path | None:
    """The checkpoint a worker's attempt starts from. The first starts from the launcher's
    decision (the worker plan's `resume_from`) as it is. A restarted attempt asks the rule
    again: the attempt that failed may have saved a newer checkpoint in the run folder. So does
    a first attempt whose run folder has moved past that decision: torch's elastic agent
    restarts a healthy group to take in a joining node without counting an attempt."""
    if attempt == 0 and latest_complete(run_dir) in (None, decided):
        return decided
    return resume_point(decided, run_dir)


def _newest_of(output_dir: Path, name: str) -> Path:
    """The newest complete checkpoint of the runs of `name`, the newest run first."""
    # A link is not a run of this name: it may lead anywhere, and a resume would write there.
    folders = [p for p in (output_dir / name).glob("*/") if not p.is_symlink()]
    runs = sorted(folders, key=lambda p: p.stat().st_mtime)
    found = [c for c in map(latest_complete, runs) if c is not None]
    if not found:
        raise UsageError(
            f"--resume latest: no run named {name!r} under {output_dir} has a complete checkpoint",
            hint="Pass a run or checkpoint folder to --resume, or start without it.",
        )
    return found[-1]


def _best_of(newest: Path, name: str) -> Path:
    # Its meta.json holds the record of the best checkpoints (the best one itself is checked
    # whole when the run starts from it).
    refuse_damaged(newest, f"--resume best: the newest checkpoint, {newest},", check=meta_damage)
    run = run_of(newest)
    best = catalog_of(run).best() if run else None
    if best is None:
        raise UsageError(
            f"--resume best: the newest run of {name!r} ({run}) has no best checkpoint",
            hint="Best checkpoints are kept with checkpoint.monitor; use --resume latest.",
        )
    return best.path
