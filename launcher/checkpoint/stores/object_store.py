"""Checkpoints under a URL, through fsspec (`checkpoint.dir: s3://bucket/prefix/{run}`): S3
(s3fs), GCS, Azure, `file://`, any fsspec store no other kind takes.

An object store has no rename, so a checkpoint is written in place and counts only once its
`COMPLETE` marker is there, written last, after every rank's files and `meta.json`; a pruned
one loses its marker first. A crash at any moment leaves at worst a folder without a marker,
which no listing takes and the next attempt clears as it starts. Every rank writes its own
files straight to the store: nodes need not share a disk. A store never creates its bucket
(`launcher.checkpoint.bucket`).

A listing is one recursive listing of the prefix (one LIST request per 1000 objects on S3),
which also gives every file's size and the store's fingerprint of it: the check before a
resume takes them from there (`launcher.checkpoint.checksums`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.checkpoint.bucket import make_folder
from launcher.checkpoint.checksums import Unreadable, write_meta_and_marker
from launcher.checkpoint.store import Files, Listing, Store, recorded_run
from launcher.checkpoint.store_errors import unusable
from launcher.rundir.layout import CheckpointFiles, checkpoint_step

if TYPE_CHECKING:
    from launcher.parallel.base import Strategy

# What each store's listing calls its own fingerprint of an object's contents: S3's ETag (an
# MD5, or an MD5 of the parts' MD5s), GCS's md5Hash, Azure's etag. The first one found counts.
_FINGERPRINTS = ("ETag", "md5Hash", "etag")


class ObjectStore(Store):
    """Checkpoints under a URL, through fsspec."""

    schemes = ("*",)  # any URL that no other kind takes
    remote = True
    # Nothing to do before a save, so a save costs no round trip to the store before its
    # writes: an interrupted save's files were cleared when the attempt started.
    prepares = False

    # --- listing

    def listing(self) -> Listing:
        """A store that does not answer is a UsageError naming it."""
        try:
            found = self.root.fs.find(self.root.path, detail=True)
        except FileNotFoundError:
            # A store's prefix exists while objects do: another node's probe file, its only
            # object, was removed as it was listed (two launchers starting at once).
            found = {}
        except Exception as exc:  # each store's client raises its own types
            raise unusable(self.root, exc, "checkpoints in") from None
        folders: dict[str, Files] = {}
        top = self.root.path.rstrip("/") + "/"
        for name, info in found.items():
            folder, _, file = str(name).removeprefix(top).partition("/")
            if checkpoint_step(folder) is not None and file and "/" not in file:
                folders.setdefault(folder, {})[file] = _size_and_fingerprint(info)
        marker = CheckpointFiles(self.root / "step").marker.name
        complete = sorted((n for n, files in folders.items() if marker in files), key=_step)
        return Listing(
            complete=tuple(self.root / n for n in complete),
            unpublished=tuple(self.root / n for n in folders if n not in complete),
            files={str(self.root / n): folders[n] for n in complete},
        )

    # --- reading

    @classmethod
    def reader(cls, checkpoint: Any) -> Any:
        from launcher.checkpoint.writers import store_reader

        return store_reader(checkpoint)

    @classmethod
    @contextlib.contextmanager
    def reading(cls, file: Any) -> Iterator[None]:
        try:
            yield
        except Unreadable:
            raise
        except Exception as exc:  # a store's error, a body cut short
            raise Unreadable.reading(file, exc) from exc

    @classmethod
    def files_in(cls, folder: Any) -> Files:
        folder.fs.invalidate_cache(folder.path)  # a writer's file system may cache listings
        return {
            str(info["name"]).rstrip("/").rsplit("/", 1)[-1]: _size_and_fingerprint(info)
            for info in folder.fs.ls(folder.path, detail=True)
            if info.get("type") == "file"
        }

    @classmethod
    def exists(cls, place: Any, what: str) -> bool:
        try:
            return bool(place.exists())
        except Exception as exc:  # each store and its client library raise their own types
            raise unusable(place, exc, what) from None

    @classmethod
    def named(cls, folder: Any) -> Store:
        return cls(folder)  # a store's prefix is a store

    @classmethod
    def run_of(cls, checkpoint: Any) -> Path | None:
        """The run folder that records the checkpoint's store, where this process read it."""
        return recorded_run(checkpoint.parent)

    # --- writing

    def where(self, step: int) -> Any:
        return self.checkpoint(step)  # in place: it counts once its marker is there

    def start_attempt(self, strategy: Strategy, run_dir: Path) -> None:
        """A store is every node's: no folder to share. Rank 0 clears the files of saves that
        a crash cut short (step folders without a marker), which a save of the same step must
        not mix with its own, before any rank writes."""
        if strategy.is_main:
            for folder in self.listing().unpublished:
                self.discard(folder)
        strategy.barrier()

    def writer(self, where: Any, own_file: Any, data: bytes) -> Any:
        from launcher.checkpoint.writers import store_writer

        return store_writer(where).record((own_file, data), self.write_file)

    def write_file(self, path: Any, data: bytes) -> None:
        # Folders where the store has them (file://, a mount), never its bucket: one check
        # that the bucket is there on S3, which has no folders.
        make_folder(path.fs, path.parent.path)
        path.write_bytes(data)

    def publish(self, where: Any, step: int, meta: str, writer: Any) -> Any:
        write_meta_and_marker(self, where, meta, writer)  # the marker last: now it counts
        return where

    def remove(self, checkpoint: Any) -> None:
        CheckpointFiles(checkpoint).marker.unlink()  # unpublished first
        self.discard(checkpoint)

    def discard(self, where: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            where.fs.rm(where.path, recursive=True)


def _size_and_fingerprint(info: dict[str, Any]) -> tuple[int, str | None]:
    value = next((info[key] for key in _FINGERPRINTS if info.get(key)), None)
    return int(info.get("size") or 0), value if isinstance(value, str) else None


def _step(name: str) -> int:
    return checkpoint_step(name) or 0
