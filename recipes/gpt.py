"""A small byte-level GPT (nanoGPT-style) trained on the Python standard library's source.

The text is the ``.py`` files of the running interpreter's stdlib, so it needs no download;
it differs between Python versions, but is fixed for one installation. Tokens are raw bytes
(vocab 256).

Model sizes through ``recipe.model`` kwargs (parameters counted by ``GPT.num_params``):

- default (n_layer=4, n_embd=128, block_size=128): ~0.9M, for tests and CPU runs.
- n_layer=12, n_head=12, n_embd=768, block_size=256: ~85M.
- n_layer=14, n_head=12, n_embd=768, block_size=256: ~100M.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

DEFAULT_MAX_BYTES = 8_000_000
_TRAIN_FRACTION = 0.9
# Third-party code lives under the stdlib directory in some installs (pyenv, venvs built
# in place); it would make the text depend on what happens to be installed.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@functools.cache
def _stdlib_tokens(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the stdlib's ``.py`` files, sorted by relative path.

    Cached so that building train and val (or rebuilding on restart) reads the disk once.
    """
    root = sysconfig.get_paths()["stdlib"]
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        rel_paths += [os.path.normpath(os.path.join(rel_dir, f)) for f in filenames]
    # Sort on "/"-separated paths so the order does not depend on os.walk or the OS.
    rel_paths = sorted((p for p in rel_paths if p.endswith(".py")), key=lambda p: p.split(os.sep))
    chunks, total = [], 0
    for rel in rel_paths:
        with open(os.path.join(root, rel), "rb") as f:
            chunks.append(f.read(max_bytes - total))
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class ByteChunks(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes, split into (input, next-byte target)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size
        # Each item needs one extra byte for the target of its last position.
        self.n_items = (len(tokens) - 1) // block_size

    def __len__(self) -> int:
        return self.n_items

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n_items:
            raise IndexError(f"item {i} out of range for {self.n_items} items")
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def build_dataset(
    split: str, block_size: int = 128, max_bytes: int = DEFAULT_MAX_BYTES
) -> ByteChunks:
    """Byte chunks of stdlib source; items are ``(x, y)`` int64 tensors of length ``block_size``.

    Args:
        split: "train" (the first 90% of the text) or "val" (the last 10%).
        block_size: tokens per item; must not exceed the model's ``block_size``.
        max_bytes: cap on the text read from disk, before the train/val split.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split: expected 'train' or 'val', got {split!r}")
    tokens = _stdlib_tokens(max_bytes)
    cut = int(len(tokens) * _TRAIN_FRACTION)
    dataset = ByteChunks(tokens[:cut] if split == "train" else tokens[cut:], block_size)
    if len(dataset) == 0:
        raise ValueError(
            f"dataset.max_bytes={max_bytes} leaves no {split} item of block_size={block_size}"
        )
    return dataset


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj.is_residual_proj = True
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # qkv's outputs are laid out head by head ([q k v] of head 0, then of head 1, ...), and
        # the number of heads is read from them: under tensor parallelism each process holds
        # whole heads of its own (`parallelize`).
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)
        q, k, v = (part.transpose(1, 2) for part in qkv.unbind(dim=3))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.proj.is_residual_proj = True
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block. FSDP strategies shard the model per ``Block``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx[B, T])`` returns logits ``[B, T, vocab_size]``.

    The lm_head is not tied to the token embedding, so every parameter belongs to exactly
    one module and sharding needs no special case. There are no buffers: ``to_empty()``
    followed by ``init_weights()`` fully materialises a model built on the meta device.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
        bias: bool,
    ) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}")
        self.block_size = block_size
        self.n_layer = n_layer
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter in place (GPT-2 scheme), drawing from torch's RNG."""
        # Residual projections add into the stream once per block and layer, so GPT-2 scales
        # them down to keep the residual's variance independent of depth.
        resid_std = 0.02 / math.sqrt(2 * self.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = resid_std if getattr(module, "is_residual_proj", False) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(
    vocab_size: int = 256,
    block_size: int = 128,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    dropout: float = 0.0,
    bias: bool = True,
) -> GPT:
    """A ``GPT``.

    Args:
        vocab_size: 256 for the byte-level dataset.
        block_size: maximum sequence length (size of the position embedding).
        n_layer: number of transformer ``Block`` s.
        n_head: attention heads; must divide ``n_embd``.
        n_embd: width of the residual stream.
        dropout: dropout probability on embeddings, attention and residual branches.
        bias: whether Linear and LayerNorm layers have biases.
    """
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)


def parallelize(model: GPT, mesh: object) -> None:
    """Tensor parallelism (`parallel.tp`), Megatron's split: each block's attention heads and
    MLP columns divided among the processes of `mesh`, whose outputs an all-reduce sums after
    each block's second matmul; the head gathers the full logits. Embeddings and layer norms
    stay whole on every process."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "blocks.*.attn.qkv": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, plan)  # type: ignore[arg-type]


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-byte cross entropy over every position of the batch."""
    inputs, targets = split_batch(batch)
    return loss_from_output(model(inputs), targets)


def split_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What of a batch the model takes, and what its output is compared with: a pipeline
    (`parallel.pp`) feeds the first to its first stage and the second to the loss."""
    return batch


def loss_from_output(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of the model's output: under a pipeline, computed on its last stage."""
    return cross_entropy(logits.flatten(0, 1), targets.flatten())


# On a GPU the cross entropy is one compiled (fused) kernel each way: eager, autocast casts the
# bf16 logits to fp32 and log_softmax writes them again, which at GPT-2's 50,304-wide vocabulary
# took 18% of an H100 step outside any compiled region (BENCHMARKS.md). Compiled, forward reads
# the bf16 logits once and backward writes their gradient in bf16. On CPU it stays eager: the
# tests' tiny models gain nothing from a compilation.
def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.is_cuda:
        return _fused_cross_entropy()(logits, targets)
    return F.cross_entropy(logits, targets)


@functools.cache
def _fused_cross_entropy() -> Callable[..., torch.Tensor]:
    return torch.compile(F.cross_entropy)  # on first use: importing torch._dynamo takes time
