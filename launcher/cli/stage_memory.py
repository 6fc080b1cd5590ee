"""The memory a pipeline's devices need (`parallel.pp`), worked out in the `train` process:
each stage cut as the run cuts it, laid out and stepped on one micro-batch on fake tensors
(`launcher.parallel.memory_estimate`), its activations counted once for each micro-batch it
holds at once; then summed over the stages one device holds (two under Interleaved1F1B and
ZBVZeroBubble).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from launcher.cli.pipeline_check import hooks_for
from launcher.config.spec import RunSpec
from launcher.parallel.base import map_tensors
from launcher.parallel.memory_estimate import Layout, MemoryEstimate, estimate_memory
from launcher.worker.recipe import Recipe


def device_estimates(
    spec: RunSpec,
    recipe: Recipe,
    batch: Any,
    layout: Layout,
    make_optimizer: Callable[[Any], Any],
) -> list[MemoryEstimate]:
    """The memory of each pipeline rank's devices: the sum of its stages'."""
    return per_device(stage_estimates(spec, recipe, batch, layout, make_optimizer), spec.parallel)


def per_device(stages: list[MemoryEstimate], section: Any) -> list[MemoryEstimate]:
    """Each pipeline rank's stages' estimates summed, in the order of the ranks."""
    from launcher.parallel.pipeline.layout import stage_indices

    out = []
    for rank in range(section.pp):
        held = stage_indices(rank, section.pp, section.pp_schedule)
        parts = [stages[i] for i in held]
        named = " and ".join(str(i) for i in held)
        where = f"pp rank {rank}: stage{'s' if len(held) > 1 else ''} {named} of {len(stages)}"
        out.append(
            MemoryEstimate(
                params=sum(p.params for p in parts),
                grads=sum(p.grads for p in parts),
                optimizer=sum(p.optimizer for p in parts),
                activations=sum(p.activations for p in parts),
                peak=sum(p.peak for p in parts),  # each stage's peak may come at once
                layout=dataclasses.replace(parts[0].layout, stage=where),
            )
        )
    return out


def stage_estimates(
    spec: RunSpec,
    recipe: Recipe,
    batch: Any,
    layout: Layout,
    make_optimizer: Callable[[Any], Any],
) -> list[MemoryEstimate]:
    """Each pipeline stage's memory per device: the stage cut as the run cuts it (on the
    meta device), laid out and stepped on one micro-batch, then its activations counted
    once for each micro-batch it holds at once (1F1B's first stage holds pp of them, its
    last one; GPipe and the two-stage schedules all of the step's)."""
    from launcher.parallel.pipeline.cut import cut_model
    from launcher.parallel.pipeline.layout import microbatches, split_points
    from launcher.parallel.sharded_init import build_on_meta

    section = spec.parallel
    micro = microbatches(section, spec.data.batch_size)
    rows = spec.data.batch_size // micro

    def stage_of(index: int) -> Any:
        model = build_on_meta(lambda: recipe.build_model(**spec.recipe.model))
        # The tracer traces the model on the meta device with inputs there too.
        given = hooks_for(spec, recipe, model, map_tensors(batch, lambda t: t.to("meta")))
        points = split_points(model, section, spec.fsdp.wrap)
        cut = cut_model(
            model, points, given, rows, [index], contextlib.nullcontext, section.pp_schedule,
            run=False,
        )  # fmt: skip
        return _on_fake_cpu(cut.modules[0])

    taken = _stage_inputs(spec, recipe, batch, rows)
    out = []
    for index, inputs in enumerate(taken.inputs):
        last = index == len(taken.inputs) - 1
        estimate = estimate_memory(
            functools.partial(stage_of, index),
            make_optimizer,
            (inputs, taken.by_name, taken.targets if last else None),
            functools.partial(_stage_loss, taken.loss if last else None),
            dataclasses.replace(
                layout, batch_size=rows, stage=f"stage {index} of {len(taken.inputs)}"
            ),
            recipe.parallelize_hook(),
        )
        extra = estimate.activations * (_in_flight(section, index, micro) - 1)
        out.append(
            dataclasses.replace(
                estimate, activations=estimate.activations + extra, peak=estimate.peak + extra
            )
        )
    return out


@dataclass
class _StageInputs:
    """What each stage takes on one micro-batch, as plain CPU tensors (values unset)."""

    inputs: list[tuple[torch.Tensor, ...]]  # each stage's, in order
    by_name: dict[str, Any]  # what every stage takes by name (an attention mask)
    targets: Any
    loss: Callable[[Any, Any], Any]


def _stage_inputs(spec: RunSpec, recipe: Recipe, batch: Any, rows: int) -> _StageInputs:
    """The model cut whole once, its stages run on one micro-batch: on fake tensors for a
    Hugging Face model (whose masks read values the meta device lacks), on the meta device
    for a traced one (as torch.export traced it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launcher.parallel.pipeline.cut import cut_model, first_rows
    from launcher.parallel.pipeline.hf_plan import hf_plan
    from launcher.parallel.pipeline.layout import split_points
    from launcher.parallel.sharded_init import build_on_meta

    model = build_on_meta(lambda: recipe.build_model(**spec.recipe.model))
    points = split_points(model, spec.parallel, spec.fsdp.wrap)
    fake = FakeTensorMode(allow_non_fake_inputs=True) if hf_plan(model) else None
    with fake or contextlib.nullcontext():
        if fake is not None:
            model.to_empty(device="cpu")
        moved = map_tensors(batch, fake.from_tensor if fake else lambda t: t.to("meta"))
        given = hooks_for(spec, recipe, model, moved)
        indices = list(range(len(points) + 1))
        every = cut_model(
            model, points, given, rows, indices, contextlib.nullcontext,
            spec.parallel.pp_schedule,
        )  # fmt: skip
        inputs, targets = given.split(moved)
        by_name = {k: first_rows(v, rows) for k, v in every.route(inputs)[1].items()}
        targets = first_rows(targets, rows)
    grad = [False] + [True] * (every.count - 1)
    return _StageInputs(
        inputs=[_plain(example[0], g) for example, g in zip(every.examples, grad, strict=True)],
        by_name=map_tensors(by_name, _plain_tensor),
        targets=map_tensors(targets, _plain_tensor),
        loss=given.loss_from_output,
    )


def _plain(tensors: tuple[torch.Tensor, ...], grad: bool) -> tuple[torch.Tensor, ...]:
    return tuple(_plain_tensor(t).requires_grad_(grad and t.is_floating_point()) for t in tensors)


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype)


def _in_flight(section: Any, stage: int, micro: int) -> int:
    """The micro-batches whose activations `stage` holds at once: under 1F1B, those its
    process starts before its first backward (pp - its pipeline rank); else every one."""
    from launcher.parallel.pipeline.layout import stage_indices

    if section.pp_schedule != "1F1B":
        return micro
    holder = next(r for r in range(section.pp) if stage in stage_indices(r, section.pp, "1F1B"))
    return min(micro, section.pp - holder)


def _on_fake_cpu(stage: Any) -> Any:
    """A stage traced on the meta device names that device in the tensors its graph makes
    (`arange(..., device=meta)`); the estimate runs it on fake CPU tensors."""
    if not hasattr(stage, "graph"):
        return stage  # a Hugging Face stage makes its tensors where its inputs are
    meta = torch.device("meta")
    for node in stage.graph.nodes:
        if node.kwargs.get("device") == meta:
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    stage.recompile()
    return stage


def _stage_loss(loss_from_output: Callable[..., Any] | None, model: Any, batch: Any) -> Any:
    """A stage's forward and what its backward starts from: the loss on the last stage's
    output; elsewhere the output's sum, whose gradient has the shape of the one the next
    stage sends back."""
    inputs, by_name, targets = batch
    output = model(*inputs, **by_name)
    if loss_from_output is not None:
        return loss_from_output(output, targets)
    outputs = output if isinstance(output, tuple) else (output,)
    return sum(o.float().sum() for o in outputs)
