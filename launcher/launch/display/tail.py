"""Follow many growing files by polling and hand back their complete lines, in large chunks.

Workers own the writing end; we only ever open files read-only and never lock them, so
a slow display can fall behind but can never stall a worker.
"""

import os
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import BinaryIO, Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)

# Bounds one read's work per file, so one flooding rank cannot starve the others; a reader
# that got this much reads again at once instead of waiting for the next poll.
READ_CHUNK_BYTES = 8 << 20
# A "line" with no newline this long (e.g. a progress bar redrawn with \r) is emitted
# anyway rather than buffered forever.
MAX_PENDING_BYTES = 1 << 20
# Ends each piece of such a line.
CUT = b" [line cut: it goes on below]"


def decode_line(raw: bytes) -> str:
    """Decode one line as a terminal would show it: only the text after its last ``\\r``."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r")
    return text.rsplit("\r", 1)[-1]


def split_lines(chunk: bytes) -> list[str]:
    """The lines of a chunk of complete lines (each ending in a newline), decoded."""
    return [decode_line(raw) for raw in chunk.split(b"\n")[:-1]]


class FileTail:
    """Follows one file that may not exist yet; returns only complete lines."""

    def __init__(self, path: Path, *, from_end: bool = False) -> None:
        """``from_end``: skip what the file already holds now (e.g. a previous run's log)."""
        self.path = Path(path)
        self._file: BinaryIO | None = None
        self._pending = b""
        self._offset = self._current_size() if from_end else 0
        self.full = False  # the last read stopped at READ_CHUNK_BYTES: more is waiting
        self.lines_read = 0  # lines handed out (a forced or partial last line counts)

    def read_chunk(self) -> bytes:
        """New complete lines since the last call, as bytes ending in a newline (or b"");
        a trailing partial line is kept back."""
        data = self._read_new()
        if not data:
            return b""
        data = self._pending + data
        cut = data.rfind(b"\n") + 1
        chunk, self._pending = data[:cut], data[cut:]
        if len(self._pending) > MAX_PENDING_BYTES:
            # Shown in pieces, each marked as cut; the end is kept back, so that the line's last
            # piece ends it, or is marked as never ended (a progress bar redrawn with \r shows
            # its newest state instead, unmarked).
            keep = MAX_PENDING_BYTES // 2
            piece, self._pending = self._pending[:-keep], self._pending[-keep:]
            chunk += piece + (b"" if b"\r" in piece else CUT) + b"\n"
        self.lines_read += chunk.count(b"\n")
        return chunk

    def flush_chunk(self) -> tuple[bytes, bytes]:
        """Everything left, for when the writer is done: (complete lines, the trailing
        partial line without a newline, or b"")."""
        chunks = []
        while chunk := self.read_chunk():
            chunks.append(chunk)
        pending, self._pending = self._pending, b""
        self.lines_read += 1 if pending else 0
        return b"".join(chunks), pending

    def read_lines(self) -> list[str]:
        """New complete lines since the last call; a trailing partial line is kept back."""
        return split_lines(self.read_chunk())

    def flush(self) -> list[str]:
        """Like read_lines, plus the trailing partial line, for when the writer is done."""
        chunk, pending = self.flush_chunk()
        return split_lines(chunk) + ([decode_line(pending)] if pending else [])

    def unread_lines(self) -> int:
        """Lines in the file not handed out yet (a partial last line counts), counted a block
        at a time from where reading stopped: cheap at the end of a drained file."""
        newlines, last = 0, self._pending[-1:]
        try:
            with open(self.path, "rb") as f:
                f.seek(self._file.tell() if self._file is not None else self._offset)
                while block := f.read(1 << 20):
                    newlines, last = newlines + block.count(b"\n"), block[-1:]
        except (OSError, ValueError):  # gone, or closed under us
            return newlines
        return newlines + (1 if last and last != b"\n" else 0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _current_size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _read_new(self) -> bytes:
        self.full = False
        if self._file is None and not self._open():
            return b""
        assert self._file is not None
        data = self._file.read(READ_CHUNK_BYTES)
        if data:
            self.full = len(data) == READ_CHUNK_BYTES
            return data
        if self._was_replaced():
            # Start over on the new file; what was pending belonged to the old one.
            self.close()
            self._offset, self._pending = 0, b""
            return self._read_new() if self._open() else b""
        return b""

    def _open(self) -> bool:
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - kept open across polls
        except OSError:
            return False
        self._file.seek(min(self._offset, os.fstat(self._file.fileno()).st_size))
        return True

    def _was_replaced(self) -> bool:
        assert self._file is not None
        try:
            on_disk = os.stat(self.path)
        except OSError:
            return False
        mine = os.fstat(self._file.fileno())
        truncated = on_disk.st_ino == mine.st_ino and mine.st_size < self._file.tell()
        return on_disk.st_ino != mine.st_ino or truncated


class MultiTail(Generic[Key]):
    """Follows one file per key (e.g. per rank); lines come back in key order per poll."""

    def __init__(self, paths: Mapping[Key, Path], *, from_end: bool = False) -> None:
        self.tails = {key: FileTail(path, from_end=from_end) for key, path in paths.items()}

    def poll_chunks(self) -> dict[Key, bytes]:
        """Each key's new complete lines, as bytes; keys with none are left out."""
        return {key: chunk for key, tail in self.tails.items() if (chunk := tail.read_chunk())}

    @property
    def behind(self) -> bool:
        """Whether a file had more to read than one read takes."""
        return any(tail.full for tail in self.tails.values())

    def poll(self) -> list[tuple[Key, str]]:
        return [(key, line) for key, tail in self.tails.items() for line in tail.read_lines()]

    def flush(self) -> list[tuple[Key, str]]:
        return [(key, line) for key, tail in self.tails.items() for line in tail.flush()]

    def unshown(self, handled: Mapping[Key, int]) -> dict[Key, int]:
        """Lines of each key not shown: read but not `handled`, plus those not read yet."""
        counts = {
            key: tail.lines_read - handled.get(key, 0) + tail.unread_lines()
            for key, tail in self.tails.items()
        }
        return {key: n for key, n in counts.items() if n > 0}

    def close(self) -> None:
        for tail in self.tails.values():
            tail.close()
