"""What `train validate` checks of a pipeline (`parallel.pp`) in the `train` process, as the
workers will run it: the recipe's hooks (or a causal LM's), the split points and the
micro-batches, at every launch; and, given a batch, the cut itself, with one forward and one
backward of every stage on the meta device. Each refuses, naming the key, what the run would
fail on.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launcher.cli.model_checks import meta_limit
from launcher.config.spec import RunSpec
from launcher.errors import UsageError
from launcher.parallel.base import map_tensors
from launcher.worker.recipe import Recipe


def pipeline_fits(spec: RunSpec, recipe: Recipe, model: nn.Module | None = None) -> str:
    """`parallel.pp`'s stages of the model (built on the meta device where not given): the
    recipe's hooks, the split points and the micro-batches, refused as the workers would
    refuse them; the line that says where the stages begin."""
    from launcher.parallel.pipeline.hf_plan import hf_plan
    from launcher.parallel.pipeline.layout import check_torch, microbatches, split_points
    from launcher.parallel.pipeline.tied import check_schedule
    from launcher.parallel.sharded_init import build_on_meta

    check_torch()
    section = spec.parallel
    micro = microbatches(section, spec.data.batch_size)
    if spec.train.precision == "fp16":
        raise UsageError(
            "train.precision: fp16 scales the loss before backward, which a pipeline's "
            "schedule runs itself (parallel.pp)",
            hint="Use bf16: it needs no loss scaling.",
        )
    if not spec.data.drop_last:
        raise UsageError(
            "data.drop_last: false gives a short last batch, but a pipeline's stages take "
            "micro-batches of one shape (parallel.pp)",
            hint="Set data.drop_last: true (evaluation still sees every sample).",
        )
    if model is None:
        model = build_on_meta(lambda: recipe.build_model(**spec.recipe.model))
    hooks_for(spec, recipe, model)
    plan = hf_plan(model)  # an encoder-decoder is refused here
    if plan is not None:
        check_schedule(plan.tied_to_last, section.pp_schedule, type(model).__name__)
    points = split_points(model, section, spec.fsdp.wrap)
    cut_by = f"cut by {plan.source}" if plan is not None else "cut by torch's tracer"
    return (
        f"parallel.pp: {len(points) + 1} stages ({section.pp_schedule}, {micro} micro-batches, "
        f"{cut_by}), beginning at {', '.join(points)}"
    )


def hooks_for(spec: RunSpec, recipe: Recipe, model: nn.Module, example: Any = None) -> Any:
    """The pipeline's hooks for `model`: the recipe's, and a Hugging Face causal LM's where
    the recipe has none; a UsageError where neither gives them."""
    from launcher.parallel.pipeline.causal_lm import complete_hooks
    from launcher.parallel.pipeline.given import PipelineInput

    hooks = recipe.pipeline_hooks()
    given = PipelineInput(
        hooks.split, hooks.loss_from_output, example, spec.data.batch_size,
        spec.train.grad_accum_steps, recipe.source,
    )  # fmt: skip
    return complete_hooks(given, model)


def stages_run(spec: RunSpec, recipe: Recipe, batch: Any) -> str | None:
    """The model cut as the run cuts it, then one forward and one backward of every stage on
    one micro-batch of `batch`, on fake tensors (shapes and dtypes, no memory): what fails
    there fails the run's first step, and is refused naming the stage and where it failed.
    Returns why the stages could not be run (None: they ran)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launcher.parallel.sharded_init import build_on_meta

    model = build_on_meta(lambda: recipe.build_model(**spec.recipe.model))
    stage = "the cut"
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model.to_empty(device="cpu")
            fake_batch = map_tensors(batch, fake.from_tensor)
            for name, run in _stage_runs(spec, recipe, model, fake_batch):
                stage = name  # for the refusal
                run()
    except UsageError:
        raise
    except Exception as exc:
        unchecked = meta_limit(exc) or _data_dependent(exc)
        if unchecked:
            return unchecked
        raise _stage_failed(stage, exc) from None
    return None


def _stage_runs(
    spec: RunSpec, recipe: Recipe, model: nn.Module, batch: Any
) -> Iterator[tuple[str, Callable[[], None]]]:
    """The cut (run as it is made), then each stage's forward and backward, named."""
    from launcher.parallel.pipeline.cut import cut_model, first_rows
    from launcher.parallel.pipeline.layout import microbatches, split_points

    given = hooks_for(spec, recipe, model, batch)
    points = split_points(model, spec.parallel, spec.fsdp.wrap)
    rows = spec.data.batch_size // microbatches(spec.parallel, spec.data.batch_size)
    indices = list(range(len(points) + 1))
    stages = cut_model(
        model, points, given, rows, indices, contextlib.nullcontext, spec.parallel.pp_schedule
    )
    inputs, targets = given.split(given.example)
    by_name = {key: first_rows(v, rows) for key, v in stages.route(inputs)[1].items()}
    targets = first_rows(targets, rows)
    for index, module in enumerate(stages.modules):
        last = index == stages.count - 1
        loss = (lambda out: given.loss_from_output(out, targets)) if last else None
        inputs = stages.examples[index][0]
        yield (
            f"stage {index} (from {stages.starts_of(index)})",
            functools.partial(_forward_backward, module, inputs, by_name, loss),
        )


def _data_dependent(exc: Exception) -> str | None:
    """Why a stage cannot run on fake tensors, where it reads values (`.item()`, a mask)."""
    name = type(exc).__name__
    if "DataDependent" in name or "DynamicOutputShape" in name:
        return f"it reads tensor values, which fake tensors do not have ({name})"
    return None


def _forward_backward(
    module: nn.Module,
    inputs: tuple[Any, ...],
    by_name: dict[str, Any],
    loss: Any,
) -> None:
    """One stage's forward, and its backward from `loss(output)` (the last stage) or from a
    gradient of its output's shape (the others: what the next stage sends back)."""
    taken = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    output = module(*taken, **by_name)
    if loss is not None:
        loss(output).backward()
        return
    outputs = output if isinstance(output, tuple) else (output,)
    carried = [o for o in outputs if o.requires_grad]
    torch.autograd.backward(carried, [torch.ones_like(o) for o in carried])


def _stage_failed(stage: str, exc: Exception) -> UsageError:
    text = str(exc).strip()
    said = text.splitlines()[0][:200] if text else type(exc).__name__
    said = said.replace("FakeTensor", "Tensor")  # the run's real tensors would say the same
    return UsageError(
        f"parallel.pp: {stage} fails on one micro-batch: {said} ({_where(exc)})",
        hint="train validate cut the model as the run does and ran each stage's forward and "
        "backward on fake tensors; docs/fsdp-and-parallelism.md, 'Pipeline parallelism' "
        "says which models the launcher cuts.",
    )


def _where(exc: BaseException) -> str:
    """The innermost frame outside torch and the launcher: the model's code that failed."""
    ours = (str(Path(__file__).parents[1]), str(Path(torch.__file__).parent))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(ours)]
    frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return f"in {frame.name}, {Path(frame.filename).name}:{frame.lineno}"
