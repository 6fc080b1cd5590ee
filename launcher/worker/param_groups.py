"""Which parameters the optimizer updates, and with which settings: `optim.groups`, or the
recipe's `param_groups(model)` hook.

Names are those of `named_parameters()` of the model the recipe built: wrappers the launcher
adds are not part of them (`launcher.parallel.wrapper_names`), and fsdp's `fully_shard` keeps
every name. Frozen parameters
(`requires_grad=False`) never reach the optimizer, so they take no optimizer state either.
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from launcher.config.optim import OptimSection, bad_values, rejected_settings, unknown_options
from launcher.errors import UsageError
from launcher.parallel.wrapper_names import bare_model, named_parameters
from launcher.worker.recipe import Recipe

BOTH_GROUPINGS = (
    "optim.groups: the recipe defines param_groups(model), which sets the groups itself; "
    "remove one of the two"
)


@dataclass
class Group:
    """One parameter group: its parameters, and the settings it sets over the defaults."""

    label: str  # for the line rank 0 prints
    params: list[nn.Parameter] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def as_torch(self) -> dict[str, Any]:
        return {"params": self.params, **self.options}

    def describe(self) -> str:
        count = sum(p.numel() for p in self.params)  # a DTensor counts its global size
        settings = ", ".join(f"{k}={v}" for k, v in self.options.items())
        tensors = f"{len(self.params)} tensor{'s' if len(self.params) != 1 else ''}"
        return f"{self.label}: {tensors}, {count:,} parameters" + (
            f", {settings}" if settings else ""
        )


@dataclass
class Grouping:
    groups: list[Group]
    total: int  # parameters of the model, frozen included
    trainable: int
    custom: bool  # grouped by `optim.groups` or the recipe, not one group of everything

    def torch_groups(self) -> list[dict[str, Any]]:
        return [g.as_torch() for g in self.groups]

    def count(self) -> str:
        """`1,234 parameters`, or `1,234 parameters (1,000 trainable)` where some are frozen."""
        frozen = self.trainable != self.total
        return f"{self.total:,} parameters" + (f" ({self.trainable:,} trainable)" if frozen else "")

    def lines(self) -> list[str]:
        """A line per group, where the spec or the recipe groups the parameters."""
        return [f"optim {g.describe()}" for g in self.groups] if self.custom else []


def group_parameters(optim: OptimSection, model: nn.Module, recipe: Recipe | None) -> Grouping:
    """The optimizer's groups for `model`: the recipe's hook's, `optim.groups`' (first match
    wins, the rest keep the defaults), or one group of every trainable parameter."""
    named = list(named_parameters(model))
    total = sum(p.numel() for _, p in named)
    trainable = [(n, p) for n, p in named if p.requires_grad]
    hook = recipe.param_groups_hook() if recipe is not None else None
    if hook is not None:
        if optim.groups:
            raise UsageError(BOTH_GROUPINGS)
        groups = _from_hook(hook, bare_model(model), trainable, optim)
    else:
        groups = _from_patterns(optim.groups, trainable, [n for n, _ in named])
    if not any(g.params for g in groups):
        raise UsageError(
            "recipe: the model has no trainable parameters (every one has requires_grad=False)"
        )
    kept = [g for g in groups if g.params]
    custom = hook is not None or bool(optim.groups)
    return Grouping(kept, total, sum(p.numel() for _, p in trainable), custom)


def _from_patterns(
    specs: list[dict[str, Any]], trainable: list[tuple[str, nn.Parameter]], all_names: list[str]
) -> list[Group]:
    groups = [
        Group(
            f"group {i + 1} {spec['params']}",
            options={k: v for k, v in spec.items() if k != "params"},
        )
        for i, spec in enumerate(specs)
    ]
    rest = Group("other parameters" if specs else "all")
    for name, param in trainable:
        matched = next(
            (g for g, s in zip(groups, specs, strict=True) if _matches(name, s["params"])), rest
        )
        matched.params.append(param)
    trainable_names = [name for name, _ in trainable]
    for i, spec in enumerate(specs):
        for pattern in spec["params"]:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in all_names):
                raise _no_match(i, pattern, all_names)
            if not any(fnmatch.fnmatchcase(n, pattern) for n in trainable_names):
                raise _only_frozen(i, pattern, all_names)
    return [*groups, rest]


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _no_match(index: int, pattern: str, names: list[str]) -> UsageError:
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.4)
    shown = close or names[:5]
    return UsageError(
        f"optim.groups: group {index + 1}'s pattern {pattern!r} matches no parameter of the "
        f"model ({len(names)} parameters)",
        details=[("close names: " if close else "some names: ") + ", ".join(shown)],
        hint="Patterns are globs over the names of the recipe's model.named_parameters(), "
        "e.g. '*.bias', 'head.*'.",
    )


def _only_frozen(index: int, pattern: str, names: list[str]) -> UsageError:
    frozen = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    shown = ", ".join(frozen[:5]) + (", ..." if len(frozen) > 5 else "")
    return UsageError(
        f"optim.groups: group {index + 1}'s pattern {pattern!r} matches only frozen parameters "
        f"({shown}: requires_grad=False), which never reach the optimizer, so its settings "
        "would apply to nothing",
        hint="Remove the pattern, or unfreeze those parameters in build_model.",
    )


def _from_hook(
    hook: Any, model: nn.Module, trainable: list[tuple[str, nn.Parameter]], optim: OptimSection
) -> list[Group]:
    """The recipe's `param_groups(model)`: a list of torch param-group dicts."""
    given = hook(model)
    if not isinstance(given, list | tuple) or not all(
        isinstance(g, dict) and "params" in g for g in given
    ):
        raise UsageError(
            "recipe: param_groups(model) must return a list of dicts, each with 'params' "
            "(the parameters) and the optimizer settings of that group"
        )
    ours = {id(p): n for n, p in trainable}
    groups = []
    for i, spec in enumerate(given):
        options = {k: v for k, v in spec.items() if k != "params"}
        problem = (
            unknown_options(optim.name, options)
            or bad_values(options)
            or rejected_settings(optim.name, optim.lr, {**optim.kwargs, **options})
        )
        if problem:
            raise UsageError(f"recipe: param_groups() group {i + 1}: {problem}")
        params = [p for p in _params_of(spec["params"]) if p.requires_grad]
        groups.append(Group(f"param_groups() group {i + 1}", params, options))
    _check_hook_coverage(groups, ours)
    return groups


def _params_of(given: Any) -> list[nn.Parameter]:
    if isinstance(given, torch.Tensor):
        return [given]  # type: ignore[list-item]
    return [p[1] if isinstance(p, tuple) else p for p in given]  # also named_parameters()


def _check_hook_coverage(groups: list[Group], ours: dict[int, str]) -> None:
    seen: set[int] = set()
    for group in groups:
        for param in group.params:
            if id(param) not in ours:
                raise UsageError(
                    f"recipe: param_groups() {group.label} holds a tensor that is not a "
                    "parameter of the model it was given (build the groups from "
                    "model.named_parameters() of that model)"
                )
            if id(param) in seen:
                raise UsageError(
                    f"recipe: param_groups(): {ours[id(param)]} is in more than one group"
                )
            seen.add(id(param))
    left = [name for key, name in ours.items() if key not in seen]
    if left:
        raise UsageError(
            f"recipe: param_groups() leaves {len(left)} trainable parameters in no group "
            f"({', '.join(left[:5])}{', ...' if len(left) > 5 else ''})",
            hint="Put them in a group, or freeze them (requires_grad=False) in build_model.",
        )
