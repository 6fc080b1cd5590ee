"""Every file of a checkpoint with the checksum it was saved with, and the check that its files
are still those bytes, made before a resume loads it.

A save records in the checkpoint's COMPLETE marker, which is written last
(`write_meta_and_marker`, each store's `publish`), every file's size and SHA-256, hashed as the
file is written (DCP's streams, `rank-N.pt`, `meta.json`: no second read), and where the store
gives one, the object's own fingerprint from one listing after the uploads (S3's ETag). Before
a resume the launcher takes each file's size and fingerprint from the listing of the store
that found the checkpoint (or lists the checkpoint once, where it was named by its URL). A
file of another size is damaged; one whose fingerprint is the recorded one is unchanged, and
none of its bytes is read; any other (a disk has no fingerprint; an object rewritten, or
copied elsewhere, has another) is read and hashed. So a checkpoint in a store, left as it was
saved, costs no LIST of its own; one on a disk, a read of every byte (BENCHMARKS.md). An empty
marker, a checkpoint's from before checksums, records nothing to check. Torch-free: the
launcher checks before it imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from launcher.checkpoint.save_failure import first_cause
from launcher.checkpoint.store import Files, kind_for
from launcher.rundir.layout import CheckpointFiles
from launcher.rundir.reading import UnreadableJson, open_file, parse_json
from launcher.safe_text import clean

_CHUNK = 8 << 20
# Files hashed at once: hashlib and file reads release the GIL, so threads use the cores.
_HASHING_THREADS = min(8, os.cpu_count() or 1)
# A marker's JSON is bounded as a meta.json is: a file of many ranks lists two files a rank.
_MARKER_LIMIT = 32 << 20


class Unreadable(Exception):
    """A checkpoint's file that its storage did not serve whole (a store's error, a body cut
    short): not damage to the checkpoint, which may be intact. Pickles with its arguments, so
    that DCP can hand it from the rank that read to the others."""

    def __init__(self, file: str, cause: str) -> None:
        super().__init__(file, cause)
        self.file, self.cause = file, cause

    def __str__(self) -> str:
        return f"{self.file} could not be read ({self.cause})"

    @classmethod
    def reading(cls, file: Any, exc: BaseException) -> Unreadable:
        return cls(str(file), first_cause(exc))


class HashingStream:
    """A stream being written, whose bytes are hashed on their way: DCP's writers write each
    file once, in order (they never seek back), so the hash is the file's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        view = memoryview(data).cast("B")
        view = view if written is None or written == view.nbytes else view[:written]
        self._hash.update(view)
        self.size += view.nbytes
        return view.nbytes

    def entry(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self._hash.hexdigest()}

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the stream's own
        return getattr(self._stream, name)


def entry_of(data: bytes) -> dict[str, Any]:
    """The record of a file that holds `data`."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def fingerprints(folder: Any) -> dict[str, str]:
    """{file name: the store's fingerprint of it} for the files directly in `folder`, from one
    listing; empty where the storage gives none (a disk, `file://`)."""
    return {name: print_ for name, (_, print_) in _listed(folder).items() if print_ is not None}


def write_meta_and_marker(store: Any, where: Any, meta: str, writer: Any) -> None:
    """meta.json, then the COMPLETE marker, which lists every file of the checkpoint with its
    checksum: a store's `publish`. `writer`: the save's, which recorded every file it wrote."""
    files, data = CheckpointFiles(where), meta.encode()
    store.write_file(files.meta, data)
    recorded = {**writer.files, files.meta.name: entry_of(data)}
    store.write_file(files.marker, marker_text(recorded, writer.listed))


def marker_text(files: dict[str, dict[str, Any]], listed: dict[str, str]) -> bytes:
    """The COMPLETE marker of a checkpoint whose files are `files` ({name: entry_of's record}),
    with the store's fingerprints `listed` ({name: fingerprint}) where it gave them."""
    record = {
        name: {**entry, **({"fingerprint": listed[name]} if name in listed else {})}
        for name, entry in sorted(files.items())
    }
    return json.dumps({"checksum": "sha256", "files": record}, indent=1).encode()


def recorded_files(checkpoint: Any) -> dict[str, dict[str, Any]] | None:
    """{file name: its record} as the checkpoint's marker holds them; None for an empty
    marker (saved before checksums were). UnreadableJson where the marker is malformed."""
    marker = CheckpointFiles(checkpoint).marker
    data = _read_whole(marker, _MARKER_LIMIT + 1)
    if not data.strip():
        return None
    if len(data) > _MARKER_LIMIT:
        raise UnreadableJson(marker, f"more than a marker may hold ({_MARKER_LIMIT:,} bytes)")
    record = parse_json(data, marker)
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(map(_is_entry, files.values())):
        raise UnreadableJson(marker, "not a record of the checkpoint's files")
    for name in files:
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UnreadableJson(marker, f"names a file outside the checkpoint ({clean(name)})")
    return files


def changed_file(checkpoint: Any, listed: Files | None = None) -> str | None:
    """What differs from the record of the checkpoint's files, naming the first file that
    does; None where every recorded file is as it was saved, or nothing is recorded.
    Unreadable where the storage does not serve a file it must read. `listed`: its files as
    a listing of its store just gave them (`Listing.files_of`), which spares a second one."""
    try:
        files = recorded_files(checkpoint)
    except UnreadableJson as exc:
        return f"{Path(str(exc.path)).name}: {exc.reason}"
    if not files:
        return None
    listed, to_hash = (_listing(checkpoint) if listed is None else listed), []
    for name, saved in sorted(files.items()):
        if name not in listed:
            return f"{name} is missing"
        size, fingerprint = listed[name]
        if size != saved["size"]:
            return f"{name} is {size:,} bytes, where {saved['size']:,} were saved"
        if saved.get("fingerprint") is None or fingerprint != saved["fingerprint"]:
            to_hash.append(name)
    with ThreadPoolExecutor(_HASHING_THREADS) as pool:
        hashes = dict(
            zip(to_hash, pool.map(lambda n: _sha256(checkpoint / n), to_hash), strict=True)
        )
    for name in to_hash:
        if hashes[name] != files[name]["sha256"]:
            return f"{name} does not match its checksum: its bytes changed since it was saved"
    return None


def _listed(folder: Any) -> Files:
    """{name: (size, the store's fingerprint or None)} of the files directly in `folder`, from
    one listing of what the storage holds now."""
    return kind_for(folder).files_in(folder)


def _listing(checkpoint: Any) -> Files:
    try:
        return _listed(checkpoint)
    except Exception as exc:  # each store's client raises its own types
        raise Unreadable.reading(checkpoint, exc) from exc


def _sha256(path: Any) -> str:
    digest = hashlib.sha256()
    try:
        with open_file(path) as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
    except Exception as exc:  # a store's error, a body cut short, a disk's EIO
        raise Unreadable.reading(path, exc) from exc
    return digest.hexdigest()


def _read_whole(path: Any, limit: int) -> bytes:
    try:
        with open_file(path) as file:
            return file.read(limit)
    except Exception as exc:
        raise Unreadable.reading(path, exc) from exc


def _is_entry(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    size, digest = entry.get("size"), entry.get("sha256")
    sized = isinstance(size, int) and not isinstance(size, bool) and size >= 0
    return sized and isinstance(digest, str) and isinstance(entry.get("fingerprint", ""), str)
