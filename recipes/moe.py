"""A mixture of experts of the recipe's own (no Hugging Face model), regressing the mlp
recipe's data: what a model needs for `parallel.ep` to spread its experts.

The contract (docs/fsdp-and-parallelism.md, 'Expert parallelism'), transformers' own:
- the model says which modules are experts in `ep_plan`, with `*` for layer numbers:
  `ep_dispatch_experts` for an experts module, `grouped_gemm` for each of its weights;
- each expert weight is stacked, `[num_experts, ...]`, and the experts module has
  `num_experts`;
- the module is called as `experts(tokens [T, H], top_k_index [T, k], top_k_weights [T, k])`
  and returns `[T, H]`: each token's chosen experts, weighted and summed. Under expert
  parallelism it is called with this process's experts alone, numbered from 0.

    recipe: {source: recipes/moe.py}
    launch: {strategy: fsdp, devices: 2}
    parallel: {ep: 2}
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from mlp import build_dataset  # noqa: F401 (a sibling: the launcher puts this folder on sys.path)
from torch import nn


class Experts(nn.Module):
    """`num_experts` two-layer MLPs, their weights stacked."""

    def __init__(self, num_experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, inner, hidden) / hidden**0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden, inner) / inner**0.5)

    def forward(
        self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for expert in range(self.num_experts):  # ids past num_experts: another process's
            token, slot = torch.where(top_k_index == expert)
            hidden = F.gelu(F.linear(tokens[token], self.w_in[expert]))
            y = F.linear(hidden, self.w_out[expert]) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, 2 * hidden)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weights, chosen = torch.topk(self.router(h).softmax(dim=-1), self.top_k, dim=-1)
        return x + self.experts(h, chosen, weights / weights.sum(dim=-1, keepdim=True))


class MoERegressor(nn.Module):
    # The experts, for parallel.ep (transformers' style names).
    ep_plan: ClassVar[dict[str, str]] = {
        "blocks.*.experts": "ep_dispatch_experts",
        "blocks.*.experts.w_in": "grouped_gemm",
        "blocks.*.experts.w_out": "grouped_gemm",
    }

    def __init__(self, in_dim: int, hidden: int, depth: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleList(MoEBlock(hidden, experts, top_k) for _ in range(depth))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(
    in_dim: int = 16, hidden: int = 32, depth: int = 2, experts: int = 4, top_k: int = 2
) -> nn.Module:
    """`depth` residual blocks of `experts` experts each, `top_k` per sample."""
    return MoERegressor(in_dim, hidden, depth, experts, top_k)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
