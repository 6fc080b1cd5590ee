"""`train export`: a checkpoint's model as one file that plain PyTorch loads.

A checkpoint holds every rank's shards of the model, the optimizer and the precision state,
in torch.distributed.checkpoint's (DCP) format, whatever the strategy and world size. Export
reads only the model's tensors, each one whole: DCP reassembles a tensor from the shards of
every rank that wrote it, in this one process, with no process group. What comes out is the
bare model's `state_dict`: `model.load_state_dict(torch.load(path), strict=True)`.
"""

from __future__ import annotations

import math
import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint.format import read_metadata, weights_only_planner
from launcher.checkpoint.weights_source import FORMATS
from launcher.errors import UsageError
from launcher.parallel.wrapper_names import without_wrappers
from launcher.rundir.atomic import write_new
from launcher.rundir.layout import Best, CheckpointFiles, RunLayout, checkpoint_in, run_of
from launcher.rundir.reading import UnreadableJson

COMMAND = "train export"
# Reads of a run's newest checkpoint, each one removed by the run while it was read.
_ATTEMPTS = 5
_MODEL = "model."  # DCP's flattened keys of the state's "model" entry
_EMA = "ema."  # and of the weights' average (`train.ema`), by the bare model's names
# torch_xla's FSDPv2 (`xla_fsdp`) keeps the model as this attribute of its wrapper, so its
# checkpoints' keys read `model._orig_module.0.weight`; the bare model knows `0.weight`.
_WRAPPERS = ("_orig_module",)


@dataclass(frozen=True)
class Exported:
    """What `export` wrote, for the lines it prints."""

    checkpoint: Path
    out: Path
    tensors: int
    numel: int  # every tensor's elements: buffers too, and tied weights once per name
    skipped: list[str] = field(default_factory=list)
    best: Best | None = None

    def describe(self) -> str:
        size = _human_bytes(self.out.stat().st_size)
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


def export(source: Path, out: Path, *, best: bool = False, ema: bool = False) -> Exported:
    """Writes the model of the checkpoint `source` names to `out`, never overwriting it;
    with `ema`, the weights' average (`train.ema`) in place of the trained weights."""
    check_out(out)  # before reading anything: a wrong --out costs nothing
    for attempt in range(1, _ATTEMPTS + 1):
        checkpoint, chosen = resolve_source(source, best=best)
        try:
            state, skipped = load_model_state(checkpoint, ema=ema)
            break
        except UsageError:
            # A running run that keeps few checkpoints may remove this one while it is read:
            # its newest one is read then (a checkpoint named itself is not replaced).
            if (
                attempt == _ATTEMPTS
                or checkpoint == source
                or CheckpointFiles(checkpoint).is_complete
            ):
                raise
    write_state_dict(state, out)
    numel = sum(t.numel() for t in state.values())
    return Exported(checkpoint, out, len(state), numel, skipped, chosen)


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


def resolve_source(source: Path, *, best: bool = False) -> tuple[Path, Best | None]:
    """The checkpoint SOURCE names: itself (a checkpoint folder) or a run folder's newest
    complete one; with `best`, the best checkpoint of its run (and which that is)."""
    if not source.is_dir():
        raise UsageError(f"{COMMAND} {source}: no such folder")
    files = CheckpointFiles(source)
    run = run_of(source) if files.is_complete else source
    if best:
        if run is None:
            raise UsageError(f"{COMMAND} {source} --best: this checkpoint is not in a run folder")
        try:
            chosen = RunLayout(run).best()
        except UnreadableJson as exc:  # its newest checkpoint's record of the best ones
            raise UsageError(f"{COMMAND} {source} --best: {exc.message}") from None
        if chosen is None:
            raise UsageError(
                f"{COMMAND} {source} --best: the run {run} has no best checkpoint",
                hint="Best checkpoints are kept for runs with checkpoint.monitor; "
                "export without --best for the newest one.",
            )
        return chosen.path, chosen
    return checkpoint_in(source, COMMAND), None


