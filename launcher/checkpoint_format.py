"""Reading DCP checkpoints safely, and saying precisely why one does not fit the model.

DCP unpickles its `.metadata` file and non-tensor values with full pickle. Here the metadata
is first read with an unpickler that only builds DCP's own metadata classes, and values are
loaded with `weights_only=True`: loading a checkpoint never runs code from it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from launcher.errors import UsageError
from launcher.run_layout import CheckpointFiles

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
    return (
        module == "torch"
        and "." not in name
        and isinstance(getattr(torch, name, None), torch.dtype)
    )


def read_metadata(path: Path, flag: str = "--resume") -> Any:
    """DCP's metadata of the checkpoint at `path`; errors name `flag`, the flag or command
    that was given the path (`--resume`, `train export`)."""
    try:
        with open(CheckpointFiles(path).dcp_metadata, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no .metadata file; not a complete checkpoint") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: corrupt or unsafe checkpoint metadata ({exc})") from None


def check_matches(path: Path, state: dict[str, Any], limit: int = 10) -> None:
    """Raises a UsageError listing missing, unexpected and mis-shaped keys: the model's first,
    then the optimizer's. Precision state may come and go (resuming fp16 as bf16)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    saved = read_metadata(path).state_dict_metadata
    flat, _ = flatten_state_dict(state)
    problems = _mismatches(flat, saved, "model.") + _mismatches(flat, saved, "optim.")
    if problems:
        more = [f"... and {len(problems) - limit} more"] if len(problems) > limit else []
        raise UsageError(
            f"--resume {path}: this checkpoint does not fit the model and optimizer "
            f"({len(problems)} mismatched key{'s' if len(problems) > 1 else ''}):",
            details=problems[:limit] + more,
            hint="Resume with the recipe, recipe.model and optim.name it was saved with "
            "(see its meta.json), or start a new run.",
        )


def _mismatches(ours: dict[str, Any], theirs: dict[str, Any], prefix: str) -> list[str]:
    ours = {k: v for k, v in ours.items() if k.startswith(prefix)}
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
