"""Optimizer and learning-rate schedule from the `optim` section."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from launcher.config.optim import WSD_DECAY_FRACTION, OptimSection, optimizer_class
from launcher.errors import UsageError


def build_optimizer(
    optim: OptimSection,
    groups: list[dict[str, Any]],
    defaults: dict[str, Any] | None = None,
    device_type: str = "cpu",
) -> torch.optim.Optimizer:
    """`groups`: torch param-group dicts (`launcher.worker.param_groups`). `defaults`: a
    backend's preferred options, used where the optimizer takes them and `optim.kwargs` does
    not set them."""
    cls = optimizer_class(optim.name)
    accepted = inspect.signature(cls).parameters
    chosen = {k: v for k, v in (defaults or {}).items() if k in accepted}
    chosen.update(fused_default(cls, optim, accepted, device_type))
    try:
        return cls(groups, lr=optim.lr, **{**chosen, **optim.kwargs})
    except (ValueError, TypeError) as exc:  # the optimizer's own checks of what it was given
        raise _refused(optim, len(groups), exc) from exc


def _refused(optim: OptimSection, n_groups: int, exc: Exception) -> UsageError:
    """The optimizer refused the run's settings or its parameter groups (LBFGS takes one
    group), which the spec's own checks, on one stand-in parameter, could not see."""
    keys = (
        "optim.name, optim.kwargs and optim.groups"
        if optim.groups
        else "optim.name and optim.kwargs"
    )
    return UsageError(
        f"optim: {optim.name} refuses the run's {n_groups} parameter group"
        f"{'s' if n_groups != 1 else ''}: {exc}",
        hint=f"Change {keys} (or the recipe's param_groups) to what the optimizer takes.",
    )


def fused_default(
    cls: type[torch.optim.Optimizer], optim: OptimSection, accepted: Any, device_type: str
) -> dict[str, Any]:
    """`optim.fused`: on CUDA, one fused kernel for every parameter's update (torch's own
    default is the multi-tensor `foreach` path), where the optimizer has one and the user's
    `optim.kwargs` choose no implementation themselves."""
    # The optimizers with a fused CUDA kernel (Adagrad's `fused` is CPU-only).
    fused_on_cuda = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
    chosen_by_user = "fused" in optim.kwargs or "foreach" in optim.kwargs
    if not optim.fused or device_type != "cuda" or cls not in fused_on_cuda:
        return {}
    if chosen_by_user or "fused" not in accepted:
        return {}
    return {"fused": True}


def lr_factor(optim: OptimSection, step: int, total_steps: int) -> float:
    """Multiplier of each group's `lr` for the update made at `step` (0-based): a function of
    the step and the run's length alone, so a resumed run, or one resumed with a longer
    `train.max_steps`, goes on from exactly where the schedule of its length is."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    if optim.schedule == "wsd":
        decay = _wsd_decay_steps(optim, total_steps)
        stable_until = max(optim.warmup_steps, total_steps - decay)
        if step < stable_until:
            return 1.0
        progress = min(1.0, (step - stable_until) / max(1, total_steps - stable_until))
        return 1.0 - (1.0 - optim.min_lr_ratio) * progress
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    shape = (
        1.0 - progress if optim.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    )
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape


def _wsd_decay_steps(optim: OptimSection, total_steps: int) -> int:
    given = optim.decay_steps if optim.decay_steps is not None else WSD_DECAY_FRACTION
    return given if isinstance(given, int) else max(1, round(given * total_steps))


def build_scheduler(
    optim: OptimSection, optimizer: torch.optim.Optimizer, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(optim, step, total_steps))


def rates_used(optim: OptimSection, scheduler: LambdaLR, names: list[str]) -> dict[str, float]:
    """The learning rates of the update `scheduler` last stepped past, as they are logged:
    `lr`, `optim.lr` as the schedule scaled it, and where any group's own rate is not
    `optim.lr`, each group's as `lr/<name>` (`names`: the groups', in the optimizer's order):
    `lr` alone would then be a rate some parameters did not take."""
    update = scheduler.last_epoch - 1  # the scheduler steps after each update: 1-based here
    rates = {"lr": optim.lr * scheduler.lr_lambdas[0](update)}
    if set(scheduler.base_lrs) != {optim.lr}:
        # The expression LambdaLR gave the update: each group's rate, bit for bit.
        each = zip(names, scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        rates.update({f"lr/{name}": base * factor(update) for name, base, factor in each})
    return rates


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's settings as the spec and the recipe make them now, before a scheduler
    or a checkpoint changes them: what `apply_after_load` restores."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_after_load(
    wanted: list[dict[str, Any]], optimizer: torch.optim.Optimizer, scheduler: LambdaLR
) -> None:
    """After a checkpoint is loaded: the settings of the spec and the recipe now
    (`group_settings` of the optimizer as built) win over those the checkpoint saved, as a
    resume that changes them means (`optim.lr=1e-6` after a NaN). The schedule goes on from
    its step, now with the spec's length and base rates; where nothing changed, every value
    is the one the checkpoint held, bit for bit."""
    groups = optimizer.param_groups
    if len(wanted) != len(groups):  # the checkpoint's own structure was refused before this
        raise AssertionError(f"{len(groups)} optimizer groups loaded, {len(wanted)} built")
    for group, settings in zip(groups, wanted, strict=True):
        group.update({k: v for k, v in settings.items() if k in group and k != "lr"})
        group["initial_lr"] = settings["lr"]
    scheduler.base_lrs = [settings["lr"] for settings in wanted]
    for group, factor in zip(groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = group["initial_lr"] * factor(scheduler.last_epoch)
