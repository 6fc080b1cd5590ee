"""Tensor parallelism: each matmul of the model split over the processes of a `tp` mesh axis,
by a plan of DTensor parallel styles (torch's `parallelize_module`).

The plan is the recipe's own (`parallelize(model, mesh)`), else a Hugging Face model's
(`model.tp_plan`: its config's `base_model_tp_plan` under the base model's prefix, plus the
head's), translated from transformers' style names to torch's. A model with neither is
refused before anything is sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from launcher.errors import UsageError

ParallelizeHook = Callable[[nn.Module, Any], Any]


def apply_tensor_parallel(model: nn.Module, mesh: Any, hook: ParallelizeHook | None) -> str:
    """Splits `model` over `mesh` (the 1-D `tp` axis) in place; returns where the plan came
    from, for the start of the run's log."""
    if hook is not None:
        hook(model, mesh)
        return "the recipe's parallelize(model, mesh)"
    plan = check_plan(model, hook, mesh.size())
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, plan)
    return f"{type(model).__name__}'s own tp_plan ({len(plan)} entries)"


def check_plan(model: nn.Module, hook: ParallelizeHook | None, tp: int) -> dict[str, Any]:
    """The Hugging Face plan `model` would be split by where there is no `hook` (empty where
    there is one); a `UsageError` where there is neither, or where `tp` does not divide the
    model's heads (`train validate` asks too)."""
    if hook is not None:
        return {}
    plan = hugging_face_plan(model)
    if plan is None:
        raise UsageError(
            f"parallel.tp: {tp} needs a plan that says how to split "
            f"{type(model).__name__}'s layers, and it has none",
            hint="Give the recipe a parallelize(model, mesh) that calls torch's "
            "parallelize_module(model, mesh, plan) (docs/fsdp-and-parallelism.md, 'Tensor parallelism'), or "
            "set parallel.tp: 1.",
        )
    _check_heads(model, tp)
    return plan


# A transformers config's numbers of heads: an attention layer split by its plan reshapes each
# process's part into whole heads.
_HEADS = {"num_attention_heads": "attention heads", "num_key_value_heads": "key-value heads"}


def _check_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for key, noun in _HEADS.items():
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise UsageError(
                f"parallel.tp: {tp} processes cannot split {type(model).__name__}'s {heads} "
                f"{noun} ({key}): each process must hold whole heads",
                hint=f"Set parallel.tp to a divisor of {heads}.",
            )


def hugging_face_plan(model: nn.Module) -> dict[str, Any] | None:
    """A transformers model's tensor-parallel plan as torch parallel styles; None where the
    model has none."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return None
    _check_untied(model, plan)
    return {path: _torch_style(path, style) for path, style in plan.items()}


def _torch_style(path: str, style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # transformers' names (4.x and 5.x) for the styles torch has.
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    if style not in styles:
        raise UsageError(
            f"parallel.tp: the model's tp_plan splits {path} as {style!r}, a style of "
            "transformers' own that the launcher does not translate (it knows "
            f"{', '.join(sorted(styles))})",
            hint="Give the recipe a parallelize(model, mesh) with the plan you want.",
        )
    return styles[style]()


def _check_untied(model: nn.Module, plan: dict[str, str]) -> None:
    # A weight shared by two layers split two ways (an input embedding tied to the output
    # head) would be one tensor with two shardings.
    tied = getattr(model, "_tied_weights_keys", None)
    config = getattr(model, "config", None)
    if tied and getattr(config, "tie_word_embeddings", False):
        raise UsageError(
            f"parallel.tp: {type(model).__name__} ties its input embedding to its output head, "
            "which its tp_plan splits two different ways",
            hint="Build it with tie_word_embeddings=False, or give the recipe a "
            "parallelize(model, mesh) that leaves the tied layers whole.",
        )


__all__ = ["ParallelizeHook", "apply_tensor_parallel", "check_plan", "hugging_face_plan"]
