"""The hand-written peer of `parallel.pp` (bench/dims_overhead.py's pp row): what a careful user
writes with torch.distributed.pipelining alone, run by bench/handwritten_ddp.py --fsdp --pp N.

The GPT recipe's model, initialised as the launcher initialises it, cut at its middle block by
torch's tracer (`pipeline()`), each stage's blocks and root sharded with `fully_shard` over the
data axis, run by `Schedule1F1B`; the gradient norm summed over the stages before clipping.
torch's stages are given their input and output shapes (their inference at the first step
runs `autograd.grad`, which FSDP's hooks refuse), as the launcher gives them.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, SplitPoint, pipeline

from recipes import gpt


def build_stage(
    model: torch.nn.Module, args: argparse.Namespace, example: torch.Tensor
) -> tuple[Any, torch.nn.Module, Any, bool, int]:
    """(the schedule, this rank's stage module, the pp group, whether it is the last stage,
    the global rank that holds the last stage)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // args.pp
    mesh = init_device_mesh("cpu", (args.pp, dp), mesh_dim_names=("pp", "dp_shard"))
    stage_index = rank // dp
    split = {
        f"blocks.{args.n_layer // args.pp * i}": SplitPoint.BEGINNING for i in range(1, args.pp)
    }
    micro = example[: args.batch_size // args.pp_microbatches]
    pipe = pipeline(model, mb_args=(micro,), split_spec=split)
    shapes, inputs = [], (micro,)
    with torch.no_grad():
        for i in range(pipe.num_stages):
            out = pipe.get_stage_module(i)(*inputs)
            shapes.append((inputs, (out,)))
            inputs = (out,)
    module = pipe.get_stage_module(stage_index)
    for name, child in module.named_modules():
        if name.count(".") == 1 and name.startswith("blocks."):
            fully_shard(child, mesh=mesh["dp_shard"])
    fully_shard(module, mesh=mesh["dp_shard"])
    stage_in, stage_out = shapes[stage_index]
    stage = PipelineStage(
        module, stage_index, args.pp, torch.device("cpu"), group=mesh["pp"].get_group(),
        input_args=tuple(torch.empty_like(t).requires_grad_(stage_index > 0 and t.is_floating_point()) for t in stage_in),
        output_args=tuple(torch.empty_like(t).requires_grad_(True) for t in stage_out),
    )  # fmt: skip

    schedule = Schedule1F1B(
        stage, n_microbatches=args.pp_microbatches, loss_fn=gpt.loss_from_output
    )
    last = stage_index == args.pp - 1
    return schedule, module, mesh["pp"].get_group(), last, (args.pp - 1) * dp + rank % dp


def train_steps(
    args: argparse.Namespace, model: torch.nn.Module, batches: Any, example: torch.Tensor
) -> tuple[list[float], torch.Tensor, float]:
    """`args.steps` steps of the pipeline: each step's time, the sum of the step losses, and
    when the first step ended (unix time)."""
    schedule, module, pp_group, last, last_rank = build_stage(model, args, example)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    first = dist.get_rank() < dist.get_world_size() // args.pp
    step_times, loss_sum, first_end = [], torch.zeros(()), 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        x, y = next(batches)
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        loss = torch.stack(losses).mean().detach() if last else torch.zeros(())
        dist.broadcast(loss, src=last_rank, group=pp_group)
        loss_sum += loss
        if args.clip is not None:
            clip_over_stages(module, args.clip, pp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        first_end = first_end or time.time()
    return step_times, loss_sum, first_end


def clip_over_stages(module: torch.nn.Module, max_norm: float, pp_group: Any) -> None:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads).full_tensor()
    squares = local.square()
    dist.all_reduce(squares, group=pp_group)
    torch.nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, squares.sqrt())
