"""What a mixture-of-experts model's router did, step by step: how evenly its experts were
loaded, and its auxiliary (load-balancing) loss apart from the main loss.

Read from hooks, so that no recipe changes: each experts module (the model's expert plan,
`launcher.parallel.experts`) is called with every token's chosen experts
(`forward(hidden_states, top_k_index, top_k_weights)`, transformers' contract), counted here
before expert parallelism sends the tokens away; and a Hugging Face MoE model's output carries
`aux_loss` where its config asks for it (`output_router_logits`), already added to its loss
times `router_aux_loss_coef`.

- `experts/imbalance`: the busiest expert's tokens over the mean expert's (1: even), the
  worst layer's; a mean over the micro-batches and the ranks.
- `aux_loss`: the model's own, unscaled.

transformers' experts run every token they are sent (no capacity), so none are dropped.
Recomputed activations (activation checkpointing) count their tokens twice, which the ratio
does not see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from launcher.parallel.experts import expert_plan
from launcher.parallel.wrapper_names import bare_model

IMBALANCE = "experts/imbalance"
AUX_LOSS = "aux_loss"
# The warning: the busiest expert of a layer takes at least twice its share of the tokens
# for this many steps in a row.
WARN_IMBALANCE = 2.0
WARN_AFTER_STEPS = 10

LossOf = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]


class ExpertLoad:
    """Counts the tokens each expert of `model` takes (hooks on its experts modules), and
    keeps its output's `aux_loss`."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], experts: int) -> None:
        self.experts = experts
        self._counts: list[torch.Tensor | None] = [None] * len(modules)
        self._aux: torch.Tensor | None = None
        self._hot_steps = 0  # steps in a row over WARN_IMBALANCE
        for layer, module in enumerate(modules):
            module.register_forward_pre_hook(self._counter(layer), with_kwargs=True)
        model.register_forward_hook(self._keep_aux)

    @classmethod
    def attach(cls, model: nn.Module) -> ExpertLoad | None:
        """Hooks on `model`'s experts (inside the launcher's wrappers: DDP's); None where it
        has none."""
        model = bare_model(model)
        plan = expert_plan(model)
        if plan is None:
            return None
        return cls(model, [model.get_submodule(name) for name in plan.modules], plan.experts)

    def _counter(self, layer: int) -> Callable[..., None]:
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            chosen = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if not isinstance(chosen, torch.Tensor):
                return
            chosen = chosen.detach().reshape(-1).long()
            # Ids outside the experts (a skipped slot) go to one more bucket, left out: a
            # fixed size, so the count never waits for the device (bincount's size would).
            outside = (chosen < 0) | (chosen >= self.experts)
            chosen = torch.where(outside, self.experts, chosen)
            tokens = torch.zeros(self.experts + 1, dtype=torch.long, device=chosen.device)
            tokens = tokens.scatter_add_(0, chosen, torch.ones_like(chosen))[: self.experts]
            before = self._counts[layer]
            self._counts[layer] = tokens if before is None else before + tokens

        return count

    def _keep_aux(self, module: nn.Module, args: tuple, output: Any) -> None:
        aux = getattr(output, AUX_LOSS, None)
        if isinstance(aux, torch.Tensor):
            self._aux = aux.detach()

    def take(self) -> dict[str, torch.Tensor]:
        """The figures of the forwards since the last call (a micro-batch's), and a clean slate."""
        figures: dict[str, torch.Tensor] = {}
        counted = [c.float() for c in self._counts if c is not None]
        if counted:
            loads = torch.stack(counted)
            imbalance = loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9)
            figures[IMBALANCE] = imbalance.max()
        if self._aux is not None:
            figures[AUX_LOSS] = self._aux
        self._counts = [None] * len(self._counts)
        self._aux = None
        return figures

    def around(self, loss_of: LossOf) -> LossOf:
        """`loss_of` with this model's figures added to its metrics."""

        def with_load(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            self.take()  # what forwards outside training (an evaluation) counted
            loss, metrics = loss_of(model, batch)
            return loss, {**self.take(), **metrics}

        return with_load

    def warning(self, mean: dict[str, float], steps: int) -> str | None:
        """A warning once the experts' load has stayed uneven for WARN_AFTER_STEPS steps
        (said once per such stretch); `mean`: a logged window's figures over `steps` steps."""
        imbalance = mean.get(IMBALANCE)
        if imbalance is None or imbalance < WARN_IMBALANCE:
            self._hot_steps = 0
            return None
        before, self._hot_steps = self._hot_steps, self._hot_steps + steps
        if before >= WARN_AFTER_STEPS or self._hot_steps < WARN_AFTER_STEPS:
            return None
        return (
            f"the router sends one expert {imbalance:.1f}x the mean expert's tokens "
            f"({IMBALANCE}) for {self._hot_steps} steps: most tokens go to few experts, whose "
            "capacity the others' idle weights do not add to. A larger load-balancing loss "
            "(the model's router_aux_loss_coef) spreads them."
        )
