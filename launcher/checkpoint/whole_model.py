"""A checkpoint's model, read whole in this one process: for `train export` (a file, or a
Hugging Face folder) and `load.weights`.

A checkpoint holds every rank's shards of the model, the optimizer and the precision state,
in torch.distributed.checkpoint's (DCP) format, whatever the strategy and world size. Only the
model's tensors are read, each one whole: DCP reassembles a tensor from the shards of every
rank that wrote it, with no process group. Keys are the bare model's `state_dict`'s.

A checkpoint does not say which of its names are one tensor (an LM head tied to its token
embedding is saved under both names), and the weights' average (`train.ema`) is saved under
one name of each (`named_parameters()` gives a tied weight once). So where it matters (`--ema`,
`--hf`) the recipe's model, built on the meta device from the spec the checkpoint records, says
which names are tied, and every name of a tied weight gets one tensor: with `--ema`, the
average.
"""

from __future__ import annotations

import math
import pickle
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launcher.checkpoint.catalog import checkpoint_in, run_of
from launcher.checkpoint.checksums import Unreadable
from launcher.checkpoint.format import read_metadata, weights_only_planner
from launcher.checkpoint.save_failure import first_cause
from launcher.checkpoint.store import Best, kind_for, store_of_run
from launcher.errors import UsageError
from launcher.parallel.wrapper_names import without_wrappers
from launcher.rundir.layout import CheckpointFiles
from launcher.rundir.reading import UnreadableJson

COMMAND = "train export"
# Reads of a run's newest checkpoint, each one removed by the run while it was read.
_ATTEMPTS = 5
_MODEL = "model."  # DCP's flattened keys of the state's "model" entry
_EMA = "ema."  # and of the weights' average (`train.ema`), by the bare model's names
# torch_xla's FSDPv2 (`xla_fsdp`) keeps the model as this attribute of its wrapper, so its
# checkpoints' keys read `model._orig_module.0.weight`; the bare model knows `0.weight`.
_WRAPPERS = ("_orig_module",)
# The model the checkpoint's run trained, as its recipe builds it (on the meta device where it
# can be), given the checkpoint: `launcher.cli.export` builds it, where the recipe may be
# imported.
RecipeModel = Callable[[Path], nn.Module]


@dataclass(frozen=True)
class ModelRead:
    """A checkpoint's model, read whole (`read_model`)."""

    checkpoint: Path
    best: Best | None
    tensors: dict[str, torch.Tensor]  # by the bare model's names; tied names share a tensor
    skipped: list[str]  # the model entries that are not tensors
    model: nn.Module | None  # the recipe's model, where it was asked which names are tied


def read_model(
    source: Path,
    *,
    best: bool = False,
    ema: bool = False,
    recipe_model: RecipeModel | None = None,
) -> ModelRead:
    """The model of the checkpoint SOURCE names (`resolve_source`); with `recipe_model`, every
    name of a tied weight holds one tensor, checked equal in the checkpoint."""
    for attempt in range(1, _ATTEMPTS + 1):
        checkpoint, chosen = resolve_source(source, best=best)
        try:
            model = recipe_model(checkpoint) if recipe_model is not None else None
            tied = tied_names(model) if model is not None else {}
            tensors, skipped = load_model_state(checkpoint, ema=ema, tied=tied)
            return ModelRead(checkpoint, chosen, tensors, skipped, model)
        except UsageError:
            # A running run that keeps few checkpoints may remove this one while it is read:
            # its newest one is read then (a checkpoint named itself is not replaced).
            if (
                attempt == _ATTEMPTS
                or checkpoint == source
                or CheckpointFiles(checkpoint).is_complete
            ):
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


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
            chosen = store_of_run(run).best()
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
    checkpoint: Path, ema: bool = False, tied: dict[str, set[str]] | None = None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's tensors, whole, keyed as the bare model's `state_dict`, and the model
    entries that are not tensors (left out: they would need unpickling). `tied`: {name: every
    name of the same tensor} (`tied_names`); each such group gets one tensor. With `ema`, each
    averaged parameter's average (`ema.<name>`) in place of its trained value, under each of
    its names; buffers and frozen parameters, which are not averaged, are the model's."""
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
    model = {key: tensor for key, tensor in state.items() if key.startswith(_MODEL)}
    bare = {bare_key(key): tensor for key, tensor in model.items()}
    if len(bare) != len(model):
        raise UsageError(f"{COMMAND} {checkpoint}: two model keys differ only by a wrapper")
    share_tied(bare, tied or {}, checkpoint)
    if ema:  # the averages replace the trained values of the same tensors
        for key, average in state.items():
            if key.startswith(_EMA):
                _put_average(bare, key.removeprefix(_EMA), average, tied or {})
    return bare, [key.removeprefix(_MODEL) for key in skipped]


