"""What gradient clipping costs under FSDP2: torch's `clip_grad_norm_` over DTensor gradients
against the launcher's local-shard norm and clip (launcher/parallel/grad_norm.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/clip_cost.py

The GPT recipe with 12 blocks (149 gradient tensors, as the 86M model has) at a small width,
so that the per-tensor overhead shows rather than the arithmetic. Rank 0 prints the median
milliseconds per call of each and writes bench/results/clip_cost.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from launcher.parallel.grad_norm import gradient_norm  # noqa: E402
from recipes import gpt  # noqa: E402

CALLS = 50


def _model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = gpt.build_model(n_layer=12, n_head=4, n_embd=64, block_size=64)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x = torch.randint(0, 256, (4, 64))
    gpt.loss(model, (x, x)).backward()
    return model


def _median_ms(clip: object, model: torch.nn.Module) -> float:
    times = []
    for _ in range(CALLS):
        dist.barrier()
        start = time.perf_counter()
        clip(model)  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    dist.init_process_group("gloo")
    model = _model()
    n = sum(1 for p in model.parameters() if p.grad is not None)
    torchs = _median_ms(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0), model)
    ours = _median_ms(lambda m: gradient_norm(m, 1.0), model)
    if dist.get_rank() == 0:
        result = {"gradient_tensors": n, "torch_ms": torchs, "ours_ms": ours, "calls": CALLS}
        out = REPO / "bench" / "results" / "clip_cost.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print("| clip_grad_norm_(1.0), fsdp, 2 processes | ms per call |")
        print("|---|---:|")
        print(f"| torch, over {n} DTensor gradients | {torchs:.2f} |")
        print(f"| ours, local shards + one all-reduce | {ours:.2f} (x{torchs / ours:.1f} faster) |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
