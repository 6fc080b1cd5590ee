"""Optimizer and learning-rate schedule from the `optim` section."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from launcher.config.optim import OptimSection, optimizer_class


def build_optimizer(
    optim: OptimSection,
    params: Iterable[torch.nn.Parameter],
    defaults: dict[str, Any] | None = None,
    device_type: str = "cpu",
) -> torch.optim.Optimizer:
    """`defaults`: a backend's preferred options, used where the optimizer takes them and
    `optim.kwargs` does not set them."""
    cls = optimizer_class(optim.name)
    accepted = inspect.signature(cls).parameters
    chosen = {k: v for k, v in (defaults or {}).items() if k in accepted}
    chosen.update(fused_default(optim, accepted, device_type))
    return cls(params, lr=optim.lr, **{**chosen, **optim.kwargs})


# The optimizers with a fused CUDA kernel (Adagrad's `fused` is CPU-only).
FUSED_ON_CUDA = ("Adam", "AdamW", "SGD")


def fused_default(optim: OptimSection, accepted: Any, device_type: str) -> dict[str, Any]:
    """`optim.fused`: on CUDA, one fused kernel for every parameter's update (torch's own
    default is the multi-tensor `foreach` path), where the optimizer has one and the user's
    `optim.kwargs` choose no implementation themselves."""
    chosen_by_user = "fused" in optim.kwargs or "foreach" in optim.kwargs
    if not optim.fused or device_type != "cuda" or optim.name not in FUSED_ON_CUDA:
        return {}
    if chosen_by_user or "fused" not in accepted:
        return {}
    return {"fused": True}


def lr_factor(optim: OptimSection, step: int, total_steps: int) -> float:
    """Multiplier of `optim.lr` for the update made at `step` (0-based)."""
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * cosine


def build_scheduler(
    optim: OptimSection, optimizer: torch.optim.Optimizer, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(optim, step, total_steps))


def apply_after_load(
    optim: OptimSection, optimizer: torch.optim.Optimizer, scheduler: LambdaLR
) -> None:
    """After a checkpoint is loaded: the spec's learning rate and optimizer options win over
    those the checkpoint saved, as a resume that changes them means (`optim.lr=1e-6` after a
    NaN). The schedule goes on from its step, now with the spec's length and base rate; where
    nothing changed, every value is the one the checkpoint held, bit for bit."""
    for group in optimizer.param_groups:
        group.update({key: value for key, value in optim.kwargs.items() if key in group})
        group["initial_lr"] = optim.lr
    scheduler.base_lrs = [optim.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["lr"] = optim.lr * factor(scheduler.last_epoch)
