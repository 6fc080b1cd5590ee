"""Reading DCP checkpoints safely, and saying precisely why one does not fit the model.

DCP unpickles its `.metadata` file and non-tensor values with full pickle. Here the metadata
is first read with an unpickler that only builds DCP's own metadata classes, and values are
loaded with `weights_only=True`: loading a checkpoint never runs code from it.

torch is imported only by what needs it: reading meta.json (`read_meta`, `meta_damage`) and
choosing a checkpoint (`launcher.checkpoint.selection`) stay torch-free.
"""

from __future__ import annotations

import io
import pickle
import stat
from pathlib import Path
from typing import Any

from launcher.checkpoint.checksums import changed_file
from launcher.checkpoint.store import Files, kind_for
from launcher.errors import UsageError
from launcher.rundir.layout import CheckpointFiles
from launcher.rundir.reading import UnreadableFile, UnreadableJson, open_file, read_json
from launcher.safe_text import clean

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # A dotted name (pickle protocol 4) would reach through a module to anything it
        # imports, e.g. filesystem.os.system: only plain names of known classes pass.
        allowed = (
            _is_dcp_class(module, name) or _is_dtype(module, name) or (module, name) in _ALLOWED
        )
        if "." not in name and allowed:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def _is_dcp_class(module: str, name: str) -> bool:
    if module not in _DCP_MODULES or "." in name:
        return False
    import importlib

    obj = getattr(importlib.import_module(module), name, None)
    return isinstance(obj, type) and obj.__module__ == module


def _is_dtype(module: str, name: str) -> bool:
    import torch

    return (
        module == "torch"
        and "." not in name
        and isinstance(getattr(torch, name, None), torch.dtype)
    )


_CORRUPT = (pickle.UnpicklingError, EOFError, AttributeError, ValueError)


def read_metadata(path: Path, flag: str = "--resume") -> Any:
    """DCP's metadata of the checkpoint at `path`; errors name `flag`, the flag or command
    that was given the path (`--resume`, `train export`)."""
    try:
        return _load_metadata(path)
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no .metadata file; not a complete checkpoint") from None
    except _CORRUPT as exc:
        raise UsageError(
            f"{flag} {path}: corrupt or unsafe checkpoint metadata ({clean(str(exc))})"
        ) from None


def saved_with(path: Path, prefix: str) -> bool:
    """Whether the checkpoint at `path` holds an entry whose keys start with `prefix`
    (`ema.`: the weights' average)."""
    return any(key.startswith(prefix) for key in read_metadata(path).state_dict_metadata)


def _load_metadata(path: Path) -> Any:
    try:
        file = open_file(CheckpointFiles(path).dcp_metadata)  # FileNotFoundError: missing
    except UnreadableFile as exc:  # a FIFO would block, a device never end
        raise pickle.UnpicklingError(f".metadata is {exc.reason}") from None
    with file:
        try:
            return _MetadataUnpickler(file).load()
        except MemoryError:
            # A length in the pickle that claims more bytes than the machine has: the
            # unpickler allocates before it reads (and finds the file far shorter).
            raise pickle.UnpicklingError("it claims more memory than there is") from None


def damage(path: Path, listed: Files | None = None) -> str | None:
    """What keeps the complete checkpoint at `path` from loading, naming the file; None when it
    is whole. DCP's data files must exist and hold every byte that `.metadata` places in them;
    meta.json and every rank's rank-N.pt must load; and every file must match the checksum its
    save recorded, where it recorded them (`launcher.checkpoint.checksums`), which finds what
    loads but is not what was saved. `checksums.Unreadable` where the storage does not serve a
    file (a store's error, a body cut short). `listed`: its files, where the listing that
    found it gave them."""
    kind = kind_for(path)
    with kind.reading(CheckpointFiles(path).dcp_metadata):
        try:
            metadata = _load_metadata(path)
        except FileNotFoundError:
            return ".metadata is missing"
        except _CORRUPT as exc:
            return f".metadata: corrupt or unsafe checkpoint metadata ({clean(str(exc))})"
    with kind.reading(path):  # a store's listing or stat that failed
        storage = getattr(metadata, "storage_data", None)
        return _data_damage(path, storage) or _state_damage(path) or changed_file(path, listed)


def _data_damage(path: Path, storage: Any) -> str | None:
    ends: dict[str, int] = {}  # each data file: where the last byte .metadata places in it ends
    for item in (storage or {}).values() if isinstance(storage, dict) else ():
        name, offset, length = (
            getattr(item, k, None) for k in ("relative_path", "offset", "length")
        )
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f".metadata: names a file outside the checkpoint ({clean(name)})"
        try:
            info = (path / name).stat()
        except FileNotFoundError:
            return f"{clean(name)} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{clean(name)} is not a regular file"
        if (size := info.st_size) < end:
            return f"{clean(name)} is truncated: {size:,} bytes, where .metadata places {end:,}"
    return None


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json: progress, the spec that made it, the YAML file as that run
    read it (`config_file`), the world size. UnreadableJson where it cannot be read, or is
    not a JSON object."""
    meta_file = CheckpointFiles(path).meta
    try:
        meta = read_json(meta_file, "checkpoint meta")
    except FileNotFoundError:
        raise UnreadableJson(meta_file, "missing") from None
    if not isinstance(meta, dict):
        raise UnreadableJson(meta_file, "not a checkpoint's record (a JSON object)")
    return meta


def recorded_spec(
    path: Path, meta: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The spec the checkpoint's run trained with, and the YAML file as that run read it
    (None where the checkpoint predates that record): what a resume starts from. `meta`: its
    meta.json, where the caller has read it already."""
    meta = read_meta(path) if meta is None else meta
    spec, yaml_file = meta.get("spec"), meta.get("config_file")
    if not isinstance(spec, dict) or not isinstance(yaml_file, dict | None):
        raise UnreadableJson(
            CheckpointFiles(path).meta, "records no spec to resume with (`spec`, `config_file`)"
        )
    return spec, yaml_file


