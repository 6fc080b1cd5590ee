"""Runs a step's micro-batches through a process's stages by one of torch's schedules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.config.parallel import ParallelSection
from launcher.parallel.dims import ParallelDims
from launcher.parallel.pipeline.causal_lm import complete_hooks
from launcher.parallel.pipeline.cut import cut_model
from launcher.parallel.pipeline.given import PipelineInput
from launcher.parallel.pipeline.layout import (
    SCHEDULES,
    check_torch,
    microbatches,
    split_points,
    stage_indices,
)
from launcher.parallel.pipeline.stages import StageModules, fix_wire_dtypes
from launcher.parallel.pipeline.tied import TiedGradients, tie_groups


class Pipeline:
    """Runs one step's micro-batches through this rank's stages, and the loss out of them."""

    def __init__(
        self,
        stages: StageModules,
        section: ParallelSection,
        given: PipelineInput,
        groups: tuple[Any, Any],  # this rank's pipeline group, and its stage's group
        device: torch.device,
        tied: TiedGradients | None = None,
    ) -> None:
        from torch.distributed import pipelining

        self.given, self.device, self.section = given, device, section
        self.tied = tied or TiedGradients({}, set())
        (self.group, self.stage_group), self.stages = groups, stages
        self.first, self.last = 0 in stages.indices, stages.count - 1 in stages.indices
        pipeline_stages = [
            pipelining.PipelineStage(
                module, index, stages.count, device, group=self.group,
                input_args=_on(inputs, device, grad=index > 0),
                output_args=_on(outputs, device, grad=True),
            )
            for module, index, (inputs, outputs) in zip(
                stages.modules, stages.indices, stages.examples, strict=True
            )
        ]  # fmt: skip
        accum = given.accum

        loss_from_output = given.loss_from_output
        assert loss_from_output is not None  # completed by build_pipeline

        def loss(output: Any, targets: Any) -> torch.Tensor:
            value = loss_from_output(output, targets)
            return value / accum if accum > 1 else value

        self.micro = microbatches(section, given.batch_size)
        schedule = getattr(pipelining, SCHEDULES[section.pp_schedule])
        self.schedule = schedule(
            pipeline_stages if len(pipeline_stages) > 1 else pipeline_stages[0],
            n_microbatches=self.micro,
            loss_fn=loss,
        )
        self.loss_source = self._global(stages.count - 1)  # says the loss to the others

    def describe(self) -> str:
        """The start-up line of this process's stages: where they begin, and how much of the
        model they hold."""
        indices = self.stages.indices
        held = " and ".join(f"{i} (from {self.stages.starts_of(i)})" for i in indices)
        return (
            f"pipeline: {self.stages.count} stages over pp {self.group.size()} "
            f"({self.section.pp_schedule}, {self.micro} micro-batches a step); "
            f"stage{'s' if len(indices) > 1 else ''} {held} hold{'' if len(indices) > 1 else 's'} "
            f"{self.stages.held_params:,} of the model's {self.stages.total_params:,} parameters"
        )

    def step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch; the batch's mean loss, on every rank."""
        args, by_name, targets = self._split(batch)
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *(args if self.first else ()),
            target=targets if self.last else None,
            losses=losses,
            **by_name,  # every stage takes these (an attention mask), micro-batch by micro-batch
        )
        scale = self.given.accum
        return self._said(losses, scale)

    def evaluate(self, batch: Any) -> torch.Tensor:
        """The batch's loss through every stage's forward, stage after stage on the whole
        batch (no micro-batches: any batch size, a short last one too, and the loss of the
        whole batch, as an unpipelined evaluation computes it); on every rank."""
        inputs, by_name, targets = self._split(batch)
        rows = next(t.shape[0] for t in inputs if isinstance(t, torch.Tensor))
        held = dict(zip(self.stages.indices, range(len(self.stages.indices)), strict=True))
        carried: tuple[Any, ...] = inputs
        loss = torch.zeros((), device=self.device)
        for stage in range(self.stages.count):
            if stage not in held:
                continue
            at = held[stage]
            if stage > 0 and stage - 1 not in held:  # from the rank of the stage before
                carried = self._receive(self.stages.examples[at][0], rows, stage - 1)
            outputs = self.stages.modules[at](*carried, **by_name)
            carried = outputs if isinstance(outputs, tuple) else (outputs,)
            if stage == self.stages.count - 1:
                output = carried[0] if len(carried) == 1 else carried
                loss = loss_from_output_of(self.given)(output, targets).detach().float()
            elif stage + 1 not in held:  # to the rank of the stage after
                for tensor in carried:
                    dist.send(tensor.contiguous(), dst=self._global(stage + 1), group=self.group)
        dist.broadcast(loss, src=self.loss_source, group=self.group)
        return loss

    def _split(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """A batch's first-stage inputs, what every stage takes by name, and its targets."""
        assert self.given.split is not None  # completed by build_pipeline
        inputs, targets = self.given.split(batch)
        args, by_name = self.stages.route(inputs)
        return args, by_name, targets

    def _receive(self, like: tuple[torch.Tensor, ...], rows: int, stage: int) -> tuple[Any, ...]:
        """A stage's outputs, sent by the rank that holds it; shaped as `like` (the example
        micro-batch's), with `rows` rows."""
        received = []
        for example in like:
            tensor = torch.empty(
                (rows, *example.shape[1:]), dtype=example.dtype, device=self.device
            )
            dist.recv(tensor, src=self._global(stage), group=self.group)
            received.append(tensor)
        return tuple(received)

    def _global(self, stage: int) -> int:
        """The global rank, in this rank's pipeline, that holds `stage`."""
        pp = self.group.size()
        holder = next(
            r for r in range(pp) if stage in stage_indices(r, pp, self.section.pp_schedule)
        )
        return dist.get_global_rank(self.group, holder)

    def _said(self, losses: list[torch.Tensor], scale: int) -> torch.Tensor:
        if self.last:
            loss = torch.stack([value.detach().float() for value in losses]).mean() * scale
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.loss_source, group=self.group)
        return loss

    def agree_buffers(self, model: nn.Module) -> None:
        """Each stage's buffers as its first process holds them (ddp's rule, stage by stage:
        the stages hold different buffers)."""
        source = dist.get_global_rank(self.stage_group, 0)
        for buffer in model.buffers():
            local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
            dist.broadcast(local, src=source, group=self.stage_group)


