"""What `train validate` checks against the model as the run builds it, in the `train` process:
the weights `load.weights` loads into it, the optimizer over its parameter groups, its
tensor-parallel split (its pipeline stages: `pipeline_check.py`). Each
refuses, naming the key, what the run would fail on.

Like `recipe_check.py`, it calls the workers' code in the launcher's process only.
"""

from __future__ import annotations

import re
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launcher.config.spec import LoadSection, OptimSection, RunSpec
from launcher.errors import UsageError
from launcher.parallel.base import map_tensors
from launcher.parallel.tensor_parallel import apply_tensor_parallel
from launcher.worker.optim import build_optimizer
from launcher.worker.param_groups import Grouping
from launcher.worker.recipe import Recipe, users_traceback


def weights_fit(load: LoadSection, model: nn.Module) -> str:
    """`load.weights` found, readable, and with the names and shapes of `model`'s state dict
    (refused otherwise, as rank 0 refuses them at the start of the run); its line of the
    summary."""
    from launcher.checkpoint.weights import match_model
    from launcher.checkpoint.weights_source import KEY, check_weights
    from launcher.storage_url import location

    assert load.weights is not None
    match = match_model(check_weights(location(load.weights, what=KEY)), model, load.strict)
    n = len(match.pairs)
    line = f"{KEY}: {n} tensor{'s' if n != 1 else ''} fit"
    if match.problems:
        line += f", {len(match.problems)} names do not (load.strict: false)"
    return line


def optimizer_builds(optim: OptimSection, grouping: Grouping) -> None:
    """The optimizer, built as the worker builds it over the same groups, on one-element
    stand-ins of the parameters: what it refuses (LBFGS, several groups) is refused here."""
    build_optimizer(optim, stand_in_groups(grouping.torch_groups()), device_type="cpu")


def stand_in_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`groups` with each parameter replaced by a one-element CPU tensor of its dtype: no
    memory for a model on the meta device, and the groups' structure and settings kept."""
    return [
        {
            **group,
            "params": [torch.zeros(1, dtype=p.dtype, requires_grad=True) for p in group["params"]],
        }
        for group in groups
    ]


def tensor_parallel_split(
    model: nn.Module, recipe: Recipe, spec: RunSpec, batch: Any
) -> str | None:
    """`model`, built on the meta device and not yet split, split over a fake `tp` mesh by the
    plan the run applies (in place: the caller has no use for it after), and the recipe's loss
    run on it and `batch`: a split the model cannot take (more processes than attention heads)
    fails in that loss, and is refused naming `parallel.tp`. Returns why the split could not be
    checked (None: checked)."""
    from torch.distributed.device_mesh import init_device_mesh

    from launcher.parallel.memory_estimate import fake_process_group

    tp = spec.parallel.tp
    # The model may be built before the process group: building a module asks nothing of
    # torch.distributed; the mesh, the split and the DTensors' ops in the loss do.
    with fake_process_group(tp), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DTensor's and FSDP's warnings are the run's to give
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        _split(model, mesh, recipe)
        try:
            recipe.loss(model, map_tensors(batch, lambda t: t.to("meta")))
        except Exception as exc:
            unchecked = meta_limit(exc)
            if unchecked:
                return unchecked
            raise _split_refused(tp, exc) from None
    return None


def _split(model: nn.Module, mesh: Any, recipe: Recipe) -> None:
    try:
        apply_tensor_parallel(model, mesh, recipe.parallelize_hook())
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(
            "recipe: parallelize(model, mesh) failed on the model built on the meta device:",
            details=[users_traceback(exc)],
        ) from None


def _split_refused(tp: int, exc: Exception) -> UsageError:
    text = str(exc).strip()
    said = text.splitlines()[0][:200] if text else type(exc).__name__
    return UsageError(
        f"parallel.tp: {tp}: the model split over {tp} processes fails in loss(model, batch): "
        f"{said}",
        details=[users_traceback(exc)],
        hint="Each process must hold whole attention heads, and a whole part of every split "
        "layer: set parallel.tp to a divisor of the model's heads (and key-value heads), or "
        "change the model. train validate ran the split on the meta device.",
    )


def meta_limit(exc: Exception) -> str | None:
    """Why an op cannot run on the meta device, where that is what `exc` says (an op without
    a meta kernel, or one that reads values: `.item()`, a boolean mask); None where `exc` is
    the recipe's own error."""
    text = str(exc)
    if not isinstance(exc, NotImplementedError) and "meta" not in text:
        # A meta kernel stricter than the device's (torch 2.13's grouped_mm takes bf16 alone
        # on meta, fp32 on CPU, as transformers' experts run it): not the recipe's error.
        kernel = _meta_kernel_of(exc)
        if kernel is None:
            return None
        return f"it cannot run on the meta device: {kernel} refuses what the device runs"
    op = re.search(r"aten::\w+|torch\.\w+\(\)|Tensor\.\w+\(\)", text)
    found = op.group(0) if op else text.splitlines()[0][:80] if text else type(exc).__name__
    return f"it cannot run on the meta device: {found}"


def _meta_kernel_of(exc: Exception) -> str | None:
    """The meta kernel of torch's that raised `exc` (`torch/_meta_registrations.py`), if one did."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename)
        if path.name == "_meta_registrations.py" and path.parent.name == "torch":
            return frame.name.removeprefix("_meta_").removesuffix("_common")
    return None
