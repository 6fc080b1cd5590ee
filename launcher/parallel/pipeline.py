"""`parallel.pp`: the model cut into stages, each held by the processes of one pipeline rank,
run by a schedule of `torch.distributed.pipelining` (as torchtitan does).

How a model is cut, for any model torch.export can trace: torch's tracer (`pipeline()`)
splits the model's graph where the split points begin (`parallel.pp_split_points`, by module
name; else the repeated blocks divided evenly). Each stage's graph calls modules of the model
by their names (`blocks.2`, `ln_f`); those calls are pointed back at the model's own modules,
so a stage holds the very modules (their classes, parameters and names) of the whole model:
fsdp shards a stage's blocks as it shards the model's, and its state dict is the whole
model's, keyed by the same names, so checkpoints move between pipelined and other layouts.

A process holds one stage (`GPipe`, `1F1B`) or two (`Interleaved1F1B`, looped: stages r and
r + pp; `ZBVZeroBubble`, a V: stages r and 2pp - 1 - r); the loop sees them as one module
(`StageParts`). The loss runs on the last stage's output: the recipe gives
`split_batch(batch) -> (inputs, targets)` and `loss_from_output(output, targets)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.config.parallel import ParallelSection
from launcher.errors import UsageError
from launcher.parallel.dims import ParallelDims
from launcher.parallel.pipeline_input import PipelineInput

DOCS = "docs/fsdp-and-parallelism.md, 'Pipeline parallelism'"
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}
TWO_STAGES = ("Interleaved1F1B", "ZBVZeroBubble")


# Older torch (2.9, torch_xla's) hung in its schedules' first exchange between stages here.
MIN_TORCH = (2, 11)


def check_torch() -> None:
    """A UsageError where this torch's pipelining is older than the launcher runs."""
    found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if found < MIN_TORCH:
        raise UsageError(
            f"parallel.pp: pipelines need torch {'.'.join(map(str, MIN_TORCH))} or newer; this "
            f"environment has torch {torch.__version__}",
            hint="Upgrade torch, or set parallel.pp: 1.",
        )


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in TWO_STAGES else 1


