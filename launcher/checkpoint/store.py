"""Where checkpoints are written: one small interface, two kinds of storage.

`LocalStore`, the run folder's `checkpoints/`: a checkpoint is written under a hidden
`.step-N.partial` name and renamed into place, so a crash never leaves a folder that looks
complete; a pruned one is renamed away first, then deleted (`launcher.checkpoint.pruning`).

`ObjectStore`, any fsspec URL (`checkpoint.dir: s3://bucket/prefix/{run}`): an object store has
no rename, so a checkpoint is written in place and counts only once its `COMPLETE` marker is
there, written last, after every rank's files and `meta.json`; a pruned one loses its marker
first. A crash at any moment leaves at worst a folder without a marker, which the catalogue
(`launcher.checkpoint.catalog`) never takes and the next attempt clears as it starts. Every rank
writes its own files straight to the store: nodes need not share a disk.

Either way the marker lists every file of the checkpoint with its checksum
(`launcher.checkpoint.checksums`), which a resume checks before it loads, and a store never
creates its bucket (`launcher.checkpoint.bucket`).

Each method is called by the ranks the Checkpointer says; none is collective.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from typing import Any

from launcher.checkpoint.bucket import make_folder
from launcher.checkpoint.catalog import Catalog
from launcher.checkpoint.checksums import entry_of, marker_text
from launcher.checkpoint.save_failure import explained_writes
from launcher.checkpoint.shared_storage import check_shared_run_dir
from launcher.checkpoint.writers import local_writer, store_reader, store_writer
from launcher.errors import RunError
from launcher.parallel.base import Strategy
from launcher.rundir.layout import CheckpointFiles, checkpoint_step, staging_folder
from launcher.storage_url import is_remote


class LocalStore:
    """Checkpoints in a folder of this machine's file system (shared by every node)."""

    prepares = True  # `prepare` makes the folder every rank writes into

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def start_attempt(self, strategy: Strategy, run_dir: Path) -> None:
        """Collective, as an attempt starts: every rank must write into the one folder."""
        check_shared_run_dir(strategy, run_dir)

    def where(self, step: int) -> Any:
        """Where the save of `step` writes its files until it is published."""
        return staging_folder(self.catalog.root, step)

    def prepare(self, where: Any) -> None:
        """Rank 0, before any rank writes: an empty folder (a crash's leftover is never published)."""
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)

    def writer(self, where: Any, own_file: Any, data: bytes) -> Any:
        """DCP's writer into `where`, which writes this rank's `own_file` (`data`) first."""
        return local_writer(where).record((own_file, data), self.write_file)

    def write_file(self, path: Any, data: bytes) -> None:
        with explained_writes(path), open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def publish(self, where: Any, step: int, meta: str, writer: Any) -> Any:
        """Rank 0, once every rank's files are written: the checkpoint, complete and in place.
        `writer`: the save's, which recorded every file it wrote (the marker lists them)."""
        final = self.catalog.checkpoint(step)
        _write_meta_and_marker(self, where, meta, writer)
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
        """What a failed save left."""
        shutil.rmtree(where, ignore_errors=True)


class ObjectStore:
    """Checkpoints under a URL, through fsspec: S3 (s3fs), GCS, Azure, any fsspec store."""

    # Nothing to do before a save, so a save costs no round trip to the store before its
    # writes: an interrupted save's files were cleared when the attempt started.
    prepares = False

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def where(self, step: int) -> Any:
        return self.catalog.checkpoint(step)  # in place: it counts once its marker is there

    def start_attempt(self, strategy: Strategy, run_dir: Path) -> None:
        """Collective, as an attempt starts. A store is every node's: no folder to share. Rank
        0 clears the files of saves that a crash cut short (step folders without a marker),
        which a save of the same step must not mix with its own, before any rank writes."""
        if strategy.is_main and self.catalog.root.is_dir():
            self._clear_unpublished()
        strategy.barrier()

    def _clear_unpublished(self) -> None:
        for folder in self.catalog.root.iterdir():
            files = CheckpointFiles(folder)
            if checkpoint_step(folder.name) is not None and not files.is_complete:
                self.discard(folder)

    def writer(self, where: Any, own_file: Any, data: bytes) -> Any:
        return store_writer(where).record((own_file, data), self.write_file)

    def write_file(self, path: Any, data: bytes) -> None:
        # Folders where the store has them (file://, a mount), never its bucket: one check
        # that the bucket is there on S3, which has no folders.
        make_folder(path.fs, path.parent.path)
        path.write_bytes(data)

    def publish(self, where: Any, step: int, meta: str, writer: Any) -> Any:
        _write_meta_and_marker(self, where, meta, writer)  # the marker last: now it counts
        return where

    def remove(self, checkpoint: Any) -> None:
        CheckpointFiles(checkpoint).marker.unlink()  # unpublished first
        self.discard(checkpoint)

    def discard(self, where: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            where.fs.rm(where.path, recursive=True)


def _write_meta_and_marker(store: Any, where: Any, meta: str, writer: Any) -> None:
    """meta.json, then the COMPLETE marker, which lists every file of the checkpoint with its
    checksum (`launcher.checkpoint.checksums`)."""
    files, data = CheckpointFiles(where), meta.encode()
    store.write_file(files.meta, data)
    recorded = {**writer.files, files.meta.name: entry_of(data)}
    store.write_file(files.marker, marker_text(recorded, writer.listed))


def store_for(catalog: Catalog) -> LocalStore | ObjectStore:
    return ObjectStore(catalog) if is_remote(catalog.root) else LocalStore(catalog)


def reader(checkpoint: Any) -> Any:
    """DCP's reader for a checkpoint: None (DCP picks its own) for a local folder."""
    return store_reader(checkpoint) if is_remote(checkpoint) else None


def torch_bytes(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _fsync_dir(path: Any) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
