"""recipes/gpt.py with its cross entropy left eager on the GPU, as it was before issue 45: the
baseline of bench/gpu_bench.py's MFU rows, so that the fused one is measured against it on
the same card in the same call."""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

_spec = importlib.util.spec_from_file_location(
    "gpt_recipe", Path(__file__).resolve().parent.parent / "recipes" / "gpt.py"
)
assert _spec is not None and _spec.loader is not None
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
build_model, build_dataset, parallelize = gpt.build_model, gpt.build_dataset, gpt.parallelize


def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
