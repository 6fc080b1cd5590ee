"""Reads what W&B wrote for an offline run (`run-<id>.wandb`), with W&B's own protobuf records:
wandb 0.31 has no reader of its own (`wandb sync --view` is gone), and its file is LevelDB's
log format: 32 KiB blocks of records, each a 7-byte header (crc32, length, type) and its data,
after the file's own 7-byte header (`:W&B`, a magic number, a version)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:  # the block's zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            break  # the end of what was written
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            out.append(pending)
    return out


@dataclass
class OfflineRun:
    run_id: str = ""
    history: list[dict] = field(default_factory=list)  # each logged row: {"_step": ..., k: v}
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None


def read_offline_run(folder: Path) -> OfflineRun:
    """The records of one `offline-run-*` folder."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("run-*.wandb")
    run = OfflineRun()
    for payload in _payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}  # fmt: skip
            run.history.append(row)
        elif kind == "config":
            for item in record.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run
