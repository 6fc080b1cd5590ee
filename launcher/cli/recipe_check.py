"""Checking a recipe in the `train` process, before any worker starts: `load_checked` imports
it as the workers will and matches `recipe.model` and `recipe.dataset` against the signatures
of `build_model` and `build_dataset` without calling them. Every launch runs it, so it imports
only what that needs; what `train validate` builds besides is `dry_build.py`'s (issue 41).

This module sits with the workers' code because it calls it (the recipe); like `export.py`, it
runs in the launcher's process only.
"""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.config.spec import RecipeSection, RunSpec
from launcher.errors import UsageError
from launcher.worker.param_groups import BOTH_GROUPINGS
from launcher.worker.recipe import Recipe, load_recipe

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def load_checked(spec: RunSpec, origin: str = "") -> Recipe:
    """The recipe, imported as the workers will, with its arguments checked (nothing built).
    `origin`: where recipe.source came from (`launcher.config.sources`), for its errors."""
    recipe = load_recipe(spec.recipe.source, origin, float8=spec.train.float8)
    check_arguments(recipe, spec.recipe)
    recipe.collate_hook()  # the hooks' signatures, refused as the workers would refuse them
    if recipe.param_groups_hook() is not None and spec.optim.groups:
        raise UsageError(BOTH_GROUPINGS)
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


def check_recipe(spec: RunSpec, sources: dict[str, str]) -> tuple[str, ...]:
    """Imports the recipe as the workers will (from the working directory) and checks that it
    defines what the launcher calls, with arguments its functions take; builds nothing.
    `sources`: where each key came from, so that a missing file's error says what its path
    was relative to. Returns the installed libraries' modules that importing it imported
    (`installed_modules`), which the workers' fork server imports once for them all."""
    from launcher.launch.reaper import children_reaped

    before = set(sys.modules)
    with children_reaped():  # a process the recipe starts as it is imported ends here
        recipe = load_checked(spec, sources.get("recipe.source", ""))
        if spec.parallel.pp > 1 and spec.launch.strategy == "fsdp":
            from launcher.cli.pipeline_check import pipeline_fits

            pipeline_fits(spec, recipe)  # the stages, on the meta device, before any start
    return installed_modules(set(sys.modules) - before)


def installed_modules(names: set[str]) -> tuple[str, ...]:
    """Of the modules `names`, those of installed libraries (in a site-packages folder: a
    transformers model's modules, not the recipe's own files nor the launcher's), in the
    order they were imported."""
    installed = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name in names and not name.startswith("__") and _in_site_packages(path):
            installed.append(name)
    return tuple(installed)


def _in_site_packages(path: str) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in Path(path).parts)
