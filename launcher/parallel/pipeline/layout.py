"""Where a pipeline's stages begin and which a process holds (`parallel.pp`, `pp_schedule`,
`pp_microbatches`, `pp_split_points`): the rules every cut and the checks of `train validate`
share."""

from __future__ import annotations

import torch
from torch import nn

from launcher.config.parallel import ParallelSection
from launcher.errors import UsageError

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