def meta_damage(path: Path) -> str | None:
    """What keeps the checkpoint's meta.json from being read; None when it reads."""
    problem, _ = _meta_or_damage(path)
    return problem


def _meta_or_damage(path: Path) -> tuple[str | None, int]:
    """What keeps meta.json from being read (or None), and the world size it records."""
    with kind_for(path).reading(CheckpointFiles(path).meta):  # a store's error, a body cut short
        try:
            meta = read_meta(path)
        except UnreadableJson as exc:
            return f"{CheckpointFiles(path).meta.name}: {exc.reason}", 0
    world_size = meta.get("world_size")
    if not isinstance(world_size, int) or world_size < 1:
        return "meta.json does not record the world size the checkpoint was saved with", 0
    return None, world_size


def _state_damage(path: Path) -> str | None:
    files = CheckpointFiles(path)
    problem, world_size = _meta_or_damage(path)
    if problem is not None:
        return problem
    import torch

    for rank in range(world_size):
        name = files.rank_state(rank).name
        try:
            file = open_file(files.rank_state(rank))  # a FIFO would block torch.load
        except FileNotFoundError:
            return f"{name} is missing"
        except UnreadableFile as exc:
            return f"{name} is {exc.reason}"
        with file, kind_for(path).reading(files.rank_state(rank)):
            data = file.read()  # a store's error, a body cut short: Unreadable
            try:
                torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:  # torch raises a different type for each way it breaks
                reason = str(exc).split(". ")[0].splitlines()[0] if str(exc) else type(exc).__name__
                return f"{name} does not load ({clean(reason)})"
    return None


def check_matches(
    path: Path, state: dict[str, Any], limit: int = 10, held_elsewhere: frozenset[str] = frozenset()
) -> None:
    """Raises a UsageError listing missing, unexpected and mis-shaped keys: the model's first,
    then the optimizer's. Precision state may come and go (resuming fp16 as bf16).
    `held_elsewhere`: the keys other processes hold and this one does not (a pipeline's other
    stages), which the checkpoint holds for them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = read_metadata(path).state_dict_metadata
    saved = {k: v for k, v in saved.items() if k not in held_elsewhere}
    flat, _ = flatten_state_dict(state)
    problems = _mismatches(flat, saved, "model.") + _mismatches(flat, saved, "optim.")
    if any(key.startswith("ema.") for key in flat):  # a run that averages the weights
        problems += _mismatches(flat, saved, "ema.")
    if problems:
        raise UsageError(
            f"--resume {path}: this checkpoint does not fit the model and optimizer "
            f"({len(problems)} mismatched key{'s' if len(problems) > 1 else ''}):",
            details=first_problems(problems, limit),
            hint="Resume with the recipe, recipe.model and optim.name it was saved with "
            "(see its meta.json), or start a new run.",
        )


# The optimizer's groups and their settings: never loaded. The spec and the recipe set them
# now (`launcher.worker.optim.apply_after_load`), so a resume may regroup the parameters; each
# parameter's own state (`optim.state.<name>.*`) is what continues.
GROUP_SETTINGS = "optim.param_groups."


def loaded_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """The entries of a flattened state that a load reads from a checkpoint."""
    return {k: v for k, v in flat.items() if not k.startswith(GROUP_SETTINGS)}


def first_problems(problems: list[str], limit: int = 10) -> list[str]:
    """The first `limit` mismatches of a refusal, and how many more there are. Each names
    tensors as a file named them: cleaned of escape sequences (`launcher.safe_text`), as a
    rank's output is, since the failure panel shows them as the rank's log holds them."""
    more = [f"... and {len(problems) - limit} more"] if len(problems) > limit else []
    return [clean(problem) for problem in problems[:limit]] + more


def _mismatches(ours: dict[str, Any], theirs: dict[str, Any], prefix: str) -> list[str]:
    ours = {k: v for k, v in loaded_keys(ours).items() if k.startswith(prefix)}
    theirs = loaded_keys(theirs)
    theirs = {k: v for k, v in theirs.items() if k.startswith(prefix)}
    problems = [f"missing from the checkpoint: {k}" for k in sorted(ours.keys() - theirs.keys())]
    problems += [f"not in the run: {k}" for k in sorted(theirs.keys() - ours.keys())]
    for key in sorted(ours.keys() & theirs.keys()):
        size = getattr(theirs[key], "size", None)
        shape = getattr(ours[key], "shape", None)
        if size is not None and shape is not None and tuple(size) != tuple(shape):
            problems.append(f"shape of {key}: checkpoint {list(size)}, run {list(shape)}")
    # Shapes first: they say most about what changed.
    return sorted(problems, key=lambda p: not p.startswith("shape"))


def weights_only_planner() -> Any:
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return WeightsOnlyLoadPlanner()
