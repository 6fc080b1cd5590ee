"""What `load.weights` names, found and checked without torch.

The launcher refuses a path that is missing, of no known format or damaged before it creates
the run folder or starts a worker, and records what it resolved (a run folder's newest complete
checkpoint) in the spec its workers read; the workers find the same files the same way
(`launcher.checkpoint.weights` reads them).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from launcher.checkpoint.damage import newest_intact
from launcher.checkpoint.format import damage
from launcher.errors import UsageError
from launcher.rundir.layout import checkpoint_in, run_of

KEY = "load.weights"
# The files `train export` writes, by suffix, and what reads them.
FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}
# A Hugging Face model folder (`save_pretrained`): one file, or shards named by an index.
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
# safetensors' own limit on the JSON header that lists a file's tensors.
_HEADER_LIMIT = 100_000_000
_ACCEPTED = (
    "Give a checkpoint folder (runs/NAME/STAMP/checkpoints/step-N), a run folder (its newest "
    "complete checkpoint), a .safetensors or .pt file (train export writes them), or a Hugging "
    f"Face folder holding {HF_WEIGHTS} or {HF_INDEX}."
)

Kind = Literal["checkpoint", "safetensors", "torch"]


@dataclass(frozen=True)
class WeightsSource:
    path: Path  # a checkpoint folder, a file, or a Hugging Face folder
    kind: Kind  # a DCP checkpoint, safetensors files, or a torch.save file
    files: tuple[Path, ...] = ()  # what is read: the safetensors files (shards), the .pt file

    def describe(self) -> str:
        shards = f" ({len(self.files)} shards)" if len(self.files) > 1 else ""
        return f"{self.path}{shards}"


def find_weights(path: Path) -> WeightsSource:
    """The weights `path` names; a UsageError naming `load.weights` where it names none."""
    if path.is_file():
        kind = FORMATS.get(path.suffix)
        if kind is None:
            raise UsageError(f"{KEY} {path}: not a file of known weights", hint=_ACCEPTED)
        if kind == "safetensors":
            safetensors_shapes(path)  # a file that is not one is refused here
        return WeightsSource(path, "torch" if kind == "torch" else "safetensors", (path,))
    if not path.is_dir():
        raise UsageError(f"{KEY} {path}: no such file or folder", hint=_ACCEPTED)
    hugging_face = _hugging_face_folder(path)
    if hugging_face is not None:
        return hugging_face
    try:
        return WeightsSource(checkpoint_in(path, KEY), "checkpoint")
    except UsageError as exc:
        raise UsageError(exc.message, hint=_ACCEPTED) from None


def check_weights(path: Path) -> WeightsSource:
    """`find_weights`, and what the launcher checks before anything starts: safetensors is
    installed where it is needed, and a checkpoint is whole."""
    source = find_weights(path)
    if source.kind == "safetensors" and importlib.util.find_spec("safetensors") is None:
        raise UsageError(
            f"{KEY} {path}: safetensors is not installed here", hint="pip install safetensors"
        )
    if source.kind == "checkpoint":
        problem = damage(source.path)
        if problem is not None:
            run = run_of(source.path)
            intact = newest_intact(run, excluding=source.path) if run else None
            raise UsageError(
                f"{KEY} {source.path}: this checkpoint is damaged: {problem}",
                hint=f"Load the newest intact one of its run: {intact}" if intact else "",
            )
    return source


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """{name: shape} of a safetensors file's tensors, from its header alone; a file that is not
    a whole safetensors file is refused."""
    header, held = _safetensors_header(path)
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = [int(n) for n in entry["shape"]]
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise UsageError(f"{KEY} {path}: not a safetensors file (entry {name!r})") from None
    if end > held:
        raise UsageError(
            f"{KEY} {path}: truncated: its header places {end:,} bytes of tensors, it holds "
            f"{held:,}"
        )
    return shapes


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (a JSON object after its 8-byte length), and the bytes of
    tensors after it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8).ljust(8, b"\0"), "little")
        if not 2 <= length <= min(_HEADER_LIMIT, size - 8):
            raise UsageError(f"{KEY} {path}: not a safetensors file (no header)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise UsageError(f"{KEY} {path}: not a safetensors file (its header is not JSON)")
    return header, size - 8 - length


def _hugging_face_folder(folder: Path) -> WeightsSource | None:
    """A Hugging Face model folder's weights: the shards its index names, or its one file;
    None where the folder has neither."""
    index = folder / HF_INDEX
    if index.is_file():
        shards = tuple(folder / name for name in _shard_names(index))
        for shard in shards:
            if not shard.is_file():
                raise UsageError(f"{KEY} {index}: names {shard.name}, which is missing")
            safetensors_shapes(shard)
        return WeightsSource(folder, "safetensors", shards)
    single = folder / HF_WEIGHTS
    if single.is_file():
        safetensors_shapes(single)
        return WeightsSource(folder, "safetensors", (single,))
    return None


def _shard_names(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, UnicodeDecodeError, AttributeError):
        weight_map = None
    names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    plain = all(isinstance(n, str) and n == Path(n).name and n not in (".", "..") for n in names)
    if not names or not plain:
        raise UsageError(
            f"{KEY} {index}: expected a weight_map of tensor names to shard files in its folder"
        )
    return sorted(names)
