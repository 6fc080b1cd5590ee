"""Gradient accumulation skips DDP's all-reduce on every micro-step but the last.

Runs the real training loop in 2 real gloo processes and counts the all-reduces DDP issues
through a communication hook.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from launcher.config.spec import RunSpec
from launcher.parallel.ddp import DDPStrategy
from launcher.worker.loop import Trainer
from launcher.worker.recipe import load_recipe
from tests.conftest import REPO, end_without_teardown, free_port

STEPS, ACCUM = 3, 4


class CountingDDP(DDPStrategy):
    calls = 0

    def wrap_model(self, model):  # type: ignore[no-untyped-def]
        ddp = super().wrap_model(model)

        def hook(state, bucket):  # type: ignore[no-untyped-def]
            CountingDDP.calls += 1
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, hook)
        return ddp


def _worker(rank: int, port: int, run_dir: str, accum: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    spec = RunSpec.model_validate(
        {
            "recipe": {"source": str(REPO / "recipes" / "mlp.py"), "dataset": {"n_samples": 256}},
            "data": {"batch_size": 4},
            "train": {"max_steps": STEPS, "grad_accum_steps": accum, "log_every": 100},
        }
    )
    strategy = CountingDDP("cpu", "fp32")
    strategy.setup()
    try:
        Trainer(spec, load_recipe(spec.recipe.source), strategy, Path(run_dir)).fit()
    finally:
        strategy.teardown()
    # The mlp's few parameters fit in one bucket: one all-reduce per synced backward.
    if CountingDDP.calls != STEPS:
        raise AssertionError(f"rank {rank}: {CountingDDP.calls} all-reduces for {STEPS} steps")
    end_without_teardown()  # DDP keeps the destroyed group and its threads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accum", [1, ACCUM])
def test_one_all_reduce_per_optimizer_step(tmp_path: Path, accum: int) -> None:
    ctx = mp.start_processes(
        _worker,
        args=(free_port(), str(tmp_path), accum),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    try:
        while not ctx.join(timeout=90):
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
