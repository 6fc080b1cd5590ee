"""`train export`: a checkpoint's model as one file that plain PyTorch loads.

The model is read whole, in this one process, from the shards of any strategy and world size
(`launcher.checkpoint.whole_model`). What comes out is the bare model's `state_dict`:
`model.load_state_dict(torch.load(path), strict=True)`; `--hf` writes a Hugging Face folder
instead (`launcher.checkpoint.hf_export`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from launcher.checkpoint.store import Best
from launcher.checkpoint.weights_source import FORMATS
from launcher.checkpoint.whole_model import ModelRead, RecipeModel, human_bytes, read_model
from launcher.errors import UsageError
from launcher.rundir.atomic import write_new
from launcher.rundir.disk import disk_bytes


@dataclass(frozen=True)
class Exported:
    """What `export` wrote, for the lines it prints."""

    checkpoint: Path
    out: Path
    tensors: int
    numel: int  # every tensor's elements: buffers too, and tied weights once per name
    skipped: list[str] = field(default_factory=list)
    best: Best | None = None

    @classmethod
    def of(cls, read: ModelRead, out: Path) -> Exported:
        numel = sum(t.numel() for t in read.tensors.values())
        return cls(read.checkpoint, out, len(read.tensors), numel, read.skipped, read.best)

    def describe(self) -> str:
        size = human_bytes(disk_bytes(self.out))
        lines = [
            f"exported {self.tensors} tensors ({self.numel:,} values, {size}) "
            f"from {self.checkpoint} to {self.out}"
        ]
        if self.best is not None:
            lines.append(f"best checkpoint: {self.best.describe()}")
        if self.skipped:
            lines.append(
                f"skipped {len(self.skipped)} non-tensor model entries: {', '.join(self.skipped)}"
            )
        return "\n".join(lines)


def export(
    source: Path,
    out: Path,
    *,
    best: bool = False,
    ema: bool = False,
    recipe_model: RecipeModel | None = None,
) -> Exported:
    """Writes the model of the checkpoint `source` names to `out`, never overwriting it;
    with `ema`, the weights' average (`train.ema`) in place of the trained weights, under every
    name of a tied weight (which `recipe_model` tells: it is needed with `ema`)."""
    check_out(out)  # before reading anything: a wrong --out costs nothing
    if ema and recipe_model is None:
        raise ValueError("export(ema=True) needs recipe_model: the names of tied weights")
    read = read_model(source, best=best, ema=ema, recipe_model=recipe_model if ema else None)
    write_state_dict(read.tensors, out)
    return Exported.of(read, out)


def check_out(out: Path) -> None:
    """Refuses an `--out` that `write_state_dict` could not write, or would overwrite."""
    accepted = ", ".join(FORMATS)
    if out.suffix not in FORMATS:
        raise UsageError(f"--out {out}: expected a file name ending in one of {accepted}")
    if out.exists():
        raise UsageError(
            f"--out {out}: already exists; it is never overwritten",
            hint="Choose another --out, or delete the file first.",
        )
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: no folder {out.parent}")
    if FORMATS[out.suffix] == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise UsageError(
                f"--out {out}: safetensors is not installed here",
                hint="pip install safetensors, or export to a .pt file.",
            ) from None


def write_state_dict(state: dict[str, torch.Tensor], out: Path) -> None:
    """Writes `state` to `out` (format by suffix) atomically: a crash leaves no half file
    under `out`, and an existing `out` is never replaced."""

    def write(partial: Path) -> None:
        if FORMATS[out.suffix] == "safetensors":
            from safetensors.torch import save_file

            save_file(_unshared(state), str(partial))
            readable_like_any_file(partial)
        else:
            torch.save(state, partial)

    if not write_new(out, write):
        raise UsageError(f"--out {out}: already exists; it is never overwritten")


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights, views) and non-contiguous
    ones; torch.save keeps the sharing. Each name gets its own copy, so every key stays and
    `load_state_dict(strict=True)` of a model with tied weights still finds them all."""
    seen: set[int] = set()
    out = {}
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes
        empty = tensor.numel() == 0  # no memory to share (every one has address 0)
        out[key] = tensor if empty or (whole and ptr not in seen) else tensor.contiguous().clone()
        seen.add(ptr)
    return out


def readable_like_any_file(path: Path) -> None:
    """safetensors creates its files readable by their owner only; a model is shared like any
    file the user writes (torch.save's files get the umask's mode)."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask
