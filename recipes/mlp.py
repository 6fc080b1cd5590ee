"""Quickstart recipe: an MLP regressing a fixed nonlinear function of generated inputs.

Everything is generated from seeded ``torch.Generator`` objects, so the data is identical on
every rank and every run without any download. Small enough to train in seconds on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

# Added to the dataset seed so val inputs differ from train inputs while the target
# function (drawn from the seed alone) stays the same for both splits.
_SPLIT_OFFSET = {"train": 1, "val": 2}


def build_dataset(
    split: str, n_samples: int = 4096, in_dim: int = 16, noise: float = 0.01, seed: int = 0
) -> TensorDataset:
    """Generated regression data: ``TensorDataset(x[n, in_dim], y[n, 1])``.

    Args:
        split: "train" or "val"; the splits share the target function but not the inputs.
        n_samples: number of (x, y) pairs.
        in_dim: input features; must match the model's ``in_dim``.
        noise: standard deviation of Gaussian noise added to the targets.
        seed: seeds both the target function and the inputs.
    """
    if split not in _SPLIT_OFFSET:
        raise ValueError(f"split: expected one of {sorted(_SPLIT_OFFSET)}, got {split!r}")
    target_gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(in_dim, 1, generator=target_gen)
    data_gen = torch.Generator().manual_seed(seed * 1000 + _SPLIT_OFFSET[split])
    x = torch.randn(n_samples, in_dim, generator=data_gen)
    # Scale so z ~ N(0, 1) whatever in_dim is; tanh keeps the target learnable but not linear.
    z = x @ weight / math.sqrt(in_dim)
    y = z + torch.tanh(2.0 * z) + noise * torch.randn(n_samples, 1, generator=data_gen)
    return TensorDataset(x, y)


def build_model(in_dim: int = 16, hidden: int = 64, depth: int = 2, out_dim: int = 1) -> nn.Module:
    """An MLP with ``depth`` hidden layers of width ``hidden`` and GELU activations.

    ``out_dim`` must stay 1 to match the dataset targets; it exists for reuse elsewhere.
    """
    if depth < 1:
        raise ValueError(f"depth: expected >= 1, got {depth}")
    layers: list[nn.Module] = []
    width = in_dim
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.GELU()]
        width = hidden
    layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Mean squared error, plus mean absolute error as an extra metric."""
    x, y = batch
    pred = model(x)
    mse = F.mse_loss(pred, y)
    return mse, {"mae": (pred - y).abs().mean().detach()}
