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

Torch-free. TensorBoard's own reader reads them back in the tests.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path

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
    caller decides when to pay for the disk (`launcher.metrics.tensorboard` does it in a
    thread of its own)."""

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
