"""Checkpoints in a folder of this machine's file system: the run folder's `checkpoints/`.

A checkpoint is written under a hidden `.step-N.partial` name and renamed into place, so a
crash never leaves a folder that looks complete; a pruned one is renamed away first, then
deleted (`launcher.checkpoint.pruning` finishes a deletion a kill cut short). Every rank of
every node writes into the one folder, so the run folder must be shared
(`launcher.checkpoint.shared_storage`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.checkpoint.checksums import write_meta_and_marker
from launcher.checkpoint.save_failure import explained_writes
from launcher.checkpoint.store import Files, Listing, Store, step_of
from launcher.errors import RunError
from launcher.rundir.layout import CheckpointFiles, checkpoint_step, is_cut_short, staging_folder

if TYPE_CHECKING:
    from launcher.parallel.base import Strategy


class LocalStore(Store):
    """Checkpoints in a folder of this machine (shared by every node)."""

    schemes = ("",)  # a path, not a URL
    prepares = True  # `prepare` makes the folder every rank writes into

    # --- listing

    def listing(self) -> Listing:
        try:
            entries = list(self.root.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            entries = []
        steps = [p for p in entries if checkpoint_step(p.name) is not None]
        complete = [p for p in steps if CheckpointFiles(p).is_complete]
        unpublished = [p for p in steps if p not in complete]
        return Listing(tuple(sorted(complete, key=_step)), tuple(unpublished))

    def cut_short_deletions(self) -> list[Path]:
        """The pruned checkpoints that their launcher, stopped mid-delete, left unpublished
        (`CheckpointFiles.unpublished`): folders, never a link."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if is_cut_short(p.name) and _is_folder(p))

    # --- reading

    @classmethod
    def files_in(cls, folder: Any) -> Files:
        with os.scandir(folder) as entries:
            return {e.name: (e.stat().st_size, None) for e in entries if e.is_file()}

    @classmethod
    def run_of(cls, checkpoint: Any) -> Path | None:
        """The folder above the `checkpoints/` that holds it, if one does."""
        from launcher.rundir.layout import run_holding

        return run_holding(checkpoint)

    # --- writing

    def start_attempt(self, strategy: Strategy, run_dir: Path) -> None:
        """Collective, as an attempt starts: every rank must write into the one folder."""
        from launcher.checkpoint.shared_storage import check_shared_run_dir

        check_shared_run_dir(strategy, run_dir)

    def where(self, step: int) -> Any:
        """Where the save of `step` writes its files until it is published."""
        return staging_folder(self.root, step)

    def prepare(self, where: Any) -> None:
        """An empty folder (a crash's leftover is never published)."""
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)

    def writer(self, where: Any, own_file: Any, data: bytes) -> Any:
        from launcher.checkpoint.writers import local_writer

        return local_writer(where).record((own_file, data), self.write_file)

    def write_file(self, path: Any, data: bytes) -> None:
        with explained_writes(path), open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def publish(self, where: Any, step: int, meta: str, writer: Any) -> Any:
        final = self.checkpoint(step)
        write_meta_and_marker(self, where, meta, writer)
        if final.exists():  # never replace a published checkpoint (the plan prevents this)
            raise RunError(f"{final} already exists; not overwriting it")
        os.replace(where, final)
        _fsync_dir(final.parent)
        return final

    def remove(self, checkpoint: Any) -> None:
        """Unpublished first, atomically, then deleted."""
        unpublished = CheckpointFiles(checkpoint).unpublished
        os.replace(checkpoint, unpublished)
        shutil.rmtree(unpublished, ignore_errors=True)

    def discard(self, where: Any) -> None:
        shutil.rmtree(where, ignore_errors=True)


def _step(checkpoint: Any) -> int:
    return step_of(checkpoint) or 0


def _is_folder(path: Path) -> bool:
    """A folder itself, not a link to one."""
    import stat

    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _fsync_dir(path: Any) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
