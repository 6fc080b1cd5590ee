"""The memory a run's layout needs per device, worked out in the `train` process from the
recipe, the spec and one batch (`launcher.parallel.memory_estimate`): `train validate` prints
it, and a GPU launch says, before it starts, where it will not fit.

Like `recipe_check.py`, it calls the workers' code (the parameter groups, the optimizer) in
the launcher's process only.
"""

from __future__ import annotations

from typing import Any

from launcher.cli.stage_memory import device_estimates
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
        if dims.pp > 1:  # the device that needs the most
            return max(device_estimates(spec, recipe, batch, layout, make_optimizer), key=_peak)
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
    """`train validate`'s line: the estimate on `world` processes of one node; under a
    pipeline, a line for each pipeline rank (the stages its devices hold)."""
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
        estimates = device_estimates(spec, recipe, batch, layout, make_optimizer)
    except Exception as exc:  # as estimate_for: never a refusal
        why = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        return [
            f"memory per device: not estimated ({type(exc).__name__} on fake tensors"
            + (f": {why}" if why else "")
            + ")"
        ]
    return [estimate.describe() for estimate in estimates]


def _peak(estimate: MemoryEstimate) -> int:
    return estimate.peak
