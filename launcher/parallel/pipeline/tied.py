"""Parameters that stages on different processes of one pipeline both hold: a language
model's input embedding tied to its output head (GPT-2, Gemma, small Llamas and Qwens), on
the first stage and the last.

The tie is kept: each holder computes its part of the gradient, the parts are summed over the
holders before the norm and the optimizer's step, so each takes the same step from the same
gradient and the weight stays one value (one name in the checkpoint, the embedding's). The
norm counts each tied gradient once, on its first holder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from launcher.errors import UsageError
from launcher.parallel.dims import ParallelDims
from launcher.parallel.pipeline.layout import DOCS, stage_indices


@dataclass
class TiedGradients:
    """This process's tied parameters (by name) and the group of processes that hold each."""

    groups: dict[str, Any]  # name -> the process group of its holders
    counted: set[str]  # the names whose gradient this process counts in the norm

    def sum(self, model: nn.Module) -> None:
        """Each tied gradient summed over its holders (in place)."""
        params = dict(model.named_parameters())
        for name, group in self.groups.items():
            param = params[name]
            if param.grad is None:  # no part here this step: the holders' sum is the others'
                param.grad = torch.zeros_like(param)
            dist.all_reduce(_local(param.grad), op=dist.ReduceOp.SUM, group=group)

    def uncounted(self, model: nn.Module) -> set[int]:
        """The ids of the parameters whose gradients another process counts in the norm."""
        params = dict(model.named_parameters())
        return {id(params[name]) for name in self.groups if name not in self.counted}


def tie_groups(
    shared: dict[str, list[int]], dims: ParallelDims, rank: int, schedule: str
) -> TiedGradients:
    """The groups that sum the gradients of `shared` (parameters several stages hold, with
    their stages). Collective: every process makes every group, in the same order."""
    pp, per_stage = dims.pp, dims.world // dims.pp
    holder_of = {stage: r for r in range(pp) for stage in stage_indices(r, pp, schedule)}
    mine = dims.pp_rank(rank)
    groups: dict[str, Any] = {}
    counted: set[str] = set()
    made: dict[tuple[int, ...], Any] = {}
    for name, stages in shared.items():
        holders = tuple(sorted({holder_of[stage] for stage in stages}))
        if len(holders) < 2:
            continue  # every stage that holds it is this process's: one gradient already
        if holders not in made:
            for position in range(per_stage):  # one group for each pipeline
                group = dist.new_group([position + r * per_stage for r in holders])
                if rank % per_stage == position:
                    made[holders] = group
        if mine in holders:
            groups[name] = made[holders]
            if mine == holders[0]:
                counted.add(name)
    return TiedGradients(groups, counted)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's local part: the same shard on every holder (their stages are sharded
    alike over the same data axes)."""
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def check_schedule(tied: list[str], schedule: str, model: str) -> None:
    """A UsageError where `schedule` cannot keep the tie of `tied` (the first-stage modules a
    last stage's head shares a weight with): ZBVZeroBubble holds the first and the last stage
    in one process and computes weight gradients apart, which sums the tied weight's two parts
    wrong (tests/parallel/test_pipeline_hf.py)."""
    if tied and schedule == "ZBVZeroBubble":
        raise UsageError(
            f"parallel.pp_schedule: ZBVZeroBubble cannot keep {model}'s head tied to "
            f"{', '.join(tied)}: the first and last stages share a process, whose weight "
            "gradients it computes apart",
            hint="Use Interleaved1F1B (two stages a process too), or build the model with "
            f"tie_word_embeddings=False to untie it ({DOCS}).",
        )
