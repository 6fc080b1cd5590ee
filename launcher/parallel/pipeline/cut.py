"""The cut of a model into stages: a Hugging Face model by its own plan (`hf_stages`), any
other model by torch's tracer (`traced`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from launcher.parallel.pipeline.given import PipelineInput
from launcher.parallel.pipeline.hf_plan import hf_plan
from launcher.parallel.pipeline.hf_stages import cut_by_plan, router
from launcher.parallel.pipeline.stages import StageModules
from launcher.parallel.pipeline.tied import check_schedule
from launcher.parallel.pipeline.traced import cut


def cut_model(
    model: nn.Module,
    points: list[str],
    given: PipelineInput,
    rows: int,
    indices: list[int],
    autocast: Callable[[], Any],
    schedule: str,
    run: bool = True,
) -> StageModules:
    """The stages in `indices` of `model` (whole), beginning at `points`, with example
    activations of a micro-batch of `rows` samples of the example batch (`run`: false
    skips them where it can, for a memory estimate that needs only the modules). `given`'s
    hooks are complete (`causal_lm.complete_hooks`)."""
    assert given.split is not None
    inputs, _ = given.split(given.example)
    plan = hf_plan(model)
    if plan is None:
        example = tuple(first_rows(value, rows) for value in inputs)
        stages = cut(model, points, example, indices, autocast)
    else:
        args, by_name = router(model)(inputs)
        micro = (
            tuple(first_rows(value, rows) for value in args),
            {key: first_rows(value, rows) for key, value in by_name.items()},
        )
        check_schedule(plan.tied_to_last, schedule, type(model).__name__)
        stages = cut_by_plan(model, plan, points, micro if run else None, indices, autocast)
    stages.points = points
    stages.total_params = sum(p.numel() for p in model.parameters())
    return stages


def first_rows(value: Any, rows: int) -> Any:
    return value[:rows] if isinstance(value, torch.Tensor) else value
