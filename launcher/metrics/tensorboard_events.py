"""TensorBoard's event files, written without TensorBoard.

Our own few lines rather than `tensorboard`, `tensorboardX` or `protobuf`: writing scalars
needs only the record framing and three small messages, and a run should not pull in a
heavy package (and its protobuf version pins) for that. The `tensorboard` package stays
optional: it is needed only to view the files.

An event file is a sequence of TFRecords: the data's length (uint64), a masked CRC-32C of
those 8 bytes, the data, and a masked CRC-32C of the data. Each record's data is a
protobuf `Event`; the first holds only `file_version`, the others a `Summary` of scalars:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
              Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

`read_scalars` reads the scalars of such files back, ours or any writer's that stores them
as `simple_value` (torch's `SummaryWriter.add_scalar`), without TensorBoard. Torch-free.
TensorBoard's own reader reads our files back in the tests.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from launcher.rundir.reading import open_file

FILE_VERSION = "brain.Event:2"
# TensorBoard loads every file whose name holds "tfevents"; this is the name its writers use.
_PREFIX = "events.out.tfevents."
_serial = itertools.count()  # two writers of one process in one second get two files


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), TFRecord's checksum. Pure Python: event records are small."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord stores its CRCs rotated and offset ("masked")."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord around `data`."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int64 is its two's complement: ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32's range: what a float32 cast gives
        return struct.pack("<f", math.copysign(math.inf, value))


def encode_event(
    wall_time: float,
    step: int,
    scalars: Mapping[str, float] | None = None,
    file_version: str | None = None,
) -> bytes:
    """A serialized `Event`: the file's version, or a summary of `scalars` (tag: value)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + b"\x15" + _float32(value))
            for tag, value in scalars.items()
        )
        out += _bytes_field(5, values)
    return out


class EventWriter:
    """Scalars into a new event file in `directory` (made if missing), synchronously: the
    caller decides when to pay for the disk (`launcher.metrics.trackers.tensorboard` does it
    in a thread of its own)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"{_PREFIX}{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_serial)}"
        self.path = directory / name
        # "x": never another writer's file. Held open for the run (closed by close()).
        self._file = open(self.path, "xb")  # noqa: SIM115
        self._file.write(frame(encode_event(time.time(), 0, file_version=FILE_VERSION)))

    def add_scalars(
        self, step: int, scalars: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """One event holding every scalar of `step`."""
        event = encode_event(time.time() if wall_time is None else wall_time, step, scalars)
        self._file.write(frame(event))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class DamagedEventFile(ValueError):
    """An event file whose records do not pass their checksums."""


def read_scalars(path: Path | str) -> list[tuple[int, str, float]]:
    """Every scalar of an event file, or of every event file of a folder (a run's `tb/`, where
    a resume adds a file), as `(step, tag, value)` sorted by step, then tag. A record cut short
    at a file's end (a run still writing, or killed) is left out; one that fails its checksum
    raises `DamagedEventFile`; a missing path, `FileNotFoundError`; one that is neither a
    regular file nor a folder (a FIFO, a device), `UnreadableFile`, an OSError too."""
    path = Path(path)
    files = sorted(path.glob("*tfevents*")) if path.is_dir() else [path]  # as TensorBoard
    found = [scalar for file in files for scalar in _file_scalars(file)]
    return sorted(found, key=lambda scalar: scalar[:2])


def _file_scalars(path: Path) -> Iterator[tuple[int, str, float]]:
    for record in _records(path):
        event = dict(_fields(record))  # Event: step = 2, summary = 5
        step = _signed(event.get(2, 0))
        summary = event.get(5, b"")
        for number, value in _fields(summary if isinstance(summary, bytes) else b""):
            scalar = dict(_fields(value)) if number == 1 and isinstance(value, bytes) else {}
            tag, simple_value = scalar.get(1), scalar.get(2)  # Value: tag = 1, simple_value = 2
            if isinstance(tag, bytes) and isinstance(simple_value, bytes):
                yield step, tag.decode(errors="replace"), struct.unpack("<f", simple_value)[0]


def _records(path: Path) -> Iterator[bytes]:
    """The data of each whole TFRecord of the file, its checksums checked."""
    with open_file(path) as file:  # a FIFO would block the read, a device never end
        while len(header := file.read(12)) == 12:
            length, length_crc = struct.unpack("<QI", header)
            if masked_crc32c(header[:8]) != length_crc:
                raise DamagedEventFile(f"{path}: a record's length fails its checksum")
            data, crc = file.read(length), file.read(4)
            if len(data) < length or len(crc) < 4:
                return  # cut short at the end
            if masked_crc32c(data) != struct.unpack("<I", crc)[0]:
                raise DamagedEventFile(f"{path}: a record fails its checksum")
            yield data


def _fields(message: bytes) -> Iterator[tuple[int, bytes | int]]:
    """A protobuf message's fields in order, as (number, value): an int for a varint, bytes
    otherwise (a length-delimited field's payload, a fixed field's little-endian bytes). A
    `dict` of them keeps a field's last value, as protobuf does for a field given twice."""
    at = 0
    while at < len(message):
        key, at = _read_varint(message, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _read_varint(message, at)
            yield number, value
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            yield number, message[at : at + size]
            at += size
        elif wire == 2:
            size, at = _read_varint(message, at)
            yield number, message[at : at + size]
            at += size
        else:
            raise DamagedEventFile(f"a protobuf field of wire type {wire}, which events never use")


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise DamagedEventFile("a protobuf varint runs past its message")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _signed(value: int | bytes) -> int:
    """An int64 read as a varint: its two's complement back to a negative number."""
    if not isinstance(value, int):
        return 0
    return value - (1 << 64) if value >= 1 << 63 else value
