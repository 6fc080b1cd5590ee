"""A Hugging Face GPT-2 (`transformers`), built from a config (no download), learning to count.

Needs `pip install transformers`. Batches are dicts, as Hugging Face models take them:

    recipe: {source: recipes/hf_gpt2.py, model: {n_layer: 4}}
    launch: {strategy: fsdp}
    fsdp: {wrap: [GPT2Block]}     # the default too: GPT-2's own _no_split_modules
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel


def build_model(
    vocab_size: int = 64,
    n_positions: int = 64,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 2,
    dropout: float = 0.0,
) -> GPT2LMHeadModel:
    """GPT-2 with its own initialisation (residual projections at std 0.02 / sqrt(2 n_layer)),
    which the launcher runs after seeding, under ddp and fsdp alike."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class Counting(Dataset):
    """Token sequences that count up from a random start, modulo the vocabulary: a task a
    small model learns in a few dozen steps, generated, so there is nothing to download."""

    def __init__(self, n_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(vocab_size, (n_samples,), generator=g)
        self.seq_len, self.vocab_size = seq_len, vocab_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (self.starts[i] + torch.arange(self.seq_len)) % self.vocab_size
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself


def build_dataset(
    split: str, n_samples: int = 1024, seq_len: int = 32, vocab_size: int = 64
) -> Counting:
    return Counting(n_samples, seq_len, vocab_size, seed=0 if split == "train" else 1)


def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own next-token cross entropy."""
    return model(**batch).loss
