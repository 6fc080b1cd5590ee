"""Any model torch.export can trace, cut by torch's tracer (`pipeline()`) where the split points
begin; each stage's graph then calls the model's own modules."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from launcher.errors import UsageError
from launcher.parallel.pipeline.layout import DOCS
from launcher.parallel.pipeline.stages import StageModules


def cut(
    model: nn.Module,
    points: list[str],
    example: tuple[Any, ...],
    indices: list[int],
    autocast: Callable[[], Any],
) -> StageModules:
    """The stages of `model` (whole, on CPU) that begin at `points`, traced on `example`
    (one micro-batch's inputs); the modules of the stages in `indices` only."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {name: SplitPoint.BEGINNING for name in points}
    try:
        with warnings.catch_warnings():  # torch.export's own deprecations, nothing of the run's
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(model, mb_args=example, split_spec=spec)
    except Exception as exc:  # torch.export cannot trace every model
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"parallel.pp: torch.export could not trace {type(model).__name__} to cut it into "
            f"stages: {why}",
            hint=f"Make the model's forward traceable by torch.export ({DOCS}).",
        ) from exc
    every = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    shapes = _example_activations(every, example, autocast)
    stages = [every[i] for i in indices]
    for stage in stages:
        _point_at_the_models_modules(stage, model)
    return StageModules(stages, indices, pipe.num_stages, examples=[shapes[i] for i in indices])


def _example_activations(
    stages: list[nn.Module], example: tuple[Any, ...], autocast: Callable[[], Any]
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Each stage's inputs and outputs on the example micro-batch, run stage after stage on
    CPU: the shapes and dtypes each stage sends and receives, given to torch's stages up
    front (its inference of them at the first step runs `autograd.grad`, which fsdp's
    gradient hooks do not support)."""
    out, inputs = [], example
    with torch.no_grad(), autocast():
        for stage in stages:
            outputs = stage(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            out.append((inputs, outputs))
            inputs = outputs
    return out


def _point_at_the_models_modules(stage: nn.Module, model: nn.Module) -> None:
    """The tracer's stage calls copies of the model's modules (torch's `InterpreterModule`,
    sharing the parameters); each call now goes to the model's own module of that name, so
    that the stage holds the model's classes (fsdp's units, float8's and the optimizer's
    groups find them) under the model's names."""
    called = [node.target for node in stage.graph.nodes if node.op == "call_module"]
    for name in called:
        parent_name, _, child = name.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        parent._modules[child] = model.get_submodule(name)