def tied_names(model: nn.Module, wrappers: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """{a parameter's name: every name of the same tensor}, without `wrappers`' names, for the
    parameters that have several (`named_parameters()` gives each once, under its first name)."""
    names: dict[int, set[str]] = defaultdict(set)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].add(without_wrappers(name, wrappers))
    return {name: group for group in names.values() if len(group) > 1 for name in group}


def share_tied(state: dict[str, torch.Tensor], tied: dict[str, set[str]], checkpoint: Path) -> None:
    """The names of each tied weight that `state` holds get one tensor. The checkpoint saved a
    tied weight under each name, so they hold equal values; where they do not, the recipe no
    longer builds the model the run trained, and is not trusted."""
    for name, group in tied.items():
        first = min(group & state.keys(), default=name)
        if name == first or name not in state:
            continue
        if not torch.equal(state[name], state[first]):
            raise UsageError(
                f"{COMMAND} {checkpoint}: the recipe's model ties {name} to {first}, but the "
                "checkpoint holds different values under the two names",
                hint="The recipe or recipe.model changed since the run: restore them, or "
                "export without --ema and --hf.",
            )
        state[name] = state[first]


def _put_average(
    state: dict[str, torch.Tensor], name: str, average: torch.Tensor, tied: dict[str, set[str]]
) -> None:
    # The average is saved under the first name of a tied weight only (`named_parameters()`).
    for alias in tied.get(name, {name}):
        if alias in state:
            state[alias] = average


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
            f"{COMMAND} {checkpoint}: its .metadata claims {human_bytes(claimed)} of model "
            f"tensors, more than its files hold ({human_bytes(held)}): it is damaged",
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
    unreadable = (*unreadable, Unreadable)  # a store's file that it did not serve whole
    planner = planner or weights_only_planner()
    with warnings.catch_warnings():
        # Said on every load without a process group, which is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # torch_xla 2.9's SPMD planner (`load.weights` under xla_fsdp), on its own old calls.
        warnings.filterwarnings("ignore", message="Using a non-tuple sequence")
        try:
            source = kind_for(checkpoint).reader(checkpoint)  # None: DCP picks its own
            where = {"storage_reader": source} if source else {"checkpoint_id": checkpoint}
            dcp.load(state, planner=planner, no_dist=True, **where)
        except unreadable as exc:
            # A missing or truncated shard file: the input's fault, not a bug (--debug shows
            # the traceback underneath).
            raise UsageError(
                f"{what} {checkpoint}: cannot read the model's tensors ({first_cause(exc)})"
            ) from exc


def bare_key(key: str) -> str:
    """`model._orig_module.0.weight` -> `0.weight`: the key the recipe's own model has."""
    return without_wrappers(key.removeprefix(_MODEL), _WRAPPERS)


def human_bytes(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    size, unit = next((n / 10**p, u) for p, u in ((9, "GB"), (6, "MB"), (3, "kB")) if n >= 10**p)
    return f"{size:.1f} {unit}"
