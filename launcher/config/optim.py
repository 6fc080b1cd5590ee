"""The `optim` section: it needs torch to check optimizer names and their keyword arguments.

torch is imported only by those checks, and they are skipped when validation runs with
`TORCH_FREE` as its context: the CLI answers `--help` and reports a spec's other mistakes in a
fraction of a second, before anything imports torch (seconds).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from launcher.config.section import Section

if TYPE_CHECKING:
    import torch

Schedule = Literal["constant", "cosine", "linear", "wsd"]

# `RunSpec.model_validate(raw, context=TORCH_FREE)`: every check except those that need torch.
TORCH_FREE = {"torch_free": True}

# What `wsd` decays over when `optim.decay_steps` is unset: the last 20% of the run, as in
# the warmup-stable-decay papers (MiniCPM, DeepSeek) and torchtitan's default.
WSD_DECAY_FRACTION = 0.2


def skip_torch_checks(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("torch_free"))


def _optimizer_names() -> list[str]:
    import torch

    return sorted(
        n
        for n, c in vars(torch.optim).items()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    )


def find_optimizer(name: str) -> type[torch.optim.Optimizer] | str:
    """The class `name` names (a `torch.optim` name, or a dotted path such as
    `torchao.optim.AdamW8bit`), or why there is none."""
    import torch

    if "." in name:
        if not all(part.isidentifier() for part in name.split(".")):
            return (
                f"expected a torch.optim optimizer or a dotted path to one (such as "
                f"torchao.optim.AdamW8bit), got {name!r}"
            )
        module_name, _, attr = name.rpartition(".")
        # As for a recipe's module: workers run with `python -m`, which puts the working
        # directory on sys.path; the `train` console script must find what they will.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            cls = getattr(importlib.import_module(module_name), attr, None)
        except ImportError as exc:
            return f"cannot import {module_name} ({exc}); install it, or fix the path"
        except Exception as exc:  # the module's own code failed as it was imported
            return f"cannot import {module_name}: it raised {type(exc).__name__}: {exc}"
        if cls is None:
            return f"{module_name} has no {attr}"
    else:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            known = ", ".join(_optimizer_names())
            return (
                f"expected a torch.optim optimizer ({known}) or a dotted path to one, got {name!r}"
            )
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return f"{name} is not a torch.optim.Optimizer subclass"
    if cls is torch.optim.Optimizer:
        return "torch.optim.Optimizer is the base class; name an optimizer"
    return cls


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    cls = find_optimizer(name)
    assert not isinstance(cls, str), cls  # the spec validated it
    return cls


def accepted_options(cls: type[torch.optim.Optimizer]) -> list[str]:
    """The keyword arguments an optimizer takes besides its parameters."""
    return [p for p in inspect.signature(cls).parameters if p != "params"]


class OptimSection(Section):
    name: str = Field(
        "AdamW",
        description="The optimizer: a class of `torch.optim` by name (`SGD`, `AdamW`, …), or "
        "any `torch.optim.Optimizer` subclass by its dotted path "
        "(`torchao.optim.AdamW8bit`): installed, or a module in the working directory.",
    )
    lr: float = Field(
        1e-3,
        ge=0,
        allow_inf_nan=False,
        description="Peak learning rate (0 leaves the weights as they are).",
    )
    kwargs: dict[str, Any] = Field(
        {}, description="Other keyword arguments of the optimizer, e.g. `{weight_decay: 0.1}`."
    )
    groups: list[dict[str, Any]] = Field(
        [],
        description="Parameter groups with settings of their own, e.g. `[{params: ['*.bias'], "
        "modules: [LayerNorm, Embedding], weight_decay: 0.0}, {name: head, params: ['head.*'], "
        "lr: 1.0e-3}]`. `params` matches the names of `named_parameters()` of the model the "
        "recipe builds, by glob; `modules` takes every parameter of a module (its submodules' "
        "included) whose class, or a class it derives from, has one of these names; a group "
        "takes what either selects. A parameter joins the first group that selects it, and the "
        "others keep `lr` and `kwargs`. `name` (letters, digits, `_`, `.`, `-`) names the group "
        "in the start line and its logged rate (`lr/<name>`; default `group<N>`, the rest "
        "`other`). The other keys are optimizer arguments (`lr` included), and the schedule "
        "scales each group's `lr`. Frozen parameters (`requires_grad=False`) never reach the "
        "optimizer. A recipe's `param_groups(model)` replaces this key.",
    )
    fused: bool = Field(
        True,
        description="On CUDA, the optimizer's fused implementation (one kernel for all "
        "parameters) where it has one (`AdamW`, `Adam`, `SGD`, ...) and `kwargs` sets neither "
        "`fused` nor `foreach`; `false`: torch's default.",
    )
    schedule: Schedule = Field(
        "constant",
        description="`constant`; `cosine` or `linear` decay to `min_lr_ratio * lr` over the "
        "steps after warmup; or `wsd` (warmup-stable-decay): `lr` until the last "
        "`decay_steps`, then a linear decay to `min_lr_ratio * lr`.",
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup from 0 to `lr` over this many steps."
    )
    decay_steps: int | float | None = Field(
        None,
        gt=0,
        description="`wsd` only: the steps of its decay, or, below 1, a fraction of the run's "
        f"steps. Default: {WSD_DECAY_FRACTION}.",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Final learning rate of `cosine`, `linear` and `wsd`, as a fraction of `lr`.",
    )

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, name: str, info: ValidationInfo) -> str:
        if not skip_torch_checks(info):
            found = find_optimizer(name)
            if isinstance(found, str):
                raise ValueError(found)
        return name

    @field_validator("kwargs")
    @classmethod
    def _kwargs_fit(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        _check_values(kwargs, "")
        if kwargs and not skip_torch_checks(info):
            _check_options(info.data.get("name", ""), kwargs, "", allow_lr=False)
            _check_accepted(info.data.get("name", ""), info.data.get("lr", 1e-3), kwargs, "")
        return kwargs

    @field_validator("groups")
    @classmethod
    def _groups_fit(cls, groups: list[dict[str, Any]], info: ValidationInfo) -> list[dict]:
        for i, group in enumerate(groups):
            where = f"group {i + 1}: "
            _check_selectors(group, where)
            options = {k: v for k, v in group.items() if k not in GROUP_SELECTORS}
            _check_values(options, where)
            if not skip_torch_checks(info):
                name = info.data.get("name", "")
                _check_options(name, options, where, allow_lr=True)
                if "kwargs" in info.data:  # kwargs the optimizer refuses are refused on their own
                    settings = {**info.data["kwargs"], **options}
                    _check_accepted(name, info.data.get("lr", 1e-3), settings, where)
        names = [g["name"] for g in groups if "name" in g]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"two groups are named {repeated[0]!r}; give each its own name")
        return [
            {**g, **{k: [g[k]] for k in ("params", "modules") if isinstance(g.get(k), str)}}
            for g in groups
        ]

    @model_validator(mode="after")
    def _decay_steps_for_wsd(self) -> OptimSection:
        if self.decay_steps is not None and self.schedule != "wsd":
            raise ValueError(
                f"decay_steps: only `schedule: wsd` has a decay of its own length (the "
                f"schedule is {self.schedule!r}); remove it"
            )
        if isinstance(self.decay_steps, float) and self.decay_steps >= 1:
            raise ValueError(
                f"decay_steps: a number of steps is a whole number, a fraction is below 1; "
                f"got {self.decay_steps}"
            )
        return self


# The keys of a group of `optim.groups` that choose its parameters or name it: the others are
# optimizer settings.
GROUP_SELECTORS = ("params", "modules", "name")
# What the rest of the parameters, in no group of `optim.groups`, are named (`lr/other`).
REST_GROUP = "other"


def _check_selectors(group: dict[str, Any], where: str) -> None:
    """`params` (name patterns) and `modules` (class names): one of them, each a name or a
    list of names; `name`, if given, a name a metric can carry."""
    chosen = {key: group.get(key) for key in ("params", "modules") if key in group}
    listed = {k: [v] if isinstance(v, str) else v for k, v in chosen.items()}
    if not chosen or not all(
        isinstance(v, list) and v and all(isinstance(n, str) and n for n in v)
        for v in listed.values()
    ):
        raise ValueError(
            f"{where}expected `params:` with one or more name patterns, or `modules:` with one "
            "or more module class names, e.g. {params: ['*.bias'], modules: [LayerNorm], "
            "weight_decay: 0.0}"
        )
    problem = bad_group_name(group["name"]) if "name" in group else None
    if problem:
        raise ValueError(f"{where}{problem}")


def bad_group_name(name: Any) -> str | None:
    """What is wrong with `name` as a parameter group's name, or None: it names the group's
    logged rate (`lr/<name>`), which every metrics sink must take."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        return f"name: expected letters, digits, '_', '.' or '-' (at most 64), got {name!r}"
    if name == REST_GROUP:
        return f"name: {REST_GROUP!r} names the parameters in no group; choose another"
    return None


