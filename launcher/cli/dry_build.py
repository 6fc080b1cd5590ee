"""`train validate`'s dry build, in the `train` process: the datasets, one batch (collated by
the recipe's `collate`, if it has one), the model on the meta device, and the recipe's `loss` on
that model and batch, so a run fails here in seconds rather than in every rank later; what
depends on the model besides (`load.weights`, the optimizer, the tensor-parallel split) is
`model_checks.py`'s. The recipe is loaded and its arguments checked first (`recipe_check.py`).

Also the GPU launch's memory check (`gpu_memory_check`), which builds the same first batch.

Apart from `recipe_check.py` because a launch needs none of it: its imports (the memory
estimate's tracker, DTensor, the loader) would cost every `train` start about 0.5 s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

from launcher.cli.memory_check import estimate_for, estimate_line
from launcher.cli.model_checks import (
    meta_limit,
    optimizer_builds,
    tensor_parallel_split,
    weights_fit,
)
from launcher.cli.pipeline_check import pipeline_fits, stages_run
from launcher.cli.recipe_check import load_checked
from launcher.config.spec import RunSpec
from launcher.errors import UsageError
from launcher.parallel.base import map_tensors
from launcher.parallel.dims import resolve_dims
from launcher.parallel.experts import describe_experts
from launcher.parallel.memory_estimate import MemoryEstimate
from launcher.parallel.sharded_init import MetaBuildFailed, build_on_meta
from launcher.parallel.tensor_parallel import check_plan
from launcher.worker.data import (
    batch_size,
    build_loader,
    check_stream_limits,
    collate_fn,
    dataset_length,
    is_stream,
    steps_per_epoch,
)
from launcher.worker.evaluation import stream_eval_batches
from launcher.worker.loader_workers import checked_start
from launcher.worker.param_groups import group_parameters
from launcher.worker.recipe import Recipe, users_traceback


def dry_build(spec: RunSpec, origin: str = "") -> str:
    """Builds what a worker builds, without training: the train split and one batch of it,
    the val split when the run evaluates, and the model on the meta device (where the run
    builds it otherwise, for real); runs the recipe's loss on that model and batch, builds the
    optimizer over its groups, and matches `load.weights` and the tensor-parallel split
    against it (`launcher.cli.model_checks`). Returns a summary (parameters, samples), and on a
    second line the memory the layout needs per device; raises `UsageError` for what the run
    would fail on."""
    recipe = load_checked(spec, origin)
    model, on_meta, model_part = _model_summary(recipe, spec)
    grouping = group_parameters(spec.optim, model, recipe)  # a pattern that matches nothing
    optimizer_builds(spec.optim, grouping)
    if grouping.custom:
        model_part += f" in {len(grouping.groups)} optimizer groups"
    parts = [model_part]
    if spec.load.weights is not None:
        parts.append(weights_fit(spec.load, model))
    if spec.parallel.tp > 1:
        check_plan(model, recipe.parallelize_hook(), spec.parallel.tp)
    experts = describe_experts(model, spec.parallel.ep)
    if experts:
        parts.append(experts)
    if spec.parallel.pp > 1:
        parts.append(pipeline_fits(spec, recipe, model))
    fragments = spec.fault_tolerance.sync.fragments
    if fragments > 1:  # streaming DiLoCo: whole blocks in each fragment
        from launcher.replicas.fragments import block_count, describe_fragments, fragments_of

        cut = fragments_of(model, fragments, spec.fsdp.wrap)
        parts.append(describe_fragments(cut, block_count(model, spec.fsdp.wrap)))
    train_part, batch = _train_summary(recipe, spec)
    parts.append(train_part)
    if spec.eval.every_n_steps is not None:
        parts.append(_val_summary(recipe, spec))
    unchecked = _check_loss(recipe, model, batch) if on_meta else "the model was built on the CPU"
    if unchecked:
        parts.append(f"loss not checked ({unchecked})")
    elif spec.parallel.pp > 1:
        stages_unchecked = stages_run(spec, recipe, batch)
        if stages_unchecked:
            parts.append(f"parallel.pp stages not run ({stages_unchecked})")
    elif spec.parallel.tp > 1:
        split_unchecked = tensor_parallel_split(model, recipe, spec, batch)
        if split_unchecked:
            parts.append(f"parallel.tp split not checked ({split_unchecked})")
    devices = spec.launch.devices if isinstance(spec.launch.devices, int) else 1
    return " · ".join(parts) + "\n" + estimate_line(spec, recipe, batch, devices)


def _model_summary(recipe: Recipe, spec: RunSpec) -> tuple[torch.nn.Module, bool, str]:
    """The model, whether it is on the meta device, and its line of the summary. A model the
    meta device cannot build (a .item() in __init__) is built for real, as ddp and `fsdp.init:
    auto` build it; `fsdp.init: meta` refuses it, as the run would."""
    try:
        model, where = build_on_meta(lambda: recipe.build_model(**spec.recipe.model)), ""
    except MetaBuildFailed as failed:
        from launcher.parallel.fsdp import shards_the_model  # FSDP's import, for this case alone

        devices = spec.launch.devices if isinstance(spec.launch.devices, int) else 1
        # Where the run itself tries the meta device: fsdp that shards, unless told cpu.
        tries_meta = (
            spec.launch.strategy == "fsdp"
            and spec.fsdp.init != "cpu"
            and shards_the_model(spec.fsdp, devices)
        )
        if tries_meta and spec.fsdp.init == "meta":
            raise
        model = _user_call("recipe: build_model()", recipe.build_model, **spec.recipe.model)
        where = f" (built on the CPU: {failed.reason}" + (
            "; fsdp.init: auto builds it on CPU in every process)" if tries_meta else ")"
        )
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counts = f"{_count(total)} parameters, {_count(trainable)} trainable"
    return model, not where, f"model {type(model).__name__} {counts}{where}"


def _train_summary(recipe: Recipe, spec: RunSpec) -> tuple[str, Any]:
    """The train split's line of the summary, and its first batch, collated as the run will."""
    what = "recipe: build_dataset('train')"
    dataset = _user_call(what, recipe.build_dataset, "train", **spec.recipe.dataset)
    collate = recipe.collate_hook()
    # What the loader workers are sent, checked as their start will check it.
    checked_start(spec.data, {"the train dataset": dataset, "the recipe's collate": collate})
    if is_stream(dataset):
        check_stream_limits(spec.train)
        # A stream has no sampler: the workers read it in order, as this does.
        loader = DataLoader(
            dataset, batch_size=spec.data.batch_size, collate_fn=collate_fn(collate)
        )
        batch = _check_batch(loader, what)
        return f"train stream (no length; train.max_steps={spec.train.max_steps})", batch
    devices = spec.launch.devices if isinstance(spec.launch.devices, int) else 1
    # Each data-parallel rank takes its own batch; a tensor-parallel group shares one.
    ranks = resolve_dims(spec.parallel, spec.launch.strategy, devices, devices).dp_size
    # The workers' own loader, as data-parallel rank 0 sees it; worker processes would only
    # make this slower.
    data = spec.data.model_copy(update={"num_workers": 0})
    loader = build_loader(dataset, data, 0, ranks, spec.run.seed, False, collate=collate)
    batch = _check_batch(loader, what)
    steps = steps_per_epoch(len(loader), spec.train.grad_accum_steps)
    shape = f"{devices} device{'s' if devices > 1 else ''} x {spec.data.batch_size}"
    if ranks != devices:
        shape = f"{ranks} data-parallel ranks of {devices} devices x {spec.data.batch_size}"
    if spec.train.grad_accum_steps > 1:
        shape += f" x {spec.train.grad_accum_steps} micro-steps"
    size = dataset_length(dataset, "train")
    return f"train {size:,} samples ({steps:,} steps/epoch at {shape})", batch


