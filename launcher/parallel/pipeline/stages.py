"""A process's stages: the modules torch's schedules run, and the one module the loop sees."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class StageModules:
    """This rank's stages, as torch's pipelining runs them, and where each stage begins."""

    modules: list[nn.Module]
    indices: list[int]
    count: int  # stages in all
    # Each stage's example inputs and outputs (one micro-batch), on CPU.
    examples: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = field(
        default_factory=list
    )
    points: list[str] = field(default_factory=list)  # the split points: stage i + 1 begins at i

    def starts_of(self, index: int) -> str:
        return "the model's start" if index == 0 else self.points[index - 1]


class StageParts(nn.Module):
    """This rank's stages as one module for the loop (parameters, buffers, state dicts,
    named as in the whole model). Never called: the schedule runs the stages."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        for stage in stages:
            _merge(self, stage)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline's stages run through its schedule, not StageParts")


class _Merged(nn.Module):
    """A container two stages each hold part of (`blocks`), for `StageParts` alone: the
    stages' own modules are never changed (fsdp's units belong to one stage's root)."""


def _merge(into: nn.Module, module: nn.Module) -> None:
    for name, param in module.named_parameters(recurse=False):
        into.register_parameter(name, param)
    for name, buffer in module.named_buffers(recurse=False):
        into.register_buffer(name, buffer)
    for name, child in module.named_children():
        present = into._modules.get(name)
        if present is None or present is child:
            into._modules[name] = child
            continue
        if not isinstance(present, _Merged):
            merged = _Merged()
            _merge(merged, present)
            into._modules[name] = present = merged
        _merge(present, child)
