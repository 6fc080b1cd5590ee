"""A damaged checkpoint is refused in the launcher, before a folder is created or a worker
started, naming the file and the newest checkpoint of its run that is intact. Nothing is
deleted: the user decides what to do with the damaged one. A file the storage does not serve
(a store's error, a body cut short) is said as such: the checkpoint may well be intact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from launcher.checkpoint.catalog import run_of
from launcher.checkpoint.checksums import Unreadable
from launcher.checkpoint.format import damage
from launcher.checkpoint.store import Files, store_of_run
from launcher.errors import UsageError


def refuse_damaged(
    checkpoint: Path,
    what: str = "",
    check: Callable[[Path], str | None] | None = None,
    listed: Files | None = None,
) -> None:
    """`what` says what the checkpoint is to the user, when it is not the one they named;
    `check` what must be whole (by default, all of it: `format.damage`, which takes the
    checkpoint's files as the listing that found it gave them, `listed`, where it did)."""
    try:
        problem = check(checkpoint) if check else damage(checkpoint, listed)
    except Unreadable as exc:
        raise UsageError(
            f"{what or f'--resume {checkpoint}:'} {exc}",
            hint="The store did not serve the whole file (nothing was changed): check the store "
            "and the network, then run again.",
        ) from None
    if problem is not None:
        raise UsageError(
            f"{what or f'--resume {checkpoint}: this checkpoint'} is damaged: {problem}",
            hint=_what_to_resume_instead(checkpoint),
        )


def newest_intact(run_dir: Path, excluding: Path | None = None) -> Path | None:
    """The newest complete checkpoint of a run folder that is not damaged (other than `excluding`)."""
    for checkpoint in reversed(store_of_run(run_dir).complete()):
        if checkpoint != excluding and _is_intact(checkpoint):
            return checkpoint
    return None


def _is_intact(checkpoint: Path) -> bool:
    try:
        return damage(checkpoint) is None
    except Unreadable:  # it cannot be told: not one to offer
        return False


def _what_to_resume_instead(damaged: Path) -> str:
    run = run_of(damaged)
    intact = newest_intact(run, excluding=damaged) if run else None
    if intact is None:
        return "Its run has no intact checkpoint to resume instead; start anew without --resume."
    if run and intact == store_of_run(run).latest():
        return f"The newest intact checkpoint is {intact}: continue with --resume {intact}"
    # Continuing in place from an older checkpoint than the run's newest (the damaged one)
    # would overwrite checkpoints; the launcher never deletes one.
    return (
        f"The newest intact checkpoint is {intact}: branch off from it with --resume {intact} "
        "--run-dir NEW_FOLDER (or move the damaged checkpoint out of the run to continue in place)"
    )
