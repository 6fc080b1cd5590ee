"""fsdp's gradient norm and clipping on local shards (one all-reduce) equal torch's
`clip_grad_norm_` over the DTensor gradients, on 2 real gloo processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from launcher.parallel.grad_norm import gradient_norm, sharded_norm
from tests.conftest import end_without_teardown, free_port


def _sharded_model_with_grads(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # Odd sizes: uneven shards, and a bias smaller than the world size on some rank.
    model = nn.Sequential(nn.Linear(7, 33), nn.GELU(), nn.Linear(33, 1)).to(dtype)
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(seed)  # the same on both ranks: each rank gets the same full batch
    model(torch.randn(16, 7, dtype=dtype)).float().square().mean().backward()
    return model


def _worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo")
    try:
        for max_norm in (None, 1e-3, 1e3):
            ours_model, torchs_model = _sharded_model_with_grads(1), _sharded_model_with_grads(1)
            ours = gradient_norm(ours_model, max_norm)
            torchs = torch.nn.utils.clip_grad_norm_(
                list(torchs_model.parameters()), max_norm if max_norm is not None else float("inf")
            ).full_tensor()
            assert not hasattr(ours, "full_tensor"), "a plain tensor, the same on every rank"
            torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=0)
            for a, b in zip(ours_model.parameters(), torchs_model.parameters(), strict=True):
                torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor())
        # Clipping really scaled (1e-3 is far below the norm), on the local-shard path.
        model = _sharded_model_with_grads(2)
        assert sharded_norm([p.grad for p in model.parameters()], None) is not None
        before = [p.grad.full_tensor().clone() for p in model.parameters()]
        norm = gradient_norm(model, 1e-3)
        after = [p.grad.full_tensor() for p in model.parameters()]
        assert norm > 1e-2
        scale = 1e-3 / (norm + 1e-6)
        for a, b in zip(before, after, strict=True):
            torch.testing.assert_close(a * scale, b)
        # bf16 gradients: torch sums the per-tensor bf16 norms in bf16, ours in fp32 (and
        # returns fp32): equal to bf16's precision, the clipped gradients too.
        ours_model = _sharded_model_with_grads(3, torch.bfloat16)
        torchs_model = _sharded_model_with_grads(3, torch.bfloat16)
        ours = gradient_norm(ours_model, 1e-3)
        torchs = torch.nn.utils.clip_grad_norm_(list(torchs_model.parameters()), 1e-3)
        torch.testing.assert_close(ours.to(torch.bfloat16), torchs.full_tensor())
        for a, b in zip(ours_model.parameters(), torchs_model.parameters(), strict=True):
            torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor())
    finally:
        dist.destroy_process_group()
    end_without_teardown()


@pytest.mark.timeout(120)
def test_the_sharded_norm_and_clip_are_torchs(tmp_path: Path) -> None:
    ctx = mp.start_processes(
        _worker, args=(free_port(),), nprocs=2, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=90):
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
