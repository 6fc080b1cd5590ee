"""Which parameters the optimizer updates, and with which settings: `optim.groups`, or the
recipe's `param_groups(model)` or `param_groups(model, optim)` hook.

Names are those of `named_parameters()` of the model the recipe built: wrappers the launcher
adds are not part of them (`launcher.parallel.wrapper_names`), and fsdp's `fully_shard` keeps
every name. Frozen parameters
(`requires_grad=False`) never reach the optimizer, so they take no optimizer state either.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from launcher.config.optim import (
    GROUP_SELECTORS,
    REST_GROUP,
    OptimSection,
    bad_group_name,
    bad_values,
    optimizer_class,
    rejected_settings,
    unknown_options,
)
from launcher.errors import UsageError
from launcher.parallel.wrapper_names import bare_model, named_parameters
from launcher.worker.recipe import Recipe

BOTH_GROUPINGS = (
    "optim.groups: the recipe defines param_groups(model), which sets the groups itself; "
    "remove one of the two"
)


@dataclass(frozen=True)
class OptimSettings:
    """What a recipe's `param_groups(model, optim)` is told of the run's optimizer, as the
    spec and its overrides make it: a group's settings may be set relative to these
    (`{"lr": optim.lr * 0.1}`), so that `optim.lr=...` moves them too."""

    name: str  # optim.name
    lr: float  # optim.lr: the peak rate, which the schedule scales in every group alike
    weight_decay: float | None  # optim.kwargs' weight_decay, else the optimizer's default
    kwargs: Mapping[str, Any]  # optim.kwargs, read-only

    @classmethod
    def of(cls, optim: OptimSection) -> OptimSettings:
        default = inspect.signature(optimizer_class(optim.name)).parameters.get("weight_decay")
        own = default.default if default is not None else None
        decay = optim.kwargs.get("weight_decay", None if own is inspect.Parameter.empty else own)
        return cls(optim.name, optim.lr, decay, MappingProxyType(dict(optim.kwargs)))


@dataclass
class Group:
    """One parameter group: its parameters, and the settings it sets over the defaults."""

    label: str  # for the line rank 0 prints
    params: list[nn.Parameter] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    name: str = REST_GROUP  # its logged rate's: `lr/<name>`

    def as_torch(self) -> dict[str, Any]:
        return {"params": self.params, **self.options}

    def describe(self) -> str:
        count = sum(p.numel() for p in self.params)  # a DTensor counts its global size
        # lr=0.001125, not the float arithmetic's 0.0011250000000000001
        settings = ", ".join(
            f"{k}={float(f'{v:.6g}')}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.options.items()
        )
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

    def names(self) -> list[str]:
        """Each group's name, in the optimizer's order: its logged rate is `lr/<name>`."""
        return [g.name for g in self.groups]

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
        groups = _from_spec(optim.groups, bare_model(model), trainable, named)
    if not any(g.params for g in groups):
        raise UsageError(
            "recipe: the model has no trainable parameters (every one has requires_grad=False)"
        )
    kept = [g for g in groups if g.params]
    names = [g.name for g in kept]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:  # a name given and one by position (group2) may meet
        where = "recipe: param_groups()" if hook is not None else "optim.groups"
        raise UsageError(f"{where}: two groups are named {twice!r}; give each its own name")
    custom = hook is not None or bool(optim.groups)
    return Grouping(kept, total, sum(p.numel() for _, p in trainable), custom)


def _from_spec(
    specs: list[dict[str, Any]],
    model: nn.Module,
    trainable: list[tuple[str, nn.Parameter]],
    named: list[tuple[str, nn.Parameter]],
) -> list[Group]:
    """`optim.groups`: a group takes the parameters its `params` patterns match and every
    parameter of the modules of its `modules` classes; the first group to take one keeps it."""
    groups = [
        Group(
            _label(i, spec),
            options={k: v for k, v in spec.items() if k not in GROUP_SELECTORS},
            name=spec.get("name", f"group{i + 1}"),
        )
        for i, spec in enumerate(specs)
    ]
    members = [_of_modules(model, spec.get("modules", [])) for spec in specs]
    rest = Group("other parameters" if specs else "all")
    for name, param in trainable:
        chosen = zip(groups, specs, members, strict=True)
        matched = next(
            (g for g, s, m in chosen if _matches(name, s.get("params", [])) or id(param) in m),
            rest,
        )
        matched.params.append(param)
    for i, spec in enumerate(specs):
        _check_patterns(i, spec.get("params", []), named)
        _check_module_types(i, spec.get("modules", []), model, named)
    return [*groups, rest]


def _label(index: int, spec: dict[str, Any]) -> str:
    """`group 1 ['*.bias'] modules ['LayerNorm']`, with its name where it has one."""
    named = f" ({spec['name']})" if "name" in spec else ""
    patterns = f" {spec['params']}" if "params" in spec else ""
    modules = f" modules {spec['modules']}" if "modules" in spec else ""
    return f"group {index + 1}{named}{patterns}{modules}"


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _is_a(module: nn.Module, class_names: list[str]) -> bool:
    """Whether `module`'s class, or a class it derives from, has one of `class_names`: fsdp's
    `FSDPLayerNorm` is a `LayerNorm`, and so is a recipe's own subclass of it."""
    return any(cls.__name__ in class_names for cls in type(module).__mro__)


