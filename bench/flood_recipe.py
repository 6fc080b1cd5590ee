"""A recipe that floods its output: every rank prints `lines` lines of 80 characters while it
builds its model, then trains a tiny model. Used by bench/log_flood.py and the log-stream
tests.

Run as a script (`torchrun --nproc-per-node 2 --tee 3 bench/flood_recipe.py LINES`), it does
the same by hand: joins a gloo group, prints the same lines, and trains the same model 2 steps
under DDP. That is the baseline the launcher's log stream is measured against.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

_step_sleep = 0.0


def line(rank: int, i: int) -> str:
    """The i-th line rank `rank` prints (80 characters)."""
    return f"flood rank {rank} line {i:07d} " + "x" * 55


def flood(rank: int, lines: int) -> None:
    for i in range(lines):
        print(line(rank, i))
    sys.stdout.flush()


def build_model(
    lines: int = 50_000, crash_rank: int = -1, marker_dir: str = "", step_sleep: float = 0.0
) -> nn.Module:
    """Prints the flood; then, with `marker_dir`, says so with a file; `crash_rank` raises
    right after its flood; `step_sleep` slows every step (to stop a run in the middle)."""
    global _step_sleep
    _step_sleep = step_sleep
    rank = int(os.environ.get("RANK", "0"))
    flood(rank, lines)
    if marker_dir:
        (Path(marker_dir) / f"flooded-{rank}").touch()
    if rank == crash_rank:
        raise RuntimeError(f"rank {rank} crashes right after its flood")
    return nn.Linear(4, 1)


def build_dataset(split: str, n_samples: int = 256) -> TensorDataset:
    x = torch.randn(n_samples, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    if _step_sleep:
        time.sleep(_step_sleep)
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _by_hand(lines: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(build_model(lines))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = build_dataset("train")[:8]
    for _ in range(2):
        loss(model, (x, y)).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()  # nobody leaves the group while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    _by_hand(int(sys.argv[1]))