def build_pipeline(
    model: nn.Module,
    given: PipelineInput,
    section: ParallelSection,
    wrap: list[str] | None,
    dims: ParallelDims,
    rank: int,
    mesh: Any,
    device: torch.device,
    autocast: Callable[[], Any],
    param_dtype: torch.dtype | None = None,
) -> tuple[Pipeline, StageModules]:
    """This rank's stages of `model` (whole, on CPU) and the schedule that runs them.
    Collective: every process calls it (it makes each stage's process group, and the groups
    that sum tied weights' gradients), and the first process of each stage says what it
    holds. `param_dtype`: the dtype fsdp computes in, where the spec sets one."""
    check_torch()
    given = complete_hooks(given, model)
    points = split_points(model, section, wrap)
    rows = given.batch_size // microbatches(section, given.batch_size)
    indices = stage_indices(dims.pp_rank(rank), dims.pp, section.pp_schedule)
    stages = cut_model(model, points, given, rows, indices, autocast, section.pp_schedule)
    fix_wire_dtypes(stages, param_dtype)  # before fsdp's hooks: it casts what they see
    world = dims.world
    stage_groups = [
        dist.new_group([r for r in range(world) if dims.pp_rank(r) == i]) for i in range(dims.pp)
    ]
    groups = (mesh["pp"].get_group(), stage_groups[dims.pp_rank(rank)])
    tied = tie_groups(stages.shared, dims, rank, section.pp_schedule)
    pipeline = Pipeline(stages, section, given, groups, device, tied)
    if rank % (world // dims.pp) == 0:  # the first process of a stage says what it holds
        print(pipeline.describe(), flush=True)
    return pipeline, stages


def loss_from_output_of(given: PipelineInput) -> Callable[[Any, Any], Any]:
    assert given.loss_from_output is not None  # completed by build_pipeline
    return given.loss_from_output


def _on(
    tensors: tuple[torch.Tensor, ...], device: torch.device, grad: bool
) -> tuple[torch.Tensor, ...]:
    """Stand-ins on `device` for what a stage takes or gives; those that carry a gradient
    between stages (floating point, past the first stage's inputs) say so."""
    return tuple(
        torch.empty_like(t, device=device).requires_grad_(grad and t.is_floating_point())
        for t in tensors
    )
