"""Weights-only loading (`load.weights`): a new run starts from the weights of a checkpoint, an
exported file or a Hugging Face folder, with a fresh optimizer and schedule, at step 0.

Names are matched without the attributes of wrappers (`launcher.parallel.wrapper_names`), on both
sides, so that a checkpoint of any strategy, an export, and a file saved from a DDP- or
compile-wrapped model load into any strategy's model. Rank 0 matches names and shapes and tells
every rank what to load; then
- from a checkpoint (DCP), each rank reads only what it holds (under fsdp, its shards), straight
  into its model, whatever strategy and world size saved it;
- from a file, the strategy loads it (`Strategy.load_whole_weights`): under ddp and fsdp, rank 0
  alone reads it and broadcasts each tensor, of which every rank keeps its part.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launcher.checkpoint.format import first_problems, read_metadata
from launcher.checkpoint.hub_layout import HubLayout, hub_layout
from launcher.checkpoint.weights_source import KEY, WeightsSource, find_weights, safetensors_shapes
from launcher.checkpoint.whole_model import read_tensors, tied_names
from launcher.config.load import LoadSection
from launcher.errors import UsageError
from launcher.parallel.base import Strategy
from launcher.parallel.wrapper_names import WRAPPER_ATTRIBUTES, bare_model, without_wrappers
from launcher.safe_text import clean
from launcher.storage_url import location

_MODEL = "model."  # a checkpoint's model entries (not `optim.`, nor `ema.`)


@dataclass(frozen=True)
class Match:
    """What rank 0 found, for every rank: which names to load, and which did not fit."""

    pairs: dict[str, str]  # {the source's name: the model's name}
    values: int  # elements loaded
    problems: list[str] = field(default_factory=list)  # shapes first, then missing, unexpected
    skipped: list[str] = field(default_factory=list)  # the source's entries that are not tensors
    error: tuple[str, str] | None = None  # (message, hint): the source could not be read


def load_weights(
    model: nn.Module, strategy: Strategy, load: LoadSection, resuming: bool = False
) -> None:
    """Collective: loads `load.weights` into `model`; rank 0 says what it loaded, from where.
    Names that do not fit are refused (a UsageError on every rank), or with `load.strict:
    false` left as the recipe initialised them and listed. Nothing without weights, or when
    `resuming`: a resumed run's weights are its checkpoint's."""
    if load.weights is None or resuming:
        return
    # DCP's modules take half a second to import: not on every run's way to step 1.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    source = find_weights(location(load.weights, what=KEY))
    own = get_model_state_dict(model)  # this rank's tensors: shards under fsdp
    match = strategy.control.from_main(
        _match_on_main(source, model, own) if strategy.is_main else None
    )
    _refuse_unfit(source, match, load.strict)
    if source.kind == "checkpoint":
        _load_checkpoint(model, strategy, source.path, match.pairs, own)
    else:
        layout = _hub_layout(source, model)
        strategy.load_whole_weights(model, lambda: _read_files(source, match.pairs, layout))
    if strategy.is_main:
        print(_loaded_line(source, match), flush=True)


def match_model(source: WeightsSource, model: nn.Module, strict: bool) -> Match:
    """`source` matched against the whole of `model` outside a run (`train validate`, on the
    meta device), refused as a run refuses it at its start."""
    match = _match_on_main(source, model, model.state_dict())
    _refuse_unfit(source, match, strict)
    return match


def _refuse_unfit(source: WeightsSource, match: Match, strict: bool) -> None:
    """The one rule: a source that cannot be read is refused, and one whose names do not fit
    the model unless `load.strict` is false."""
    if match.error is not None:
        raise UsageError(match.error[0], hint=match.error[1])
    if match.problems and strict:
        raise _refusal(source, match.problems)


def _match_on_main(source: WeightsSource, model: nn.Module, own: dict[str, Any]) -> Match:
    """Rank 0's match, or what kept it from reading the source (said on every rank)."""
    try:
        theirs, skipped = _source_shapes(source)
        layout = _hub_layout(source, model)
        if layout is not None:
            theirs = layout.shapes(theirs)
        ours = {name: tuple(t.shape) for name, t in own.items() if isinstance(t, torch.Tensor)}
        match = match_names(theirs, ours, tied_names(model, WRAPPER_ATTRIBUTES), _noun(source))
    except UsageError as exc:
        return Match({}, 0, error=(exc.message, exc.hint))
    return Match(match.pairs, match.values, match.problems, skipped)


def match_names(
    theirs: dict[str, tuple[int, ...]],
    ours: dict[str, tuple[int, ...]],
    tied: dict[str, set[str]] | None = None,
    noun: str = "weights",
) -> Match:
    """Pairs the source's names (`theirs`: {name: shape}) with the model's (`ours`), matched
    without wrappers. A model's name the source lacks is forgiven where a weight tied to it
    (`tied`: {bare name: the bare names of the same tensor}) is loaded: Hugging Face and
    safetensors keep one name of tied weights."""
    bare_theirs, bare_ours = _by_bare_name(theirs), _by_bare_name(ours)
    pairs, problems, values, loaded = {}, [], 0, set()
    for bare in sorted(bare_theirs.keys() & bare_ours.keys()):
        name, own = bare_theirs[bare], bare_ours[bare]
        if tuple(theirs[name]) != tuple(ours[own]):
            problems.append(f"shape of {bare}: {noun} {list(theirs[name])}, run {list(ours[own])}")
            continue
        pairs[name] = own
        values += math.prod(ours[own])
        loaded.add(bare)
    missing = [
        b
        for b in sorted(bare_ours.keys() - bare_theirs.keys())
        if not (tied or {}).get(b, set()) & loaded
    ]
    problems += [f"missing from the {noun}: {bare}" for bare in missing]
    problems += [
        f"not in the run: {bare}" for bare in sorted(bare_theirs.keys() - bare_ours.keys())
    ]
    return Match(pairs, values, problems)


