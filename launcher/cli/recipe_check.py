"""Checking a recipe in the `train` process, before any worker starts.

`check_arguments` matches `recipe.model` and `recipe.dataset` against the signatures of
`build_model` and `build_dataset` without calling them: every launch runs it. `dry_build`
(`train validate`) calls them as a worker would: the datasets, one batch, and the model on
the meta device, so a run fails here in seconds rather than in every rank later.

This module sits with the workers' code because it calls it (the recipe, the loader); like
`export.py`, it runs in the launcher's process only.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from launcher.config.spec import RecipeSection, RunSpec
from launcher.errors import UsageError
from launcher.worker.data import (
    batch_size,
    build_loader,
    check_stream_limits,
    dataset_length,
    is_stream,
    steps_per_epoch,
)
from launcher.worker.evaluation import stream_eval_batches
from launcher.worker.recipe import Recipe, load_recipe, users_traceback

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def load_checked(spec: RunSpec, origin: str = "") -> Recipe:
    """The recipe, imported as the workers will, with its arguments checked (nothing built).
    `origin`: where recipe.source came from (`launcher.config.sources`), for its errors."""
    recipe = load_recipe(spec.recipe.source, origin)
    check_arguments(recipe, spec.recipe)
    return recipe


def check_arguments(recipe: Recipe, section: RecipeSection) -> None:
    """Raises `UsageError` listing every key of `recipe.model` / `recipe.dataset` that
    `build_model(**model)` / `build_dataset(split, **dataset)` cannot take."""
    module = recipe.module
    problems = [
        *_binding_problems("recipe.model", "build_model", module.build_model, 0, section.model),
        *_binding_problems(
            "recipe.dataset", "build_dataset", module.build_dataset, 1, section.dataset
        ),
    ]
    if problems:
        noun = "problem" if len(problems) == 1 else "problems"
        raise UsageError(
            f"{len(problems)} {noun} in the arguments for {Path(recipe.source).name}:",
            details=problems,
            hint="recipe.model is passed as build_model(**model), recipe.dataset as "
            "build_dataset(split, **dataset).",
        )


def _binding_problems(
    key: str, name: str, fn: Callable[..., Any], n_positional: int, kwargs: dict[str, Any]
) -> list[str]:
    """What is wrong with calling `fn(<n_positional values>, **kwargs)`, one line per key."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # a callable Python cannot inspect (one written in C): the call will tell
    try:
        signature.bind(*range(n_positional), **kwargs)
        return []
    except TypeError as exc:
        failure = str(exc)
    params = list(signature.parameters.values())
    taken = [p.name for p in params if p.kind in _POSITIONAL][:n_positional]
    valid = [p.name for p in params if p.kind in _KEYWORD and p.name not in taken]
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    problems = [
        f"{key}.{k}: {name}() gets this argument from the launcher (the split); remove the key"
        for k in kwargs
        if k in taken
    ]
    if len(taken) < n_positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
        problems.append(f"{key}: {name}() must take the split ('train' or 'val') first")
    if not takes_any:
        problems += [_unknown(key, k, name, valid) for k in kwargs if k not in [*valid, *taken]]
    problems += [
        f"{key}.{p.name}: required by {name}(), but missing"
        for p in params
        if p.name in valid and p.default is inspect.Parameter.empty and p.name not in kwargs
    ]
    return problems or [f"{key}: {name}() cannot be called this way: {failure}"]


def _unknown(key: str, given: str, name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(given, valid, n=1)
    suggestion = f"; did you mean '{key}.{close[0]}'?" if close else ""
    accepted = f"valid here: {', '.join(valid)}" if valid else f"{name}() takes no keywords"
    return f"{key}.{given}: unknown key of {name}(){suggestion} ({accepted})"


def dry_build(spec: RunSpec, origin: str = "") -> str:
    """Builds what a worker builds, without training: the train split and one batch of it,
    the val split when the run evaluates, and the model on the meta device. Returns a summary
    (parameters, samples); raises `UsageError` for what the run would fail on."""
    recipe = load_checked(spec, origin)
    parts = [_model_summary(recipe, spec.recipe.model), _train_summary(recipe, spec)]
    if spec.eval.every_n_steps is not None:
        parts.append(_val_summary(recipe, spec))
    return " · ".join(parts)


def _model_summary(recipe: Recipe, kwargs: dict[str, Any]) -> str:
    try:
        with torch.device("meta"):  # no memory for the weights, however large the model
            model = recipe.build_model(**kwargs)
        where = ""
    except UsageError:
        raise
    except Exception as exc:
        # Some models cannot be built on the meta device (a .item() in __init__); the real
        # build tells whether the run would fail, as ddp builds for real.
        model = _user_call("recipe: build_model()", recipe.build_model, **kwargs)
        where = f" (built on the CPU: on the meta device it raised {type(exc).__name__})"
    count = sum(p.numel() for p in model.parameters())
    return f"model {type(model).__name__} {_count(count)} parameters{where}"


def _train_summary(recipe: Recipe, spec: RunSpec) -> str:
    what = "recipe: build_dataset('train')"
    dataset = _user_call(what, recipe.build_dataset, "train", **spec.recipe.dataset)
    if is_stream(dataset):
        check_stream_limits(spec.train)
        # A stream has no sampler: the workers read it in order, as this does.
        loader = DataLoader(dataset, batch_size=spec.data.batch_size)
        _check_batch(loader, what)
        return f"train stream (no length; train.max_steps={spec.train.max_steps})"
    devices = spec.launch.devices if isinstance(spec.launch.devices, int) else 1
    # The workers' own loader, as rank 0 of `devices` sees it; worker processes would only
    # make this slower.
    data = spec.data.model_copy(update={"num_workers": 0})
    loader = build_loader(dataset, data, 0, devices, spec.run.seed, pin_memory=False)
    _check_batch(loader, what)
    steps = steps_per_epoch(len(loader), spec.train.grad_accum_steps)
    batch = f"{devices} device{'s' if devices > 1 else ''} x {spec.data.batch_size}"
    if spec.train.grad_accum_steps > 1:
        batch += f" x {spec.train.grad_accum_steps} micro-steps"
    return f"train {dataset_length(dataset, 'train'):,} samples ({steps:,} steps/epoch at {batch})"


def _val_summary(recipe: Recipe, spec: RunSpec) -> str:
    what = "recipe: build_dataset('val')"
    dataset = _user_call(what, recipe.build_dataset, "val", **spec.recipe.dataset)
    if is_stream(dataset):
        summary = f"val stream ({stream_eval_batches(spec.eval.max_batches)} batches)"
    else:
        summary = f"val {dataset_length(dataset, 'val'):,} samples"
    _check_batch(DataLoader(dataset, batch_size=spec.data.batch_size), what)
    return summary


def _check_batch(loader: Iterable[Any], what: str) -> None:
    """One batch, collated as training collates it, must hold a tensor."""
    batch = _user_call(f"{what}: its first batch", lambda: next(iter(loader), None))
    if batch is None:
        raise UsageError(f"{what} gave no samples")
    batch_size(batch)


def _user_call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(...)`; a failure of the user's code becomes a UsageError with their frames only."""
    try:
        return fn(*args, **kwargs)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{what} failed:", details=[users_traceback(exc)]) from None


def _count(n: int) -> str:
    if n < 100_000:
        return f"{n:,}"
    return f"{n / 1e6:.2f}M" if n < 1_000_000_000 else f"{n / 1e9:.2f}B"
