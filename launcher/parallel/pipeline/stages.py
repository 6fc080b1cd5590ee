"""A process's stages: the modules torch's schedules run, and the one module the loop sees."""

from __future__ import annotations

from collections.abc import Callable
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
    # A batch's model inputs as (the first stage's positional inputs, what every stage takes
    # by name): the tracer's stages take positional inputs alone.
    route: Callable[[tuple[Any, ...]], tuple[tuple[Any, ...], dict[str, Any]]] = lambda inputs: (
        inputs,
        {},
    )
    # Parameters that stages of other processes hold too (a tied embedding), by name: the
    # stages that hold each (`launcher.parallel.pipeline.tied`).
    shared: dict[str, list[int]] = field(default_factory=dict)
    total_params: int = 0  # the whole model's parameters, for the start-up line

    @property
    def held_params(self) -> int:
        """The parameters of this process's stages (a tied weight once)."""
        seen = {id(p): p.numel() for stage in self.modules for p in stage.parameters()}
        return sum(seen.values())

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


def example_activations(
    stages: list[nn.Module],
    example: tuple[tuple[Any, ...], dict[str, Any]],
    autocast: Callable[[], Any],
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Each stage's inputs and outputs on the example micro-batch (the first stage's inputs,
    and what every stage takes by name), run stage after stage on CPU: the shapes and dtypes
    each stage sends and receives, given to torch's stages up front (its inference of them at
    the first step runs `autograd.grad`, which fsdp's gradient hooks do not support)."""
    out: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
    inputs, by_name = example
    with torch.no_grad(), autocast():
        for stage in stages:
            outputs = stage(*inputs, **by_name)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            out.append((inputs, outputs))
            inputs = outputs
    return out


def shared_parameters(stages: list[nn.Module]) -> dict[str, list[int]]:
    """The parameters that several of `stages` (every stage of the model) hold, by the name
    the first of them gives it, with the stages that hold it."""
    holders: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            holders.setdefault(id(param), []).append(index)
            names.setdefault(id(param), name)
    return {names[key]: held for key, held in holders.items() if len(held) > 1}


def fix_wire_dtypes(stages: StageModules, dtype: torch.dtype | None) -> None:
    """What stages send each other, in one dtype per tensor that both ends agree on: the
    example's, or `dtype` (FSDP's `param_dtype`, which the stages compute in but the CPU
    example did not) for floating-point ones. Each stage but the last casts its output to
    it, so that the receiving process's buffers (allocated from the examples) fit what
    arrives, whatever dtype promotion gave in between."""
    for at, index in enumerate(stages.indices):
        inputs, outputs = stages.examples[at]
        if dtype is not None:
            inputs = inputs if index == 0 else _floats_in(inputs, dtype)
            outputs = outputs if index == stages.count - 1 else _floats_in(outputs, dtype)
            stages.examples[at] = (inputs, outputs)
        if index < stages.count - 1:
            stages.modules[at].register_forward_hook(_casting([t.dtype for t in outputs]))


def _floats_in(tensors: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _casting(dtypes: list[torch.dtype]) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output.to(dtypes[0])
        return type(output)(t.to(d) for t, d in zip(output, dtypes, strict=True))

    return hook
