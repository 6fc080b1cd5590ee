"""Which run folder a launch writes into: a new folder, the folder of the run it resumes, or a
job's shared folder; never one that would overwrite another run's files. Which checkpoint it
starts from is `launcher.checkpoint.selection`'s to say. Each question about a folder's newest
checkpoint takes the launch's listing of its store (`catalog.Listings`), made once."""

from __future__ import annotations

import time
from pathlib import Path

from launcher.checkpoint.catalog import Listings, run_of
from launcher.errors import UsageError
from launcher.rundir.layout import RunLayout


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


def own_run(
    output_dir: Path,
    name: str,
    run_dir: Path | None,
    resume_from: Path | None,
    listings: Listings,
) -> Path:
    """The folder of a run of one launcher: a new one, or that of the run it resumes."""
    explicit = run_dir is not None
    if run_dir is None:
        # A resumed run continues in its own folder; a new run, or one resumed from a
        # checkpoint that is not inside a run folder, gets a new one.
        run_dir = (resume_from and run_of(resume_from)) or new_run_dir(output_dir, name)
    if not _would_mix(run_dir, resume_from, listings):
        return run_dir
    newest = listings.newest(run_dir)
    if not explicit:
        raise UsageError(
            f"--resume {resume_from}: its run already has a newer checkpoint "
            f"({newest}); continuing in place would overwrite it",
            hint="Branch off with --run-dir NEW_FOLDER, or resume the newest checkpoint.",
        )
    raise UsageError(
        f"--run-dir {run_dir}: already holds a run; it is never overwritten",
        hint=f"Continue it with --resume {newest}, or choose a new --run-dir."
        if newest
        else "It has no checkpoint for --resume to continue from: choose a new --run-dir.",
    )


def check_is_folder(run_dir: Path) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        what = "a file" if run_dir.is_file() else "not a folder"
        raise UsageError(
            f"--run-dir {run_dir}: is {what}; a run folder holds the run's logs, metrics and "
            "checkpoints",
            hint="Give a folder: a new one (it is created), or a run's folder to continue it.",
        )


def check_unchanged(
    run_dir: Path, resume_from: Path | None, job_id: str | None, listings: Listings
) -> None:
    """The plan's choice of folder, again once this launcher holds the folder's lock: another
    launcher may have written into it between the plan and the lock. `listings`: new ones, made
    under the lock (the plan's are from before it)."""
    if job_id is not None:
        check_job_resume(run_dir, job_id, resume_from, listings)
    elif _would_mix(run_dir, resume_from, listings):
        raise UsageError(
            f"run folder {run_dir}: another launcher wrote into it while this one was starting",
            hint="Run the command again: it is planned anew from what the folder holds now.",
        )


def _would_mix(run_dir: Path, resume_from: Path | None, listings: Listings) -> bool:
    """Writing into a folder that holds a run is safe only when this run continues exactly
    where that folder's newest checkpoint left off; anything else would mix two runs and
    overwrite or prune the other run's checkpoints."""
    if not RunLayout(run_dir).holds_a_run():
        return False
    return resume_from is None or listings.newest(run_dir) != resume_from


def refuse_finished_job(run_dir: Path, job_id: str, listings: Listings) -> None:
    """A job's folder that holds a finished run without checkpoints is never started over:
    there is nothing to continue, and starting again would replace its metrics."""
    layout = RunLayout(run_dir)
    if layout.summary.exists() and listings.newest(run_dir) is None:
        raise UsageError(
            f"run folder {run_dir} (job {job_id}) holds a finished run; it is never overwritten",
            hint="Use another --rdzv-id.",
        )


def check_job_resume(
    run_dir: Path, job_id: str, resume_from: Path | None, listings: Listings
) -> None:
    """A job's folder (every node's, a requeued node's) is joined while it has no checkpoint;
    once it has one, every node must continue from the newest."""
    newest = listings.newest(run_dir)
    if newest is not None and newest != resume_from:
        raise UsageError(
            f"run folder {run_dir} (job {job_id}) already has checkpoints; it is never overwritten",
            hint="Continue it with --resume latest on every node, or use another --rdzv-id.",
        )