# Settings that must not be negative, in `optim.kwargs` and each of `optim.groups`, as `optim.lr`
# must not: a negative rate climbs the loss, a negative decay grows the weights.
NON_NEGATIVE = ("lr", "weight_decay")
# Settings whose validity depends on the device the run has, not on a CPU stand-in.
_DEVICE_CHOICES = ("fused", "foreach", "capturable")


def _check_values(options: dict[str, Any], where: str) -> None:
    """Numbers the optimizer could not use: NaN and infinity anywhere, negative rates."""
    problem = bad_values(options)
    if problem:
        raise ValueError(f"{where}{problem}")


def bad_values(options: dict[str, Any]) -> str | None:
    """What is wrong with the values of optimizer settings `options` (a NaN or infinity, at
    any depth, or a negative `lr` or `weight_decay`), by key; None where nothing is."""
    for key, value in options.items():
        found = _non_finite(value)
        if found is not None:
            return f"{key}: {found} is not a number an optimizer can use; give a finite one"
        if key in NON_NEGATIVE and isinstance(value, int | float) and value < 0:
            return f"{key}: must be 0 or more, got {value}"
    return None


def _non_finite(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list | tuple):
        inner = (_non_finite(item) for item in value)
        return next((found for found in inner if found is not None), None)
    if isinstance(value, dict):
        return _non_finite(list(value.values()))
    return None


