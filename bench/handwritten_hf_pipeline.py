"""The hand-written peer of `parallel.pp` on a Hugging Face model (bench/hf_pipeline.py): what a
careful user writes with `transformers`' own pipeline split and torch.distributed.pipelining.

recipes/hf_causal_lm.py's Llama, initialised as the launcher initialises it, pruned on each
rank by `transformers.distributed.pipeline_parallel.apply_pipeline_parallelism` (identity
layers for the other rank's layers, embedding and head). transformers runs the stages itself
only naively, one after another and forward only (its send is not autograd-aware), so the
stages are wrapped for torch's `PipelineStage` (the first: token ids to the base model's hidden
states; the last: hidden states as `inputs_embeds` to logits) and run by `ScheduleGPipe`; the
loss is the model's own `loss_function`, the gradient norm is summed over the stages before
clipping. One pipeline, one process a stage:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        bench/handwritten_hf_pipeline.py --steps 60 --out /tmp/hf_pp.json

Rank 0 writes {"steps_run", "first_step_end_unix", "step_times_s", "final_loss", "losses"} to
--out: the launcher's summary.json format (final_loss: the last step's, as the launcher's with
`train.log_every: 1`), and every step's loss.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import hf_peer
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from transformers import PreTrainedModel
from transformers.distributed.pipeline_parallel import apply_pipeline_parallelism


def parse_args() -> argparse.Namespace:
    parser = hf_peer.parser(__doc__, batch_help="a step's, before micro-batches", layers=8)
    parser.add_argument("--microbatches", type=int, default=2)
    return parser.parse_args()


class FirstStage(nn.Module):
    """Token ids to the hidden states after this rank's layers (the final norm is pruned to
    an identity here), as transformers' own forward sends them on."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        base = getattr(self.model, self.model.base_model_prefix)
        return base(input_ids=input_ids, use_cache=False).last_hidden_state


class LastStage(nn.Module):
    """Received hidden states, as `inputs_embeds`, to logits, by the causal LM's own forward
    (transformers' wrapper around it would receive and broadcast by itself)."""

    def __init__(self, model: PreTrainedModel, causal_lm_forward: Callable[..., Any]) -> None:
        super().__init__()
        self.model, self.causal_lm_forward = model, causal_lm_forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.causal_lm_forward(inputs_embeds=hidden, use_cache=False).logits


def build_schedule(
    args: argparse.Namespace, model: PreTrainedModel
) -> tuple[ScheduleGPipe, nn.Module]:
    """This rank's pruned stage in a GPipe schedule; and the stage module, for its optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    causal_lm_forward = model.forward  # before transformers wraps it in its naive forward
    apply_pipeline_parallelism(model, init_device_mesh("cpu", (world,), mesh_dim_names=("pp",)))
    last = rank == world - 1
    module = LastStage(model, causal_lm_forward) if last else FirstStage(model)
    rows = args.batch_size // args.microbatches
    hidden = torch.empty(rows, args.seq_len, args.hidden)
    ids = torch.empty(rows, args.seq_len, dtype=torch.long)
    logits = torch.empty(rows, args.seq_len, args.vocab_size)
    stage = PipelineStage(
        module, rank, world, torch.device("cpu"),
        input_args=(hidden.requires_grad_(True) if rank > 0 else ids,),
        output_args=((logits if last else hidden.clone()).requires_grad_(True),),
    )  # fmt: skip
    vocab = model.config.vocab_size

    def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=output, labels=labels, vocab_size=vocab)

    return ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=loss_fn), module


def clip_over_stages(module: nn.Module, max_norm: float) -> None:
    """torch's clip, with the norm of every stage's gradients together."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    squares = torch.nn.utils.get_total_norm(grads).square()
    dist.all_reduce(squares)
    torch.nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, squares.sqrt())


def train(args: argparse.Namespace) -> tuple[list[float], list[float], float]:
    """Every step's time and loss (the last stage's, on every rank), and when the first ended."""
    schedule, module = build_schedule(args, hf_peer.build_model(args, "llama"))
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    first, last = dist.get_rank() == 0, dist.get_rank() == dist.get_world_size() - 1
    feed = hf_peer.batches(args)
    step_times, losses, first_end = [], [], 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        batch = next(feed)
        said: list[torch.Tensor] = []
        schedule.step(
            *((batch["input_ids"],) if first else ()),
            target=batch["labels"] if last else None,
            losses=said,
        )
        loss = torch.stack(said).mean().detach() if last else torch.zeros(())
        dist.broadcast(loss, src=dist.get_world_size() - 1)
        clip_over_stages(module, args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        losses.append(loss.item())
        first_end = first_end or time.time()
    return step_times, losses, first_end


def main() -> None:
    args = parse_args()
    hf_peer.run(lambda: hf_peer.summary(*train(args)), args.out)


if __name__ == "__main__":
    main()
