"""Reading a run folder's files as anyone who can write into the folder may have left them:
only regular files are read (a FIFO would block the reader forever, `/dev/zero` would fill
its memory), and never more than a bound, so a rank that wrote a gigabyte of log costs the
launcher a few megabytes when it reports the failure.

`open_file` opens such a file or says why not: FileNotFoundError where nothing is there,
`UnreadableFile` where what is there cannot be read as a file. The byte readers return None
(or nothing) in both cases: these readers report on runs, and one odd file must never break
a report. `read_json` is the one way a JSON file from a run folder, a checkpoint or a weights
source is read: bounded in size by its kind (`JSON_LIMITS`), a regular file, and nested no
deeper than the parser can take; anything else is one `UnreadableJson` line naming the file."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from launcher.errors import UsageError

# What the launcher's reports read of a rank's log: its end, where the traceback is.
LOG_TAIL_BYTES = 4 << 20

# The most bytes each kind of JSON file may have. Each is far above what the launcher or a
# library writes (a checkpoint's meta.json holds the spec and its YAML file, itself at most
# 5 MiB; the largest Hugging Face index known, a mixture of experts', is about 9 MB) and far
# below what would fill a machine's memory once parsed.
JSON_LIMITS = {
    "checkpoint meta": 32 << 20,
    "weights index": 32 << 20,
    "safetensors header": 100_000_000,  # safetensors' own limit
    "trackers": 1 << 20,
    "record": 1 << 20,  # outcome.json, progress.json, a rank's step times: small records
    "worker plan": 64 << 20,  # the resolved spec and the YAML file it came from (5 MiB)
}


class UnreadableFile(OSError):
    """Something is at the path, but not a file to read: not a regular file (a FIFO would
    block the reader, a device never end, a folder), or refused by the system (no permission,
    a link loop). `reason` ("not a regular file") alone is for a message naming the file."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class UnreadableJson(UsageError):
    """A JSON file that cannot be taken: not a regular file, too large, not JSON, too deep.
    `reason` alone (without the path) is for a message that names the file itself."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def open_file(path: Path) -> BinaryIO:  # or a UPath
    """The regular file at `path`, open for reading (as `open(path, "rb")`, and closed the same
    way); FileNotFoundError where nothing is there, UnreadableFile where something else is.
    Opened without blocking: opening a FIFO for reading would otherwise wait for a writer.
    A checkpoint's file in a store (a UPath, `launcher.storage_url`) is opened through it."""
    if not isinstance(path, Path):
        return _open_stored(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:  # no permission, a link loop, a file where a folder should be
        raise UnreadableFile(path, f"unreadable ({exc.strerror or exc})") from None
    try:
        # os.open opens a folder too, and a FIFO or a device: only fstat tells them apart.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnreadableFile(path, "not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _open_stored(path: Any) -> BinaryIO:
    """A file in an object store: objects are regular files; a prefix is no file."""
    if not path.is_file():
        if path.exists():
            raise UnreadableFile(path, "not a regular file")
        raise FileNotFoundError(str(path))
    return path.open("rb")


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO | None]:
    """As open_file, for the readers that report on runs: None where the file is missing or
    cannot be read."""
    try:
        file = open_file(path)
    except OSError:  # FileNotFoundError and UnreadableFile among them
        yield None
        return
    with file:
        yield file


def read_head(path: Path, limit: int) -> bytes | None:
    """The file's first `limit` bytes (all of a smaller file)."""
    with open_regular(path) as file:
        if file is None:
            return None
        try:
            return file.read(limit)
        except OSError:
            return None


def read_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> bytes | None:
    """The file's last `limit` bytes, from the start of a line (all of a smaller file)."""
    with open_regular(path) as file:
        if file is None:
            return None
        try:
            start = max(0, file.seek(0, os.SEEK_END) - limit)
            file.seek(start)
            data = file.read(limit)
        except OSError:
            return None
    if start:  # the first line is cut: what is left starts after its end (if it has one)
        data = data[data.find(b"\n") + 1 :]
    return data


def read_log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """A rank's log's end as text ("" where there is none)."""
    return (read_tail(path, limit) or b"").decode("utf-8", errors="replace")


def read_json(path: Path, kind: str) -> Any:
    """The JSON value in `path`, a file of `kind` (a key of JSON_LIMITS). A missing file
    raises FileNotFoundError, as open() does; any other problem UnreadableJson."""
    limit = JSON_LIMITS[kind]
    try:
        file = open_file(path)  # /dev/zero, a FIFO, a folder: never read
    except UnreadableFile as exc:
        raise UnreadableJson(path, exc.reason) from None
    with file:
        size = os.fstat(file.fileno()).st_size if isinstance(path, Path) else path.stat().st_size
        if size > limit:
            raise UnreadableJson(path, _too_large(size, limit, kind))
        try:
            data = file.read(limit + 1)  # a file that grows while read is bounded too
        except OSError as exc:
            raise UnreadableJson(path, f"unreadable ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise UnreadableJson(path, _too_large(len(data), limit, kind))
    return parse_json(data, path)


def parse_json(data: bytes | str, where: Path | str) -> Any:
    """`data` parsed as JSON; UnreadableJson naming `where` if it is not JSON or is nested
    deeper than the parser's recursion allows."""
    try:
        return json.loads(data)
    except RecursionError:
        raise UnreadableJson(where, "nested too deeply to read") from None
    except ValueError as exc:  # UnicodeDecodeError is one
        raise UnreadableJson(where, f"not valid JSON ({_first_line(exc)})") from None


def parse_json_or_none(data: bytes | str) -> Any:
    """As parse_json, for readers of records a line at a time (a line half-written, or
    damaged): None where the text is not JSON or is nested too deeply."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def read_json_or_none(path: Path, kind: str) -> Any:
    """As read_json, for reports: None where the file is missing or cannot be taken."""
    try:
        return read_json(path, kind)
    except (FileNotFoundError, UnreadableJson):
        return None


def _too_large(size: int, limit: int, kind: str) -> str:
    return f"{size:,} bytes, more than a {kind} file may have ({limit:,})"


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