def first_train_batch(recipe: Recipe, spec: RunSpec) -> Any:
    """The train split's first batch, as rank 0 gets it (`launcher.cli.memory_check`)."""
    return _train_summary(recipe, spec)[1]


def _val_summary(recipe: Recipe, spec: RunSpec) -> str:
    what = "recipe: build_dataset('val')"
    dataset = _user_call(what, recipe.build_dataset, "val", **spec.recipe.dataset)
    if is_stream(dataset):
        summary = f"val stream ({stream_eval_batches(spec.eval.max_batches)} batches)"
    else:
        summary = f"val {dataset_length(dataset, 'val'):,} samples"
    collate = collate_fn(recipe.collate_hook(), "val")
    checked_start(spec.data, {"the val dataset": dataset, "the recipe's collate": collate})
    _check_batch(DataLoader(dataset, batch_size=spec.data.batch_size, collate_fn=collate), what)
    return summary


def _check_batch(loader: Iterable[Any], what: str) -> Any:
    """One batch, collated as training collates it, must count its samples (`batch_size`)."""
    batch = _user_call(f"{what}: its first batch", lambda: next(iter(loader), None))
    if batch is None:
        raise UsageError(f"{what} gave no samples")
    batch_size(batch)
    return batch


def _check_loss(recipe: Recipe, model: torch.nn.Module, batch: Any) -> str | None:
    """Runs `loss(model, batch)` with the model and the batch on the meta device (nothing is
    computed, shapes and dtypes are): an error of the recipe's (a shape mismatch, a missing
    key) is refused as the run's first step would fail on it. Returns why the loss could not
    be checked, where an op of it cannot run on meta (None: checked)."""
    made_by = "the recipe's collate()" if recipe.collate_hook() else "torch's default_collate"
    what = f"recipe: loss(model, batch) failed on a train batch made by {made_by}"
    meta_batch = map_tensors(batch, lambda t: t.to("meta"))
    try:
        loss, _ = recipe.loss(model, meta_batch)
    except Exception as exc:
        unchecked = meta_limit(exc)
        if unchecked:
            return unchecked
        raise UsageError(
            f"{what}:",
            details=[users_traceback(exc)],
            hint="train validate ran it on the model and one batch on the meta device.",
        ) from None
    _check_loss_value(loss)
    return None


