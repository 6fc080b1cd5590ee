"""The GPT recipe trained by PyTorch Lightning, for bench/gpu_bench.py's comparison.

    python bench/lightning_gpt.py --steps 60 --batch-size 16 --out /tmp/lightning.json

One device, bf16-mixed, AdamW (Lightning's defaults otherwise: its single-device strategy on
one GPU). Writes {"step_times_s", "max_memory_allocated_gib"} to --out, as the other loops do.
Each step is timed from the end of the one before (the first from the start of training), so
that it holds what the other loops time: fetching the batch, moving it to the device, the
forward and backward passes and the optimizer's step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes import gpt

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl  # type: ignore[no-redef]


class GPTModule(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = gpt.build_model(
            block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
        )
        self.step_times: list[float] = []
        self._last_end = 0.0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return gpt.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)

    def on_train_start(self) -> None:
        self._last_end = time.perf_counter()

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self._last_end)
        self._last_end = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("steps", 60), ("batch-size", 16), ("n-layer", 12), ("n-head", 12)):
        parser.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("n-embd", 768), ("block-size", 1024)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--max-bytes", type=int, default=gpt.DEFAULT_MAX_BYTES)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    module = GPTModule(args)
    dataset = gpt.build_dataset("train", block_size=args.block_size, max_bytes=args.max_bytes)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    cuda = args.device == "cuda"
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    args.out.write_text(
        json.dumps({"step_times_s": module.step_times, "max_memory_allocated_gib": memory})
    )


if __name__ == "__main__":
    main()
