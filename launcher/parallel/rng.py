"""Seeding, saving and restoring every random number generator a training process uses.

Two seeds per run: every process builds the model's weights and the datasets from `run.seed`
itself (`launcher.parallel.weight_init`), so replicas start identical; then each trains from
`rank_seed(run.seed, dp_rank)`, so that data-parallel ranks draw different dropout masks and
augmentations, while the processes of one tensor-parallel group, which share a batch, draw the
same ones. DataLoader workers are seeded apart (`launcher.worker.data`), also per data-parallel
rank.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seeds python's `random`, numpy's global generator and torch's (CPU and every CUDA
    device) with `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rank_seed(seed: int, dp_rank: int, reseeded_at: int = 0) -> int:
    """The seed of data-parallel rank `dp_rank`'s training streams in a run seeded `seed`
    (from step `reseeded_at` on, where a resume could not continue the saved streams).

    numpy's `SeedSequence` hashes the pair, so the streams of ranks 0, 1, ... are independent
    of each other, of the streams of runs seeded `seed + 1`, ... (`seed + rank` would give run
    1's rank 0 the streams of run 0's rank 1), and of the stream the weights were drawn from.
    A 63-bit value: what torch, numpy (`seed_everything` reduces it) and XLA take."""
    key = (dp_rank, reseeded_at) if reseeded_at else (dp_rank,)
    sequence = np.random.SeedSequence(seed % 2**64, spawn_key=key)  # a negative seed too
    return int(sequence.generate_state(1, np.uint64)[0] >> 1)


class RandomStreams:
    """Every random number generator a training process uses: python's `random`, numpy's
    global generator and torch's (CPU and every CUDA device). A backend with a generator of
    its own (XLA's) extends it (`Strategy.rng`)."""

    def seed(self, seed: int) -> None:
        """Seeds every generator with `seed`."""
        seed_everything(seed)

    def state(self) -> dict[str, Any]:
        """Every generator's state, as values `torch.load(weights_only=True)` accepts."""
        version, mt, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": [version, list(mt), gauss],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Every generator back to `state` (what `state` returned)."""
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
