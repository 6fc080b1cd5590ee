"""The one resume rule: which checkpoint an attempt of a run starts from.

The launcher asks it once, for the first attempt (`launcher.checkpoint.resume_decision`), and
hands the answer to the workers in their plan; a worker asks it again only when its attempt
restarts (`attempt_start`; rank 0's answer wins). It reads only the run folders and their
stores, so it is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.checkpoint.catalog import Listings, checkpoint_in, run_of
from launcher.checkpoint.damage import refuse_damaged
from launcher.checkpoint.format import meta_damage
from launcher.checkpoint.store import Store, kind_for, store_of_run
from launcher.errors import UsageError
from launcher.storage_url import location


@dataclass(frozen=True)
class ResumeRequest:
    """What `--resume` asked for, before it names a checkpoint."""

    arg: str  # `latest`, `best`, or a checkpoint or run folder
    output_dir: Path  # where the runs of `name` live (run.output_dir)
    name: str  # run.name
    job: bool = False  # a job's shared folder (--rdzv-id, SLURM): `latest` means its own


def resume_point(
    asked: ResumeRequest | Path | None,
    run_dir: Path | None = None,
    listings: Listings | None = None,
) -> Path | None:
    """The checkpoint to start from, or None to start anew.

    1. A run folder that holds a complete checkpoint continues from its newest: a restarted
       attempt, a requeued job, nodes that join later. The plan sees to it that a first
       attempt writes into such a folder only to continue from that newest checkpoint.
    2. Else what was asked: a checkpoint already chosen (the plan's, handed to the workers),
       or `--resume`'s `latest` (the newest complete checkpoint among the runs of run.name;
       for a job, only its own folder, which rule 1 covers), `best` (the best checkpoint of
       that newest run, by checkpoint.monitor), or a folder (a checkpoint, or a run folder's
       newest).

    `listings`: the launch's, where a store may already have been listed.
    """
    listings = listings or Listings()
    if run_dir is not None:
        newest = listings.newest(run_dir)
        if newest is not None:
            return newest
    if not isinstance(asked, ResumeRequest):
        return asked
    if asked.arg == "latest":
        return None if asked.job else _newest_of(asked.output_dir, asked.name, listings)
    if asked.arg == "best":
        return _best_of(_newest_of(asked.output_dir, asked.name, listings), asked.name)
    path = location(asked.arg, what="--resume")
    if not kind_for(path).exists(path, "--resume"):
        raise UsageError(f"--resume {asked.arg}: no such folder")
    return checkpoint_in(path, "--resume", listings)


def attempt_start(
    decided: Path | None,
    run_dir: Path,
    attempt: int,
    store: Store | None = None,
    nodes_may_join: bool = True,
) -> Path | None:
    """The checkpoint a worker's attempt starts from. The first starts from the launcher's
    decision (the worker plan's `resume_from`) as it is. A restarted attempt asks the rule
    again: the attempt that failed may have saved a newer checkpoint in the run's store
    (`store`: the plan's; else the run folder's). So does a first attempt whose store has
    moved past that decision, where nodes may join the run (`nodes_may_join`: a run of several
    nodes): torch's elastic agent restarts a healthy group to take in a joining node without
    counting an attempt. A run of one machine takes no node in, so its first attempt lists
    nothing."""
    listings = Listings()
    if store is not None:
        listings.take(run_dir, store)
    if attempt == 0 and (not nodes_may_join or listings.newest(run_dir) in (None, decided)):
        return decided
    return resume_point(decided, run_dir, listings)


def _newest_of(output_dir: Path, name: str, listings: Listings) -> Any:
    """The newest complete checkpoint of the runs of `name`, the newest run first: runs older
    than the newest one that has a checkpoint are never listed."""
    # A link is not a run of this name: it may lead anywhere, and a resume would write there.
    folders = [p for p in (output_dir / name).glob("*/") if not p.is_symlink()]
    for run in reversed(sorted(folders, key=lambda p: p.stat().st_mtime)):
        newest = listings.newest(run)
        if newest is not None:
            return newest
    raise UsageError(
        f"--resume latest: no run named {name!r} under {output_dir} has a complete checkpoint",
        hint="Pass a run or checkpoint folder to --resume, or start without it.",
    )


def _best_of(newest: Path, name: str) -> Path:
    # Its meta.json holds the record of the best checkpoints (the best one itself is checked
    # whole when the run starts from it).
    refuse_damaged(newest, f"--resume best: the newest checkpoint, {newest},", check=meta_damage)
    run = run_of(newest)
    best = store_of_run(run).best(newest) if run else None
    if best is None:
        raise UsageError(
            f"--resume best: the newest run of {name!r} ({run}) has no best checkpoint",
            hint="Best checkpoints are kept with checkpoint.monitor; use --resume latest.",
        )
    return best.path