def _check_loss_value(loss: Any) -> None:
    """The loop backpropagates the loss: one number that depends on the weights."""
    if not isinstance(loss, torch.Tensor):
        raise UsageError(
            f"recipe: loss(model, batch) returned {type(loss).__name__}, not a tensor",
            hint="Return the loss tensor, or (loss, {name: value}).",
        )
    if loss.numel() != 1:
        raise UsageError(
            f"recipe: loss(model, batch) returned a tensor of shape {list(loss.shape)}; the "
            "loss must be one number",
            hint="Reduce it over the batch (.mean()).",
        )
    if not loss.requires_grad:
        raise UsageError(
            "recipe: loss(model, batch) returned a tensor that does not require grad: "
            "backward() cannot run on it",
            hint="Do not detach the loss or compute it under torch.no_grad().",
        )


def _user_call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(...)`; a failure of the user's code becomes a UsageError with their frames only."""
    try:
        return fn(*args, **kwargs)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{what} failed:", details=[users_traceback(exc)]) from None


def _count(n: int) -> str:
    if n < 100_000:
        return f"{n:,}"
    return f"{n / 1e6:.2f}M" if n < 1_000_000_000 else f"{n / 1e9:.2f}B"


def gpu_memory_check(
    spec: RunSpec, origin: str, world: int, per_node: int
) -> tuple[dict[str, int] | None, str | None]:
    """Before a GPU launch: the estimate (bytes by part, for summary.json beside the measured
    peak), and one line where it exceeds GPU 0's memory, naming a layout that would fit
    (`launcher.parallel.memory_fit`). None for either where there is nothing to say, or
    where the estimate cannot be made (the run then goes on as it would have)."""
    import torch

    from launcher.launch.reaper import children_reaped
    from launcher.parallel.memory_fit import fit_advice

    try:
        device_bytes = torch.cuda.get_device_properties(0).total_memory
        with children_reaped():  # what the recipe starts as it builds its dataset
            recipe = load_checked(spec, origin)
            estimate = estimate_for(spec, recipe, first_train_batch(recipe, spec), world, per_node)
    except Exception:  # the run itself reports a recipe's failures, with the rank's context
        return None, None
    if not isinstance(estimate, MemoryEstimate):
        return None, None
    parts = ("params", "grads", "optimizer", "activations", "peak")
    return {part: getattr(estimate, part) for part in parts}, fit_advice(estimate, device_bytes)
