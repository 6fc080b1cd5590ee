"""The hand-written torchrun DDP baseline that the launcher is benchmarked against.

This is what a careful user writes without a launcher: the same recipe (recipes/gpt.py),
plain DDP over gloo, a DistributedSampler, AdamW, and nothing else in the loop. With `--fsdp`,
FSDP2 instead (`fully_shard` on each Block, then the root), and with `--clip`, torch's
`clip_grad_norm_` before each step (the fsdp benchmark). Under `--fsdp`, `--dp-replicate R`
is HSDP (`fully_shard` over a 2-D (dp_replicate, dp_shard) mesh), and `--tp T` tensor
parallelism (the recipe's `parallelize_module` plan over a `tp` axis, then `fully_shard` over
`dp_shard`; the T processes of a group read the same batch), and `--pp P` a pipeline of P
stages (bench/handwritten_pipeline.py) (bench/dims_overhead.py). On a GPU (`--device cuda`, nccl):
`--precision bf16` autocast, `--no-ddp` for a plain model, `--compile` (torch.compile of the
model) and `--fused` AdamW, the fastest loop a user writes by hand (bench/gpu_bench.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/handwritten_ddp.py \\
        --steps 50 --out /tmp/handwritten.json

Rank 0 writes {"steps_run", "first_step_end_unix", "step_times_s", "final_loss"} to --out,
the same format the launcher's worker writes to RUN_DIR/summary.json (final_loss: the mean loss
over every step and rank, as the launcher's with `train.log_every` = the steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes import gpt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--max-bytes", type=int, default=gpt.DEFAULT_MAX_BYTES)
    parser.add_argument("--fsdp", action="store_true", help="fully_shard instead of DDP")
    parser.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this")
    parser.add_argument("--dp-replicate", type=int, default=1, help="fsdp: HSDP's replicas")
    parser.add_argument("--tp", type=int, default=1, help="fsdp: tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="fsdp: pipeline stages (1F1B)")
    parser.add_argument("--pp-microbatches", type=int, default=2, help="fsdp: with --pp")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--param-dtype", choices=["bf16"], default=None, help="fsdp's")
    parser.add_argument("--no-ddp", action="store_true", help="one process, no wrapper")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--fused", action="store_true", help="fused AdamW")
    # Diagnoses of the fsdp gap (bench/gpu_bench.py --diagnose): one of the launcher's
    # differences at a time, added to this loop.
    parser.add_argument("--meta-init", action="store_true", help="fsdp: build on meta, to_empty")
    parser.add_argument("--launcher-norm", action="store_true", help="the launcher's grad norm")
    parser.add_argument("--profile-steps", type=int, default=0, help="trace the last N steps")
    parser.add_argument("--trace", type=Path, help="rank 0's Chrome trace (--profile-steps)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if (args.dp_replicate > 1 or args.tp > 1) and not args.fsdp:
        parser.error("--dp-replicate and --tp shard the model: they need --fsdp")
    if args.dp_replicate > 1 and args.tp > 1:
        parser.error("--dp-replicate and --tp: one at a time")
    return args


def main() -> None:
    args = parse_args()
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)

    with torch.device("meta" if args.meta_init else "cpu"):
        model = gpt.build_model(
            vocab_size=args.vocab_size,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
    if not args.meta_init:
        # The recipe's init_weights from the seed once more, as the launcher initialises a
        # model: the constructors' own draws before it shifted the generator. Both loops then
        # start from the same weights, so their losses compare.
        torch.manual_seed(args.seed)
        model.init_weights()
        model.to(device)
    if args.compile:
        model.compile()
    # The processes of a tensor-parallel group (consecutive ranks) share one data-parallel rank;
    # so do the stages of a pipeline (the outermost axis).
    dp_rank, dp_size = rank // args.tp, dist.get_world_size() // args.tp
    if args.pp > 1:
        dp_size = dist.get_world_size() // args.pp
        dp_rank = rank % dp_size
    elif args.fsdp:
        shard(model, args, device)
    elif not args.no_ddp:
        model = DDP(model, device_ids=[device.index] if cuda else None)
    dataset = gpt.build_dataset("train", block_size=args.block_size, max_bytes=args.max_bytes)
    sampler = DistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=0,
        drop_last=True,
        pin_memory=cuda,
    )
    fused = {"fused": True} if args.fused else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, **fused)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    if args.pp > 1:  # bench/handwritten_pipeline.py's loop, with the same data
        from handwritten_pipeline import train_steps

        example = next(iter(loader))[0]
        step_times, loss_sum, first_step_end_unix = train_steps(
            args, model, endless(loader, sampler), example
        )
        finish(args, step_times, loss_sum, first_step_end_unix, cuda)
        return
    epoch = 0
    sampler.set_epoch(epoch)
    batches = iter(loader)
    step_times: list[float] = []
    loss_sum = torch.zeros((), device=device)
    first_step_end_unix = None
    profiler = None
    for step in range(args.steps):
        if step == args.steps - args.profile_steps and rank == 0 and args.trace:
            profiler = start_profile(cuda)
        start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            batch = next(batches)
        batch = [t.to(device, non_blocking=cuda) for t in batch]
        with autocast:
            loss = gpt.loss(model, batch)
        loss.backward()
        loss_sum += loss.detach()
        if args.launcher_norm:
            from launcher.parallel.grad_norm import gradient_norm

            gradient_norm(model, args.clip)
        elif args.clip is not None and args.tp > 1:
            clip_over_meshes(model, args.clip)
        elif args.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        step_times.append(time.perf_counter() - start)
        if first_step_end_unix is None:
            first_step_end_unix = time.time()
        optimizer.zero_grad(set_to_none=True)
    if profiler is not None:
        if cuda:
            torch.cuda.synchronize(device)
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(str(args.trace))

    finish(args, step_times, loss_sum, first_step_end_unix, cuda)


def endless(loader: DataLoader, sampler: DistributedSampler) -> Iterator[list[torch.Tensor]]:
    """The loader's batches, epoch after epoch, as the loop above takes them."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def finish(
    args: argparse.Namespace,
    step_times: list[float],
    loss_sum: torch.Tensor,
    first_step_end_unix: float | None,
    cuda: bool,
) -> None:
    """Rank 0's summary (--out), the same format the launcher's worker writes."""
    rank = dist.get_rank()
    dist.all_reduce(loss_sum)  # the sum over every rank; each of a tp group has the same loss
    final_loss = loss_sum.item() / (len(step_times) * dist.get_world_size())
    if rank == 0:
        summary = {
            "final_loss": final_loss,
            "steps_run": len(step_times),
            "first_step_end_unix": first_step_end_unix,
            "step_times_s": step_times,
            **(
                {"max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
                if cuda
                else {}
            ),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary))
        median_ms = 1000 * statistics.median(step_times)
        print(
            f"{len(step_times)} steps, median {median_ms:.1f} ms/step, mean loss {final_loss:.4f}"
        )
    dist.destroy_process_group()


