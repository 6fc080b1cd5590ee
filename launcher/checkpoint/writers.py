"""DCP's writers for a checkpoint's two kinds of storage, and its reader for a store, with what
a checkpoint adds to them.

- Every file a save writes is hashed as it is written (`launcher.checkpoint.checksums`): DCP's
  shards and `.metadata` through its streams, and each rank's own `rank-N.pt`, which the writer
  writes as its write starts (so DCP's gather of every rank's results covers it). Each rank's
  records reach rank 0 with its write results, as DCP's StorageWriter contract hands every
  rank's results to `finish` on the coordinator; they are taken out before DCP sees them.
  Rank 0 keeps them (`files`), with the store's fingerprints of the files from one listing
  (`listed`), for the COMPLETE marker it writes when it publishes.
- A store's folders are made by `launcher.checkpoint.bucket.make_folder`, never its bucket.
- A store's file that cannot be read (an error, a body cut short) is `checksums.Unreadable`,
  naming the file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from launcher.checkpoint.bucket import make_folder
from launcher.checkpoint.checksums import HashingStream, Unreadable, entry_of, fingerprints
from launcher.checkpoint.save_failure import explained_writes
from launcher.storage_url import storage_options

# The name under which a rank's records ride with its write results.
_RECORDS = "launcher.file-checksums"


class _RankRecords(dict):  # type: ignore[type-arg]
    """One rank's {file name: record}, among its write results on their way to rank 0."""


class _Files:
    """DCP's file-system object (a writer's or reader's `fs`), with each file written hashed
    (`taken`), the folders `mkdir` makes made by `make` where given, and each failed read of
    a file `Unreadable` naming it, where `named_reads`."""

    def __init__(
        self, inner: Any, make: Callable[[str], None] | None = None, named_reads: bool = False
    ) -> None:
        self._inner = inner
        self._make = make
        self._named_reads = named_reads
        self._written: dict[str, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:  # concat_path, exists, rm_file, ...: DCP's own
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" in mode:
            with self._reading(path, mode) as stream:
                yield stream
            return
        with self._inner.create_stream(path, mode) as stream:
            hashing = HashingStream(stream)
            yield hashing
        self._written[_name(path)] = hashing.entry()

    @contextlib.contextmanager
    def _reading(self, path: Any, mode: str) -> Iterator[Any]:
        if not self._named_reads:
            with self._inner.create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with self._inner.create_stream(path, mode) as stream:
                yield stream
        except Exception as exc:  # each store's client raises its own types
            raise Unreadable.reading(path, exc) from exc

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)  # DCP's `.metadata.tmp` → `.metadata`
        if _name(path) in self._written:
            self._written[_name(new_path)] = self._written.pop(_name(path))

    def mkdir(self, path: Any) -> None:
        if self._make is None:
            self._inner.mkdir(path)
        else:
            self._make(str(path))

    def taken(self) -> dict[str, dict[str, Any]]:
        """The records of the files written since the last call."""
        written, self._written = self._written, {}
        return written


class _Recording:
    """Mixed in before DCP's writer class: writes this rank's own file first, and records every
    file with its checksum (module docstring). `record` sets it up."""

    fs: Any
    files: dict[str, dict[str, Any]]
    listed: dict[str, str]

    def record(self, own: tuple[Any, bytes], write: Callable[[Any, bytes], None]) -> Any:
        """`own`: this rank's own file and its bytes, which `write` writes; returns the writer."""
        self._own, self._write_own = own, write
        self.files, self.listed = {}, {}
        return self

    def write_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        path, data = self._own
        self._write_own(path, data)
        written = super().write_data(plan, planner).wait()  # type: ignore[misc]
        records = _RankRecords({_name(path): entry_of(data), **self.fs.taken()})
        done: Future[list[Any]] = Future()
        done.set_result([*written, WriteResult(MetadataIndex(_RECORDS), 0, records)])
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        """On rank 0 (DCP's coordinator), once every rank has written: `.metadata`, then the
        record of every file, and the store's listing of them."""
        files: dict[str, dict[str, Any]] = {}
        for rank in results:
            for result in rank:
                if isinstance(result.storage_data, _RankRecords):
                    files.update(result.storage_data)
        dcp_results = [
            [r for r in rank if not isinstance(r.storage_data, _RankRecords)] for rank in results
        ]
        super().finish(metadata, dcp_results)  # type: ignore[misc]
        self.files = {**files, **self.fs.taken()}
        try:
            self.listed = fingerprints(self._own[0].parent)
        except Exception:  # each store's client raises its own types
            # The checkpoint is whole: without the store's fingerprints, the check before a
            # resume reads its files rather than trusting a listing.
            self.listed = {}


def local_writer(path: Path) -> Any:
    """DCP's own file writer (as `checkpoint_id=path` would pick it), whose failed writes say
    which file-system limit they hit (`launcher.checkpoint.save_failure`)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class LocalWriter(_Recording, FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            with explained_writes(path):
                return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: Any) -> None:
            with explained_writes(path):
                super().finish(metadata, results)

    writer = LocalWriter(path)
    writer.fs = _Files(writer.fs)
    return writer


def store_writer(where: Any) -> Any:
    """torch's fsspec writer for a checkpoint in a store (`where`, a UPath)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    class StoreWriter(_Recording, FsspecWriter):
        def prepare_local_plan(self, plan: Any) -> Any:
            # DCP's own makes the folder and looks for a `.metadata` there, two round
            # trips before a step goes on. An object store has no folders (write_file
            # makes them where a store has them), and no save finds another's files:
            # those of an interrupted save were cleared as the attempt started.
            if getattr(self, "use_collectives", True):
                return plan
            return super().prepare_local_plan(plan)

    # sync_files would fall back to os.sync(), the whole machine's, for a stream with no
    # file descriptor: an upload is durable once its file is closed.
    writer = StoreWriter(str(where), sync_files=False, **storage_options(where))
    fs = writer.fs.fs  # the fsspec file system under DCP's
    writer.fs = _Files(writer.fs, make=lambda folder: make_folder(fs, folder))
    return writer


def store_reader(checkpoint: Any) -> Any:
    """torch's fsspec reader for a checkpoint in a store, whose failed reads name their file."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    reader = FsspecReader(str(checkpoint), **storage_options(checkpoint))
    reader.fs = _Files(reader.fs, named_reads=True)
    return reader


def _name(path: Any) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]