def stage_indices(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages this pipeline rank holds, in the order its schedule runs them."""
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + pp * i for i in range(stages_per_rank(schedule))]


def microbatches(section: ParallelSection, batch_size: int) -> int:
    """Micro-batches per step; a UsageError where they do not divide the batch."""
    count = section.pp_microbatches or section.pp
    if batch_size % count:
        raise UsageError(
            f"parallel.pp_microbatches: {count} micro-batches do not divide data.batch_size "
            f"{batch_size}",
            hint="Choose a number of micro-batches that divides the batch (at least pp keeps "
            "every stage busy).",
        )
    return count


def split_points(model: nn.Module, section: ParallelSection, wrap: list[str] | None) -> list[str]:
    """Where stages begin: the spec's, checked against the model's module names; else the
    model's repeated blocks (fsdp's units, `wrap` as `fsdp.wrap` names them) divided evenly."""
    from launcher.parallel.shard_units import shard_units

    names = {id(module): name for name, module in model.named_modules()}
    blocks = [names[id(unit)] for unit in reversed(shard_units(model, wrap).modules)]
    stages = section.pp * stages_per_rank(section.pp_schedule)
    if section.pp_split_points is not None:
        names = dict(model.named_modules())
        unknown = [name for name in section.pp_split_points if name not in names or not name]
        if unknown:
            raise UsageError(
                f"parallel.pp_split_points: {', '.join(unknown)} names no module of the model",
                hint=f"Name where a stage begins, e.g. {blocks[len(blocks) // 2] if blocks else 'a block'} "
                f"({DOCS}).",
            )
        if len(section.pp_split_points) != stages - 1:
            raise UsageError(
                f"parallel.pp_split_points: {len(section.pp_split_points)} points make "
                f"{len(section.pp_split_points) + 1} stages; pp {section.pp} with "
                f"{section.pp_schedule} runs {stages}",
                hint=f"Give {stages - 1} split points, or none (even splits of the blocks).",
            )
        return list(section.pp_split_points)
    if len(blocks) < stages:
        raise UsageError(
            f"parallel.pp: {stages} stages ({section.pp} x {stages // section.pp} per process "
            f"under {section.pp_schedule}) need at least as many repeated blocks; the model has "
            f"{len(blocks)}",
            hint="Lower parallel.pp, or name the split points (parallel.pp_split_points).",
        )
    # The first stage also embeds and the last projects to the output: give any blocks left
    # over to the stages in between, as torchtitan's even split does.
    per_stage, extra = divmod(len(blocks), stages)
    starts, at = [], 0
    for stage in range(stages - 1):
        at += per_stage + (1 if 0 < stage + 1 <= extra else 0)
        starts.append(blocks[at])
    return starts


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


class Pipeline:
    """Runs one step's micro-batches through this rank's stages, and the loss out of them."""

    def __init__(
        self,
        stages: StageModules,
        section: ParallelSection,
        given: PipelineInput,
        groups: tuple[Any, Any],  # this rank's pipeline group, and its stage's group
        device: torch.device,
    ) -> None:
        from torch.distributed import pipelining

        self.given, self.device, self.section = given, device, section
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

        def loss(output: Any, targets: Any) -> torch.Tensor:
            value = given.loss_from_output(output, targets)
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
        held = " and ".join(str(i) for i in self.stages.indices)
        return (
            f"pipeline: {self.stages.count} stages over pp {self.group.size()} "
            f"({self.section.pp_schedule}, {self.micro} micro-batches a step); stage "
            f"{self.stages.indices[0] if len(self.stages.indices) == 1 else held} on rank "
            f"{dist.get_rank()} begins at {self.stages.starts_of(self.stages.indices[0])}"
        )

    def step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch; the batch's mean loss, on every rank."""
        inputs, targets = self.given.split(batch)
        losses: list[torch.Tensor] = []
        args = inputs if self.first else ()
        self.schedule.step(*args, target=targets if self.last else None, losses=losses)
        scale = self.given.accum
        return self._said(losses, scale)

    def evaluate(self, batch: Any) -> torch.Tensor:
        """The batch's loss through every stage's forward, stage after stage on the whole
        batch (no micro-batches: any batch size, a short last one too, and the loss of the
        whole batch, as an unpipelined evaluation computes it); on every rank."""
        inputs, targets = self.given.split(batch)
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
            outputs = self.stages.modules[at](*carried)
            carried = outputs if isinstance(outputs, tuple) else (outputs,)
            if stage == self.stages.count - 1:
                output = carried[0] if len(carried) == 1 else carried
                loss = self.given.loss_from_output(output, targets).detach().float()
            elif stage + 1 not in held:  # to the rank of the stage after
                for tensor in carried:
                    dist.send(tensor.contiguous(), dst=self._global(stage + 1), group=self.group)
        dist.broadcast(loss, src=self.loss_source, group=self.group)
        return loss

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
) -> tuple[Pipeline, StageModules]:
    """This rank's stages of `model` (whole, on CPU) and the schedule that runs them.
    Collective: every process calls it (it makes each stage's process group)."""
    check_torch()
    points = split_points(model, section, wrap)
    micro = microbatches(section, given.batch_size)
    inputs, _ = given.split(given.example)
    example = tuple(_first_rows(value, given.batch_size // micro) for value in inputs)
    indices = stage_indices(dims.pp_rank(rank), dims.pp, section.pp_schedule)
    stages = cut(model, points, example, indices, autocast)
    stages.points = points
    world = dims.world
    stage_groups = [
        dist.new_group([r for r in range(world) if dims.pp_rank(r) == i]) for i in range(dims.pp)
    ]
    groups = (mesh["pp"].get_group(), stage_groups[dims.pp_rank(rank)])
    return Pipeline(stages, section, given, groups, device), stages


def _on(
    tensors: tuple[torch.Tensor, ...], device: torch.device, grad: bool
) -> tuple[torch.Tensor, ...]:
    """Stand-ins on `device` for what a stage takes or gives; those that carry a gradient
    between stages (floating point, past the first stage's inputs) say so."""
    return tuple(
        torch.empty_like(t, device=device).requires_grad_(grad and t.is_floating_point())
        for t in tensors
    )


def _first_rows(value: Any, rows: int) -> Any:
    return value[:rows] if isinstance(value, torch.Tensor) else value
