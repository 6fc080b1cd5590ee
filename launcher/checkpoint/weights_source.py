"""What `load.weights` names, found and checked without torch.

The launcher refuses a path that is missing, of no known format or damaged before it creates
the run folder or starts a worker, and records what it resolved (a run folder's newest complete
checkpoint) in the spec its workers read; the workers find the same files the same way
(`launcher.checkpoint.weights` reads them).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from launcher.checkpoint.catalog import checkpoint_in, run_of
from launcher.checkpoint.checksums import Unreadable
from launcher.checkpoint.damage import newest_intact
from launcher.checkpoint.format import damage
from launcher.checkpoint.safetensors_header import NotSafetensors, shown, tensor_shapes
from launcher.errors import UsageError
from launcher.rundir.reading import UnreadableJson, read_json

KEY = "load.weights"
# The files `train export` writes, by suffix, and what reads them.
FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}
# A Hugging Face model folder (`save_pretrained`): one file, or shards named by an index.
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
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
    if not path.exists():
        raise UsageError(f"{KEY} {path}: no such file or folder", hint=_ACCEPTED)
    if not path.is_dir():
        kind = FORMATS.get(path.suffix)
        if kind is None:
            raise UsageError(f"{KEY} {path}: not a file of known weights", hint=_ACCEPTED)
        if kind == "safetensors":
            safetensors_shapes(path)  # a file that is not one is refused here
        elif not path.is_file():  # a FIFO would block the worker that opens it
            raise UsageError(f"{KEY} {path}: not a regular file")
        return WeightsSource(path, "torch" if kind == "torch" else "safetensors", (path,))
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
        try:
            problem = damage(source.path)
        except Unreadable as exc:
            raise UsageError(f"{KEY} {source.path}: {exc}") from None
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
    a whole safetensors file (`launcher.checkpoint.safetensors_header`) is refused."""
    try:
        return tensor_shapes(path)
    except NotSafetensors as exc:
        raise UsageError(f"{KEY} {path}: {exc}") from None


def _hugging_face_folder(folder: Path) -> WeightsSource | None:
    """A Hugging Face model folder's weights: the shards its index names, or its one file;
    None where the folder has neither."""
    index = folder / HF_INDEX
    shard_names = _shard_names(index)
    if shard_names is not None:
        shards = tuple(folder / name for name in shard_names)
        for shard in shards:
            if not shard.exists():
                raise UsageError(f"{KEY} {index}: names {shown(shard.name)}, which is missing")
            safetensors_shapes(shard)
        return WeightsSource(folder, "safetensors", shards)
    single = folder / HF_WEIGHTS
    if single.exists():
        safetensors_shapes(single)
        return WeightsSource(folder, "safetensors", (single,))
    return None


def _shard_names(index: Path) -> list[str] | None:
    """The shard files a Hugging Face index names; None where there is no index."""
    try:
        found = read_json(index, "weights index")
    except FileNotFoundError:
        return None
    except UnreadableJson as exc:
        raise UsageError(f"{KEY} {index}: {exc.reason}") from None
    weight_map = found.get("weight_map") if isinstance(found, dict) else None
    names = list(weight_map.values()) if isinstance(weight_map, dict) else []
    plain = all(isinstance(n, str) and n == Path(n).name and n not in (".", "..") for n in names)
    if not names or not plain:
        raise UsageError(
            f"{KEY} {index}: expected a weight_map of tensor names to shard files in its folder"
        )
    return sorted(set(names))