def _by_bare_name(names: dict[str, Any]) -> dict[str, str]:
    """{name without wrappers: name}."""
    bare: dict[str, str] = {}
    for name in names:
        other = bare.setdefault(without_wrappers(name), name)
        if other != name:
            raise UsageError(
                f"{KEY}: {clean(other)} and {clean(name)} differ only by a wrapper's name"
            )
    return bare


def _source_shapes(source: WeightsSource) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """{name: shape} of the source's tensors (a checkpoint's model entries without their
    `model.`), and the names of its entries that are not tensors."""
    if source.kind == "checkpoint":
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = read_metadata(source.path, KEY).state_dict_metadata
        model = {k.removeprefix(_MODEL): md for k, md in saved.items() if k.startswith(_MODEL)}
        shapes = {
            k: tuple(md.size) for k, md in model.items() if isinstance(md, TensorStorageMetadata)
        }
        return shapes, sorted(model.keys() - shapes.keys())
    if source.kind == "torch":
        state = _torch_load(source.files[0])
        shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        return shapes, sorted(str(k) for k in state.keys() - shapes.keys())
    shapes = {}
    for file in source.files:
        shapes.update({k: tuple(v) for k, v in safetensors_shapes(file).items()})
    return shapes, []


def _torch_load(path: Path) -> dict[str, Any]:
    """A `torch.save`d state dict, never unpickling code; memory-mapped where it can be."""
    try:
        state = torch.load(
            path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
        )
    except Exception as exc:  # torch raises a different type for each way a file is broken
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{KEY} {path}: cannot read it ({clean(reason)})") from exc
    tensors = isinstance(state, dict) and any(isinstance(v, torch.Tensor) for v in state.values())
    if not tensors:
        found = (
            f"a {type(state).__name__}"
            if not isinstance(state, dict)
            else f"keys {', '.join(map(str, list(state)[:5]))}"
        )
        raise UsageError(
            f"{KEY} {path}: not a state dict of tensors ({clean(found)})",
            hint="Save the model's weights alone: torch.save(model.state_dict(), path), or "
            "train export a run's checkpoint.",
        )
    return state


def _load_checkpoint(
    model: nn.Module, strategy: Strategy, path: Path, pairs: dict[str, str], own: dict[str, Any]
) -> None:
    """Each rank reads what it holds of the checkpoint's tensors into its own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {_MODEL + name: own[target] for name, target in pairs.items()}
    read_tensors(state, path, KEY, strategy.planners().load)
    loaded = {target: state[_MODEL + name] for name, target in pairs.items()}
    # DCP filled the tensors in place; where they are copies of the model's (XLA), this
    # puts them in the model.
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))


def _read_files(
    source: WeightsSource, pairs: dict[str, str], layout: HubLayout | None = None
) -> dict[str, torch.Tensor]:
    """The files' tensors that are loaded, named as the model names them; a Hugging Face
    model's converted from the Hub's layout (`layout`) first, every tensor of the files."""
    if source.kind == "torch":
        state = _torch_load(source.files[0])
        return {pairs[name]: tensor for name, tensor in state.items() if name in pairs}
    from safetensors import safe_open

    read: dict[str, torch.Tensor] = {}
    for file in source.files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys() if layout is not None else set(f.keys()) & pairs.keys():
                read[name] = f.get_tensor(name)
    converted = layout.convert(read) if layout is not None else read
    return {pairs[name]: tensor for name, tensor in converted.items() if name in pairs}


def _hub_layout(source: WeightsSource, model: nn.Module) -> HubLayout | None:
    """How a Hugging Face model's safetensors files (a `save_pretrained` folder, the Hub's)
    name and shape its weights, where that differs from the model's own (`hub_layout`)."""
    return hub_layout(bare_model(model)) if source.kind == "safetensors" else None


def _noun(source: WeightsSource) -> str:
    return "checkpoint" if source.kind == "checkpoint" else "weights"


def _refusal(source: WeightsSource, problems: list[str]) -> UsageError:
    n = len(problems)
    return UsageError(
        f"{KEY} {source.describe()}: these weights do not fit the model ({n} mismatched "
        f"name{'s' if n > 1 else ''}):",
        details=first_problems(problems),
        hint="Load weights of the same recipe and recipe.model, or set load.strict: false to "
        "load the names that fit (the others keep the recipe's initialisation).",
    )


def _loaded_line(source: WeightsSource, match: Match) -> str:
    lines = [
        f"{KEY}: loaded {len(match.pairs)} tensors ({match.values:,} values) from "
        f"{source.describe()}; step 0, a fresh optimizer and schedule"
    ]
    if match.skipped:
        skipped = clean(", ".join(match.skipped))
        lines.append(f"{KEY}: skipped {len(match.skipped)} entries that are not tensors: {skipped}")
    if match.problems:
        lines.append(
            f"{KEY}: load.strict: false: {len(match.problems)} names did not fit; the model "
            "keeps the recipe's initialisation for them:"
        )
        lines += [f"  {problem}" for problem in first_problems(match.problems)]
    return "\n".join(lines)
