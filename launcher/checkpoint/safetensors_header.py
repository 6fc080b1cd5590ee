"""A safetensors file's header, checked whole the way the safetensors format requires, without
reading a tensor and without torch.

The file is 8 bytes (N, little-endian), N bytes of a JSON object, then the tensors' bytes. The
object maps each tensor's name to its `dtype`, `shape` and `data_offsets` [begin, end) in those
bytes, beside an optional `__metadata__` map of strings. The offsets must tile the bytes: sorted,
each tensor begins where the one before ends, the first at 0 and the last ending at the file's
end, and each holds exactly its shape's elements of its dtype. safetensors' own reader checks
the same in the worker, where a failure is a traceback on rank 0: here it is one line before
anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from launcher.rundir.reading import (
    JSON_LIMITS,
    UnreadableFile,
    UnreadableJson,
    open_file,
    parse_json,
)

HEADER_LIMIT = JSON_LIMITS["safetensors header"]  # safetensors' own limit
# The bytes of an element of each dtype safetensors loads into torch (`safetensors.torch`).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E5M2FNUZ": 1, "F8_E4M3FNUZ": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_METADATA = "__metadata__"
_SHOWN = 80  # the most characters of a name or shape a message shows


class NotSafetensors(ValueError):
    """What keeps a file from being a whole safetensors file, in words that follow its path."""


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """{name: shape} of the file's tensors, from its header, once the whole header is checked;
    NotSafetensors where anything is wrong with it."""
    header, held = _read_header(path)
    metadata = header.pop(_METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise NotSafetensors(f"not a safetensors file ({_METADATA} is not a map of strings)")
    spans = sorted((_span(name, entry), name) for name, entry in header.items())
    _check_tiling(spans, held)
    return {name: list(entry["shape"]) for name, entry in header.items()}


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header's JSON object, and how many bytes of tensors follow it."""
    try:
        file = open_file(path)
    except FileNotFoundError:
        raise NotSafetensors("no such file") from None
    except UnreadableFile as exc:
        raise NotSafetensors(exc.reason) from None
    with file:
        size = os.fstat(file.fileno()).st_size
        length = int.from_bytes(file.read(8).ljust(8, b"\0"), "little")
        if length > HEADER_LIMIT:
            raise NotSafetensors(
                f"not a safetensors file (a header of {length:,} bytes, more than safetensors "
                f"allows: {HEADER_LIMIT:,})"
            )
        if not 2 <= length <= size - 8:
            raise NotSafetensors("not a safetensors file (no header)")
        data = file.read(length)
    try:
        header = parse_json(data, path)
    except UnreadableJson as exc:
        raise NotSafetensors(f"not a safetensors file (its header is {exc.reason})") from None
    if not isinstance(header, dict):
        raise NotSafetensors("not a safetensors file (its header is not a JSON object)")
    return header, size - 8 - length


def _span(name: str, entry: Any) -> tuple[int, int]:
    """The [begin, end) of one tensor's bytes, once its dtype, shape and offsets agree."""
    fields = entry if isinstance(entry, dict) else {}
    dtype, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
        raise NotSafetensors(f"tensor {shown(name)}: no shape (a list of sizes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise NotSafetensors(
            f"tensor {shown(name)}: data_offsets must be [begin, end], two byte positions "
            f"from 0 (it has {_short(offsets)})"
        )
    begin, end = offsets
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise NotSafetensors(
            f"tensor {shown(name)}: unknown dtype {_short(dtype)} (torch loads "
            f"{', '.join(DTYPE_BYTES)})"
        )
    if end < begin:
        raise NotSafetensors(
            f"tensor {shown(name)}: its data_offsets [{begin}, {end}] are reversed"
        )
    needed = _bytes_of(shape, DTYPE_BYTES[dtype])
    if end - begin != needed:
        size = "more than 2**64 bytes" if needed is None else f"{needed:,} bytes"
        raise NotSafetensors(
            f"tensor {shown(name)}: shape {_short(shape)} of {dtype} is {size}, its "
            f"data_offsets [{begin}, {end}] hold {end - begin:,}"
        )
    return begin, end


def _check_tiling(spans: list[tuple[tuple[int, int], str]], held: int) -> None:
    """The tensors, by offset, cover the bytes after the header exactly once."""
    reached, before = 0, None
    for (begin, end), name in spans:
        if begin < reached:
            raise NotSafetensors(f"tensor {shown(name)} overlaps tensor {shown(before or '')}")
        if begin > reached:
            raise NotSafetensors(
                f"no tensor holds bytes {reached:,} to {begin:,} (before tensor {shown(name)})"
            )
        reached, before = end, name
    if reached > held:
        raise NotSafetensors(
            f"truncated: its header places {reached:,} bytes of tensors, it holds {held:,}"
        )
    if reached < held:
        raise NotSafetensors(
            f"not a whole safetensors file: {held - reached:,} bytes after its last tensor"
        )


def _bytes_of(shape: list[int], element_bytes: int) -> int | None:
    """The bytes of a tensor of `shape`; None past 2**64 (a forged shape of a million huge
    sizes is not multiplied out)."""
    total = element_bytes
    for size in shape:
        total *= size
        if total >= 2**64:
            return None
    return total


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shown(name: str) -> str:
    """A tensor's name as a message shows it: quoted, escape sequences escaped, cut short."""
    return repr(name[:_SHOWN]) + ("..." if len(name) > _SHOWN else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