def load_model_state(
    checkpoint: Path, ema: bool = False
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's tensors, whole, keyed as the bare model's `state_dict`, and the model
    entries that are not tensors (left out: they would need unpickling). With `ema`, each
    averaged parameter's average (`ema.<name>`) in place of its trained value; buffers and
    frozen parameters, which are not averaged, are the model's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # The restricted unpickler reads .metadata first: DCP's own reader unpickles it with
    # plain pickle, so an unsafe one must be refused before DCP sees it.
    saved = read_metadata(checkpoint, COMMAND).state_dict_metadata
    entries = {k: v for k, v in saved.items() if k.startswith(_MODEL)}
    if ema:
        entries.update(_averages(saved, checkpoint))
    _check_sizes(entries, checkpoint)
    # Whole tensors at the saved (global) sizes: DCP fills each from every shard that
    # overlaps it, whatever world size and strategy wrote them.
    state = {
        key: torch.empty(md.size, dtype=md.properties.dtype)  # after _check_sizes
        for key, md in entries.items()
        if isinstance(md, TensorStorageMetadata)
    }
    skipped = sorted(entries.keys() - state.keys())
    if not state:
        raise UsageError(f"{COMMAND} {checkpoint}: the checkpoint holds no model tensors")
    read_tensors(state, checkpoint, COMMAND)
    if ema:  # the averages replace the trained values of the same names
        state = {key: state.get(_EMA + bare_key(key), value) for key, value in state.items()
                 if not key.startswith(_EMA)}  # fmt: skip
    bare = {bare_key(key): tensor for key, tensor in state.items()}
    if len(bare) != len(state):
        raise UsageError(f"{COMMAND} {checkpoint}: two model keys differ only by a wrapper")
    return bare, [key.removeprefix(_MODEL) for key in skipped]


def _averages(saved: dict[str, Any], checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's `ema.<name>` entries (`train.ema`), or a UsageError."""
    averages = {k: v for k, v in saved.items() if k.startswith(_EMA)}
    if not averages:
        raise UsageError(
            f"{COMMAND} {checkpoint} --ema: this checkpoint holds no average of the weights",
            hint="Its run did not set train.ema; export without --ema.",
        )
    return averages


def _check_sizes(entries: dict[str, Any], checkpoint: Path) -> None:
    """The tensors .metadata claims must fit in the files beside it (DCP stores them raw): a
    damaged or forged claim is refused before memory is allocated for it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    claimed = sum(
        math.prod(md.size) * md.properties.dtype.itemsize
        for md in entries.values()
        if isinstance(md, TensorStorageMetadata)
    )
    try:
        held = sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file())
    except OSError as exc:  # removed while read (a running run's rotation), say
        raise UsageError(f"{COMMAND} {checkpoint}: cannot read it ({exc.strerror})") from None
    if claimed > held:
        raise UsageError(
            f"{COMMAND} {checkpoint}: its .metadata claims {_human_bytes(claimed)} of model "
            f"tensors, more than its files hold ({_human_bytes(held)}): it is damaged",
            hint="Export another checkpoint of the run.",
        )


def read_tensors(
    state: dict[str, torch.Tensor], checkpoint: Path, what: str, planner: Any = None
) -> None:
    """Reads the checkpoint's values into `state`'s tensors (DCP's flat keys: `model.0.weight`),
    in this process alone: a sharded tensor (a DTensor) reads only its own shard. `what` names
    the command or key that was given the checkpoint; `planner`: the strategy's (default DCP's,
    weights only)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    unreadable = (CheckpointException, OSError, EOFError, RuntimeError, pickle.UnpicklingError)
    planner = planner or weights_only_planner()
    with warnings.catch_warnings():
        # Said on every load without a process group, which is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # torch_xla 2.9's SPMD planner (`load.weights` under xla_fsdp), on its own old calls.
        warnings.filterwarnings("ignore", message="Using a non-tuple sequence")
        try:
            dcp.load(state, checkpoint_id=checkpoint, planner=planner, no_dist=True)
        except unreadable as exc:
            # A missing or truncated shard file: the input's fault, not a bug (--debug shows
            # the traceback underneath).
            raise UsageError(
                f"{what} {checkpoint}: cannot read the model's tensors ({_cause(exc)})"
            ) from exc


def _cause(exc: BaseException) -> str:
    """The first underlying error, in one line: DCP wraps each failure with its traceback."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def bare_key(key: str) -> str:
    """`model._orig_module.0.weight` -> `0.weight`: the key the recipe's own model has."""
    return without_wrappers(key.removeprefix(_MODEL), _WRAPPERS)


def write_state_dict(state: dict[str, torch.Tensor], out: Path) -> None:
    """Writes `state` to `out` (format by suffix) atomically: a crash leaves no half file
    under `out`, and an existing `out` is never replaced."""

    def write(partial: Path) -> None:
        if FORMATS[out.suffix] == "safetensors":
            from safetensors.torch import save_file

            save_file(_unshared(state), str(partial))
            # safetensors creates its file readable by its owner only; a model is shared like
            # any file the user writes (torch.save's files get the umask's mode).
            os.chmod(partial, 0o666 & ~_umask())
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


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def _human_bytes(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    size, unit = next((n / 10**p, u) for p, u in ((9, "GB"), (6, "MB"), (3, "kB")) if n >= 10**p)
    return f"{size:.1f} {unit}"