def _check_accepted(name: str, lr: float, settings: dict[str, Any], where: str) -> None:
    problem = rejected_settings(name, lr, settings)
    if problem:
        raise ValueError(f"{where}{problem}")


def rejected_settings(name: str, lr: float, settings: dict[str, Any]) -> str | None:
    """Why the optimizer `name` refuses `settings` with the rate `lr` (its constructor's own
    checks of its arguments, such as Adam's betas below 1, run over one stand-in parameter),
    or None. What only a device can tell (`fused`) is left to the run."""
    import torch

    optimizer = find_optimizer(name)
    if isinstance(optimizer, str):
        return None
    kept = {k: v for k, v in settings.items() if k not in _DEVICE_CHOICES}
    stand_in = torch.zeros(1, requires_grad=True)
    # torch's own add_param_group, without its dynamo guard: the guard's first call imports
    # torch._dynamo, 0.4 s and 60 MiB of the `train` process's start (issue 41). The
    # instance's own method, found before its class's, for the constructor to call.
    plain = getattr(optimizer.add_param_group, "__wrapped__", None)
    checked = optimizer.__new__(optimizer)
    if plain is not None:
        vars(checked)["add_param_group"] = plain.__get__(checked)
    try:
        optimizer.__init__(checked, [stand_in], **{"lr": lr, **kept})
    except (ValueError, TypeError) as exc:
        return f"{optimizer.__name__} refuses {_settings_text(kept)}: {exc}"
    return None


def _settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in settings.items()) or "its defaults"


def _check_options(name: str, options: dict[str, Any], where: str, allow_lr: bool) -> None:
    problem = unknown_options(name, options, allow_lr)
    if problem:
        raise ValueError(f"{where}{problem}")


def unknown_options(name: str, options: dict[str, Any], allow_lr: bool = True) -> str | None:
    """What is wrong with `options` for the optimizer `name` (keys it does not take), or None;
    also None for a name that names no optimizer (its own error says so)."""
    optimizer = find_optimizer(name)
    if isinstance(optimizer, str):
        return None
    accepted = [p for p in accepted_options(optimizer) if allow_lr or p != "lr"]
    wrong = [k for k in options if k not in accepted]
    if not wrong:
        return None
    return f"{optimizer.__name__} does not take {', '.join(wrong)}; it takes: {', '.join(accepted)}"