def shard(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> None:
    """FSDP2 in place: `fully_shard` on each Block, then the root; over a 2-D mesh for HSDP,
    and after the recipe's tensor-parallel plan with `--tp`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    mesh = None  # fully_shard's default: one axis over the world
    if args.dp_replicate > 1:
        shape = (args.dp_replicate, world // args.dp_replicate)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    elif args.tp > 1:
        shape = (world // args.tp, args.tp)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp_shard", "tp"))
        gpt.parallelize(model, mesh["tp"])
        mesh = mesh["dp_shard"]
    dtype = torch.bfloat16 if args.param_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if args.meta_init:
        model.to_empty(device=device)
        model.init_weights()


def clip_over_meshes(model: torch.nn.Module, max_norm: float) -> None:
    """torch's `clip_grad_norm_`, for gradients on two meshes: it stacks the per-tensor norms,
    which must share one mesh, but under tensor parallelism the split matmuls' gradients are on
    (dp_shard, tp) and the whole layers' (embeddings, layer norms) on dp_shard alone. So the
    norm of each mesh's gradients is taken apart, then combined."""
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh, []).append(param)
    norms = [
        torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
        for params in by_mesh.values()
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def start_profile(cuda: bool) -> torch.profiler.profile:
    """The launcher's `train.profile` settings, so that the two traces compare."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    started = profile(activities=activities, record_shapes=True, profile_memory=True)
    started.__enter__()
    return started


if __name__ == "__main__":
    if "LOCAL_RANK" not in os.environ:
        sys.exit("run this under torchrun; see the module docstring")
    main()
