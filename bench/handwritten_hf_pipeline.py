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
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader, DistributedSampler
from transformers import PreTrainedModel
from transformers.distributed.pipeline_parallel import apply_pipeline_parallelism

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
import hf_causal_lm


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=8, help="a step's, before micro-batches")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="the global gradient norm")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
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


def build_model(args: argparse.Namespace) -> PreTrainedModel:
    """The recipe's Llama with the weights the launcher gives it: the constructors from the
    seed, then the model's own init from the seed once more (`init_hf_weights`)."""
    torch.manual_seed(args.seed)
    model = hf_causal_lm.build_model(
        family="llama", vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers,
        heads=args.heads, kv_heads=args.kv_heads,
    )  # fmt: skip
    # post_init marks every module initialised, after which init_weights would draw nothing.
    for owner in itertools.chain(model.modules(), model.parameters(), model.buffers()):
        vars(owner).pop("_is_hf_initialized", None)
    torch.manual_seed(args.seed)
    model.init_weights()
    return model


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


def batches(args: argparse.Namespace) -> Iterator[dict[str, torch.Tensor]]:
    """The recipe's train split as the launcher feeds one data-parallel rank: shuffled by the
    run's seed, epoch after epoch."""
    dataset = hf_causal_lm.build_dataset("train", seq_len=args.seq_len, vocab_size=args.vocab_size)
    sampler = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def clip_over_stages(module: nn.Module, max_norm: float) -> None:
    """torch's clip, with the norm of every stage's gradients together."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    squares = torch.nn.utils.get_total_norm(grads).square()
    dist.all_reduce(squares)
    torch.nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, squares.sqrt())


def train(args: argparse.Namespace) -> tuple[list[float], list[float], float]:
    """Every step's time and loss (the last stage's, on every rank), and when the first ended."""
    schedule, module = build_schedule(args, build_model(args))
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    first, last = dist.get_rank() == 0, dist.get_rank() == dist.get_world_size() - 1
    feed = batches(args)
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
    dist.init_process_group("gloo")
    step_times, losses, first_end = train(args)
    if dist.get_rank() == 0:
        summary = {
            "final_loss": losses[-1],
            "steps_run": len(step_times),
            "first_step_end_unix": first_end,
            "step_times_s": step_times,
            "losses": losses,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary))
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        sys.exit("run this under torchrun; see the module docstring")
    main()
