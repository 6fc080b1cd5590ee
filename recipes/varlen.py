"""Variable-length sequences: an LSTM regressing a property of token sequences of 2 to 24 tokens.

The example of a recipe's `collate(samples)`: every sample keeps its own length, and
`collate` pads each batch to its longest sequence and returns a mask of the real tokens,
which the model uses to pool over them alone. The data is generated from a seeded
``torch.Generator``, the same on every rank, and trains in seconds on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

PAD = 0  # the padding token; real tokens are 1 .. vocab-1
_SPLIT_SEED = {"train": 1, "val": 2}


class Sequences(Dataset):
    """`n` sequences of random tokens, each of its own length; the target of a sequence is
    its mean token, scaled to [0, 1], which depends on every token and on no padding."""

    def __init__(self, n: int, min_len: int, max_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
        self.sequences = [torch.randint(1, vocab, (int(k),), generator=g) for k in lengths]
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = self.sequences[i]
        target = (tokens.float().mean() - 1) / (self.vocab - 2)
        return {"tokens": tokens, "target": target.reshape(1)}


def build_dataset(
    split: str, n_samples: int = 2048, min_len: int = 2, max_len: int = 24, vocab: int = 32,
    seed: int = 0,
) -> Sequences:  # fmt: skip
    """Generated sequences; the splits share nothing but their lengths' range and vocabulary."""
    if split not in _SPLIT_SEED:
        raise ValueError(f"split: expected one of {sorted(_SPLIT_SEED)}, got {split!r}")
    return Sequences(n_samples, min_len, max_len, vocab, seed * 1000 + _SPLIT_SEED[split])


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch of samples of different lengths: tokens padded to the longest, and a mask
    that is True on the real tokens. Every tensor has one row per sample, which is how the
    launcher counts the batch's samples."""
    tokens = nn.utils.rnn.pad_sequence(
        [s["tokens"] for s in samples], batch_first=True, padding_value=PAD
    )
    return {
        "tokens": tokens,
        "mask": tokens != PAD,
        "target": torch.stack([s["target"] for s in samples]),
    }


class Regressor(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=PAD)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, 1)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The padding comes after each sequence's last token, so it never reaches the outputs
        # at real positions of this one-directional LSTM; the mask leaves it out of the mean.
        out, _ = self.lstm(self.embed(tokens))
        weights = mask.unsqueeze(-1).to(out.dtype)
        pooled = (out * weights).sum(dim=1) / weights.sum(dim=1)
        return self.head(pooled)


def build_model(vocab: int = 32, width: int = 32) -> nn.Module:
    """An embedding, one LSTM layer and a linear head over the mean of its real outputs."""
    return Regressor(vocab, width)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Mean squared error over the batch's sequences, plus the mean absolute error."""
    pred = model(batch["tokens"], batch["mask"])
    target = batch["target"]
    return F.mse_loss(pred, target), {"mae": (pred - target).abs().mean().detach()}