def _of_modules(model: nn.Module, class_names: list[str]) -> set[int]:
    """The ids of every parameter of the modules of `class_names`, their submodules' included."""
    return {
        id(param)
        for module in model.modules()
        if _is_a(module, class_names)
        for param in module.parameters()
    }


def _check_patterns(index: int, patterns: list[str], named: list[tuple[str, nn.Parameter]]) -> None:
    all_names = [n for n, _ in named]
    trainable_names = [n for n, p in named if p.requires_grad]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in all_names):
            raise _no_match(index, pattern, all_names)
        if not any(fnmatch.fnmatchcase(n, pattern) for n in trainable_names):
            frozen = [n for n in all_names if fnmatch.fnmatchcase(n, pattern)]
            raise _only_frozen(index, f"pattern {pattern!r}", frozen)


def _check_module_types(
    index: int, class_names: list[str], model: nn.Module, named: list[tuple[str, nn.Parameter]]
) -> None:
    """Each class name of a group's `modules` names a module of the model with trainable
    parameters."""
    by_id = {id(p): (n, p) for n, p in named}
    for class_name in class_names:
        found = [m for m in model.modules() if _is_a(m, [class_name])]
        if not found:
            raise _no_module(index, class_name, model)
        params = dict(by_id[id(p)] for m in found for p in m.parameters() if id(p) in by_id)
        if not params:
            raise UsageError(
                f"optim.groups: group {index + 1}'s module type {class_name!r} has no "
                f"parameters ({len(found)} module{'s' if len(found) != 1 else ''} of the model)",
                hint="Remove it from the group's `modules`.",
            )
        if not any(p.requires_grad for p in params.values()):
            raise _only_frozen(index, f"module type {class_name!r}", list(params))


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


def _no_module(index: int, class_name: str, model: nn.Module) -> UsageError:
    types = {cls.__name__ for m in model.modules() for cls in type(m).__mro__}
    names = sorted(types - {"Module", "object"})
    close = difflib.get_close_matches(class_name, names, n=5, cutoff=0.4)
    return UsageError(
        f"optim.groups: group {index + 1}'s module type {class_name!r} is the class of no "
        "module of the model",
        details=[("close names: " if close else "the model's module types: ") + ", ".join(
            close or names[:12]
        )],
        hint="`modules` takes class names, such as LayerNorm or Embedding, of the modules of "
        "the recipe's model (a subclass counts as its base class too).",
    )  # fmt: skip


def _only_frozen(index: int, what: str, frozen: list[str]) -> UsageError:
    shown = ", ".join(frozen[:5]) + (", ..." if len(frozen) > 5 else "")
    return UsageError(
        f"optim.groups: group {index + 1}'s {what} matches only frozen parameters "
        f"({shown}: requires_grad=False), which never reach the optimizer, so its settings "
        "would apply to nothing",
        hint="Remove it from the group, or unfreeze those parameters in build_model.",
    )


def _from_hook(
    hook: Callable[[nn.Module, OptimSettings], Any],
    model: nn.Module,
    trainable: list[tuple[str, nn.Parameter]],
    optim: OptimSection,
) -> list[Group]:
    """The recipe's `param_groups(model[, optim])`: a list of torch param-group dicts."""
    given = hook(model, OptimSettings.of(optim))
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
        options = {k: v for k, v in spec.items() if k not in ("params", "name")}
        problem = (
            (bad_group_name(spec["name"]) if "name" in spec else None)
            or unknown_options(optim.name, options)
            or bad_values(options)
            or rejected_settings(optim.name, optim.lr, {**optim.kwargs, **options})
        )
        if problem:
            raise UsageError(f"recipe: param_groups() group {i + 1}: {problem}")
        params = [p for p in _params_of(spec["params"]) if p.requires_grad]
        label = f"param_groups() group {i + 1}" + (f" ({spec['name']})" if "name" in spec else "")
        groups.append(Group(label, params, options, spec.get("name", f"group{i + 1}")))
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
