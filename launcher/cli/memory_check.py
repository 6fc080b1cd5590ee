"""The memory a run's layout needs per device, worked out in the `train` process from the
recipe, the spec and one batch (`launcher.parallel.memory_estimate`): `train validate` prints
it, and a GPU launch says, before it starts, where it will not fit.

Like `recipe_check.py`, it calls the workers' code (the parameter groups, the optimizer) in
the launcher's process only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from launcher.config.spec import RunSpec
from launcher.parallel.dims import resolve_dims
from launcher.parallel.memory_estimate import Layout, MemoryEstimate, estimate_memory
from launcher.worker.optim import build_optimizer
from launcher.worker.param_groups import group_parameters
from launcher.worker.recipe import Recipe

# The strategies whose layout the estimate knows: the xla ones lay out the model themselves.
ESTIMATED = ("ddp", "fsdp")


def estimate_for(
    spec: RunSpec, recipe: Recipe, batch: Any, world: int, per_node: int
) -> MemoryEstimate | str:
    """The estimate for `spec`'s layout on `world` processes (`per_node` on each node), or
    one line saying why there is none: an estimate that fails never stops a run."""
    strategy = spec.launch.strategy
    if strategy not in ESTIMATED:
        return f"memory per device: not estimated for launch.strategy {strategy}"
    dims = resolve_dims(spec.parallel, strategy, world, per_node)  # as the run will refuse
    layout = Layout(strategy, dims, spec.fsdp, spec.train.precision, spec.data.batch_size)

    def make_optimizer(model: Any) -> Any:
        groups = group_parameters(spec.optim, model, recipe).torch_groups()
        return build_optimizer(spec.optim, groups, device_type="cpu")

    try:
        if dims.pp > 1:  # the stage that needs the most
            return max(stage_estimates(spec, recipe, batch, layout, make_optimizer), key=_peak)
        return estimate_memory(
            lambda: recipe.build_model(**spec.recipe.model),
            make_optimizer,
            batch,
            lambda model, batch: recipe.loss(model, batch)[0],
            layout,
            recipe.parallelize_hook(),
        )
    except Exception as exc:  # the model's code on fake tensors: anything may fail
        why = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        return (
            f"memory per device: not estimated ({type(exc).__name__} on fake tensors"
            + (f": {why}" if why else "")
            + ")"
        )


def estimate_line(spec: RunSpec, recipe: Recipe, batch: Any, world: int) -> str:
    """`train validate`'s line: the estimate on `world` processes of one node; a line for
    each stage of a pipeline."""
    if spec.parallel.pp > 1 and spec.launch.strategy == "fsdp":
        return "\n".join(_stage_lines(spec, recipe, batch, world))
    estimate = estimate_for(spec, recipe, batch, world, world)
    return estimate if isinstance(estimate, str) else estimate.describe()


def _stage_lines(spec: RunSpec, recipe: Recipe, batch: Any, world: int) -> list[str]:
    dims = resolve_dims(spec.parallel, "fsdp", world, world)
    layout = Layout("fsdp", dims, spec.fsdp, spec.train.precision, spec.data.batch_size)

    def make_optimizer(model: Any) -> Any:
        groups = group_parameters(spec.optim, model, recipe).torch_groups()
        return build_optimizer(spec.optim, groups, device_type="cpu")

    try:
        estimates = stage_estimates(spec, recipe, batch, layout, make_optimizer)
    except Exception as exc:  # as estimate_for: never a refusal
        return [f"memory per device: not estimated ({type(exc).__name__} on fake tensors)"]
    return [estimate.describe() for estimate in estimates]


def stage_estimates(
    spec: RunSpec,
    recipe: Recipe,
    batch: Any,
    layout: Layout,
    make_optimizer: Callable[[Any], Any],
) -> list[MemoryEstimate]:
    """Each pipeline stage's memory per device (`parallel.pp`): the stage cut as the run cuts
    it (on the meta device), laid out and stepped on one micro-batch, then its activations
    counted once for each micro-batch it holds at once (1F1B's first stage holds pp of
    them, its last one; GPipe and the two-stage schedules all of the step's)."""
    import dataclasses

    import torch

    from launcher.parallel.pipeline.layout import microbatches, split_points
    from launcher.parallel.pipeline.traced import cut

    hooks, section = recipe.pipeline_hooks(), spec.parallel
    micro = microbatches(section, spec.data.batch_size)
    rows = spec.data.batch_size // micro
    with torch.device("meta"):
        model = recipe.build_model(**spec.recipe.model)
    points = split_points(model, section, spec.fsdp.wrap)
    inputs, targets = hooks.split(batch)
    example = tuple(t[:rows].to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    stages = cut(model, points, example, list(range(len(points) + 1)), contextlib.nullcontext)
    out = []
    for index, module in enumerate(stages.modules):
        _traced_on_cpu(module)
        last = index == stages.count - 1
        taken = tuple(
            torch.empty_like(t, device="cpu").requires_grad_(index > 0 and t.is_floating_point())
            for t in stages.examples[index][0]
        )
        estimate = estimate_memory(
            lambda module=module: module,
            make_optimizer,
            (taken, targets[:rows] if last else None),
            functools.partial(_stage_loss, hooks.loss_from_output if last else None),
            dataclasses.replace(layout, batch_size=rows, stage=f"stage {index} of {stages.count}"),
            recipe.parallelize_hook(),
        )
        extra = estimate.activations * (_in_flight(section, index, micro) - 1)
        out.append(
            dataclasses.replace(
                estimate, activations=estimate.activations + extra, peak=estimate.peak + extra
            )
        )
    return out


def _in_flight(section: Any, stage: int, micro: int) -> int:
    """The micro-batches whose activations `stage` holds at once: under 1F1B, those its
    process starts before its first backward (pp - its pipeline rank); else every one."""
    from launcher.parallel.pipeline.layout import stage_indices

    if section.pp_schedule != "1F1B":
        return micro
    holder = next(r for r in range(section.pp) if stage in stage_indices(r, section.pp, "1F1B"))
    return min(micro, section.pp - holder)


def _traced_on_cpu(stage: Any) -> None:
    """A stage traced on the meta device names that device in the tensors its graph makes
    (`arange(..., device=meta)`); the estimate runs it on fake CPU tensors."""
    import torch

    meta = torch.device("meta")
    for node in stage.graph.nodes:
        if node.kwargs.get("device") == meta:
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    stage.recompile()


def _stage_loss(loss_from_output: Callable[..., Any] | None, model: Any, batch: Any) -> Any:
    """A stage's forward and what its backward starts from: the recipe's loss on the last
    stage's output; elsewhere the output's sum, whose gradient has the shape of the one the
    next stage sends back."""
    inputs, targets = batch
    output = model(*inputs)
    if loss_from_output is not None:
        return loss_from_output(output, targets)
    outputs = output if isinstance(output, tuple) else (output,)
    return sum(o.float().sum() for o in outputs)


def _peak(estimate: MemoryEstimate) -> int:
    return estimate.peak
