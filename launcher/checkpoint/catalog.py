"""A run's checkpoints as the launcher and the readers of run folders ask for them: the newest
of a run folder, the checkpoint a folder given by the user names, the run a checkpoint belongs
to; and a launch's listings, each store listed once. Torch-free: `train runs` reads it.

The listing itself is the store's (`launcher.checkpoint.store`): on S3 each one is a LIST
request, billed and slow, so a launch lists a store once and passes the answer on
(`Listings`), and asks again only where time has passed that may have changed it (under the
run folder's lock; after the run, for its last message).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.checkpoint.store import Files, Listing, Store, kind_for, store_of_run
from launcher.errors import UsageError
from launcher.rundir.layout import CheckpointFiles


def latest_complete(run_dir: Path) -> Any | None:
    """The newest complete checkpoint of a run folder, listed now."""
    return store_of_run(run_dir).latest()


def checkpoint_in(path: Any, what: str, listings: Listings | None = None) -> Any:
    """The checkpoint a folder names: itself (a complete checkpoint folder), or a run
    folder's newest complete one, or a store prefix's. `what` names the flag or command."""
    files = CheckpointFiles(path)
    if files.is_complete:
        return path
    if files.looks_interrupted:
        raise UsageError(f"{what} {path}: this checkpoint is incomplete (its save was interrupted)")
    newest = (listings or Listings()).of(kind_for(path).named(path)).newest
    if newest is None:
        raise UsageError(
            f"{what} {path}: neither a checkpoint nor a run folder with a complete checkpoint",
            hint="A checkpoint folder holds a COMPLETE file; a run folder holds checkpoints/.",
        )
    return newest


def run_of(checkpoint: Any) -> Path | None:
    """The run folder a checkpoint belongs to: the folder above its `checkpoints/`, or for a
    store's checkpoint the run folder that records that store, where this process has read it."""
    return kind_for(checkpoint).run_of(checkpoint)


class Listings:
    """The listings of one launch: each store's made once, then passed on to every question
    the launch asks of it (the resume rule, the choice of folder, the store's check, the damage
    check), and the store each run folder's checkpoints go to, as the launch resolved it."""

    def __init__(self) -> None:
        self._made: dict[str, Listing] = {}
        self._stores: dict[Path, Store] = {}
        self.made = 0  # listings made, for the tests that count them

    def take(self, run_dir: Path, store: Store) -> None:
        """`run_dir`'s checkpoints go to `store` (the launch's, before the folder records it)."""
        self._stores[run_dir] = store

    def store_of(self, run_dir: Path) -> Store:
        return self._stores.get(run_dir) or store_of_run(run_dir)

    def of(self, store: Store) -> Listing:
        key = json.dumps(store.describe(), sort_keys=True, default=str)  # place and options
        if key not in self._made:
            self._made[key] = store.listing()
            self.made += 1
        return self._made[key]

    def files_of(self, checkpoint: Any) -> Files | None:
        """A checkpoint's files, where a listing made gave them."""
        found = (listing.files_of(checkpoint) for listing in self._made.values())
        return next((files for files in found if files is not None), None)

    def newest(self, run_dir: Path) -> Any | None:
        """The newest complete checkpoint of the run in `run_dir`."""
        return self.of(self.store_of(run_dir)).newest
