"""The hand-written peer of `parallel.ep` on a Hugging Face mixture of experts
(bench/hf_experts.py): what a careful user writes with `transformers`' own expert parallelism
and FSDP2.

recipes/hf_causal_lm.py's Qwen3-MoE, initialised as the launcher initialises it, on
`transformers`' own meshes (`initialize_distributed_mesh` of a `DistributedConfig(fsdp_size=2,
ep_size=2)`: a dense mesh whose `fsdp` axis spans both processes, an expert mesh of `efsdp` 1 x
`ep` 2). `apply_expert_parallelism` spreads each layer's experts over `ep` (half of every
stacked expert tensor on each process, tokens sent to their expert by all-to-all); then FSDP2
as transformers' `apply_fully_sharded_data_parallelism` lays it out, by hand: each experts
module over `efsdp`, its gradients divided by every data rank (an expert's gradient sums the
tokens both processes sent it), then each decoder layer and the root over `fsdp`. AdamW, the
gradient norm over both meshes, each process its own share of the batches:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \\
        bench/handwritten_hf_ep.py --steps 40 --out /tmp/hf_ep.json

Rank 0 writes {"steps_run", "first_step_end_unix", "step_times_s", "final_loss", "losses",
"peak_rss_bytes", "state_bytes"} to --out: the launcher's summary.json format (the loss: the mean
over the processes, as the launcher logs it), every step's loss, and rank 0's peak RSS and
bytes of parameters, gradients and optimizer state (its shards).
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Iterable

import hf_peer
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel
from transformers.distributed import DistributedConfig
from transformers.distributed.expert_parallel import apply_expert_parallelism
from transformers.distributed.utils import initialize_distributed_mesh


def parse_args() -> argparse.Namespace:
    parser = hf_peer.parser(__doc__, batch_help="each process's", layers=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--aux-loss-coef", type=float, default=0.01)
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> PreTrainedModel:
    """The recipe's Qwen3-MoE with the weights the launcher gives it, in training mode."""
    model = hf_peer.build_model(
        args, "qwen3_moe", experts=args.experts, top_k=args.top_k, aux_loss_coef=args.aux_loss_coef
    )
    return model.train()


def parallelize(model: PreTrainedModel) -> None:
    """Experts over `ep` (transformers), then FSDP2 as transformers' own FSDP applies it."""
    config = DistributedConfig(fsdp_size=dist.get_world_size(), ep_size=dist.get_world_size())
    _, meshes = initialize_distributed_mesh(config)
    plan = model._expand_parallel_plan(model.ep_plan)
    # The dispatch's second mesh is the group of ranks sharing a batch: `tp`, of 1.
    apply_expert_parallelism(model, meshes.get_mesh("ep"), meshes.get_mesh("tp"), plan)
    experts = [model.get_submodule(name) for name, s in plan.items() if s == "ep_dispatch_experts"]
    for module in experts:  # first: FSDP shards a module's children before it
        fully_shard(module, mesh=meshes.get_mesh("efsdp"), reshard_after_forward=True)
        # Each expert saw the tokens of every data rank: divide by all of them.
        module.set_gradient_divide_factor(float(config.dp_size))
        if config.efsdp_size > 1:  # gloo has no PREMUL_SUM; without a reduce-scatter, none
            module.set_force_sum_reduction_for_comms(True)
    dense = meshes.get_mesh("fsdp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=dense, reshard_after_forward=True)
    fully_shard(model, mesh=dense, reshard_after_forward=True)


def clip_over_meshes(params: list[nn.Parameter], max_norm: float) -> None:
    """torch's clip with the norm of every gradient: torch's own norm refuses gradients on
    two meshes (the experts' and the dense weights'), so each mesh's norm is made whole
    (`full_tensor`) and the two added in squares."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(grads).full_tensor() for grads in by_mesh.values()]
    total = torch.stack(norms).square().sum().sqrt()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in by_mesh.values():
        torch._foreach_mul_([g.to_local() for g in grads], coefficient)


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this process holds of `tensors`: a DTensor's local shard."""
    shards = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in shards)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This process's parameters, gradients and optimizer state (less the scalar step)."""
    moments = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {
        "params": local_bytes(model.parameters()),
        "grads": local_bytes(p.grad for p in model.parameters()),
        "optimizer": local_bytes(moments),
    }


def train(args: argparse.Namespace) -> dict:
    """Every step's time and loss (the mean over the processes), when the first ended, and
    this process's state bytes at the end (gradients kept: they are a step's peak)."""
    model = build_model(args)
    parallelize(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    feed = hf_peer.batches(args, dist.get_world_size(), dist.get_rank())
    step_times, losses, first_end, state = [], [], 0.0, {}
    for step in range(args.steps):
        start = time.perf_counter()
        loss = model(**next(feed)).loss  # the aux loss included: output_router_logits
        loss.backward()
        clip_over_meshes(params, args.clip)
        optimizer.step()
        if step == args.steps - 1:
            state = state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        step_times.append(time.perf_counter() - start)
        losses.append(mean.item() / dist.get_world_size())
        first_end = first_end or time.time()
    return {"step_times_s": step_times, "losses": losses, "first_end": first_end, **state}


def written(ran: dict) -> dict:
    """The summary rank 0 writes: the launcher's format, every step's loss, and this process's
    peak RSS and bytes of state."""
    return {
        **hf_peer.summary(ran["step_times_s"], ran["losses"], ran["first_end"]),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "state_bytes": {k: ran[k] for k in ("params", "grads", "optimizer")},
    }


def main() -> None:
    args = parse_args()
    hf_peer.run(lambda: written(train(args)), args.out)


if __name__ == "__main__":
    main()
