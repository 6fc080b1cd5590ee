"""How a training step runs: a part the strategy holds (`Strategy.steps`), chosen once from
the run's layout (`launcher.parallel.dims`), so that neither the loop nor a strategy asks it
again at every step.

- `PlainSteps`: the model's forward under autocast, the precision's backward, and the
  backend's gradient finishing and buffer broadcast, which each backend hands in as small
  values (torch.distributed: nothing to reduce, buffers broadcast by `dist`; `xla`:
  `xm.reduce_gradients` and `xm.collective_broadcast`; `xla_spmd`: neither, the compiler
  reduces and every buffer is one global tensor).
- `PipelinedSteps` (`parallel.pp > 1`): a step's micro-batches through this process's stages
  by torch's schedule (`launcher.parallel.pipeline.runner.Pipeline`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from launcher.parallel.grad_norm import gradient_norm, pipeline_norm
from launcher.parallel.precision import MixedPrecision

if TYPE_CHECKING:  # the pipeline's modules are imported only where a run has stages
    from launcher.parallel.pipeline.runner import Pipeline

# The recipe's hooks, as the loop hands them in.
LossOf = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, Any]]]
Evaluate = Callable[[nn.Module, Any], dict[str, Any]]


class StepRunner(ABC):
    """The shape of one training step, and what an evaluation and a save ask of it."""

    @abstractmethod
    def forward_backward(
        self, model: nn.Module, batch: Any, loss_of: LossOf, accum: int
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-batch's forward (`loss_of(model, batch)`: the recipe's loss and metrics)
        and backward, its loss divided by `accum` (the micro-batches of a step) for the
        gradients; returns the loss and metrics."""

    @abstractmethod
    def evaluate_batch(self, model: nn.Module, batch: Any, evaluate: Evaluate) -> dict[str, Any]:
        """One evaluation batch's metrics (`evaluate(model, batch)`, the recipe's), under
        autocast, and no_grad where the caller set it."""

    @abstractmethod
    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor | None:
        """Makes the step's gradients final (reduced where the backend does it here, unscaled,
        clipped to `max_norm` when set) and returns their global norm, on the device. None
        where a loss scaler owns overflowing gradients and skips those steps itself."""

    @abstractmethod
    def agree_buffers(self, model: nn.Module) -> None:
        """Makes every replica's buffers (BatchNorm's running statistics) rank 0's, before
        anything reads them: an evaluation, a save. Replicas update their own from their own
        batches; a backend that keeps them equal itself does nothing here."""


class PlainSteps(StepRunner):
    """A step on the whole model: what every backend runs without pipeline stages.

    `reduce_gradients(optimizer)`: where the backend reduces the gradients itself, before
    they are unscaled and clipped (`xla`'s `xm.reduce_gradients`); None where its wrapper or
    compiler already did. `broadcast_buffers(buffers)`: rank 0's buffers to every replica, by
    the backend's collective; None where there is nothing to agree (one replica, or SPMD)."""

    def __init__(
        self,
        precision: MixedPrecision,
        reduce_gradients: Callable[[torch.optim.Optimizer], None] | None = None,
        broadcast_buffers: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        self.precision = precision
        self.reduce_gradients = reduce_gradients
        self.broadcast_buffers = broadcast_buffers

    def forward_backward(
        self, model: nn.Module, batch: Any, loss_of: LossOf, accum: int
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        with self.precision.autocast():
            loss, metrics = loss_of(model, batch)
        self.precision.backward(loss / accum if accum > 1 else loss)
        return loss, metrics

    def evaluate_batch(self, model: nn.Module, batch: Any, evaluate: Evaluate) -> dict[str, Any]:
        with self.precision.autocast():
            return evaluate(model, batch)

    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor | None:
        if self.reduce_gradients is not None:
            self.reduce_gradients(optimizer)
        self.precision.unscale(optimizer)  # the norm is of the true gradients
        norm = gradient_norm(model, max_norm)
        # fp16's scaler skips the steps whose gradients overflowed: not a failure of the run.
        return None if self.precision.scaler else norm

    def agree_buffers(self, model: nn.Module) -> None:
        buffers = list(model.buffers())
        if self.broadcast_buffers is not None and buffers:
            self.broadcast_buffers(buffers)


class PipelinedSteps(StepRunner):
    """A step through this process's pipeline stages: the schedule runs every micro-batch's
    forward and backward, and the loss comes out of the last stage."""

    def __init__(self, pipeline: Pipeline, precision: MixedPrecision) -> None:
        self.pipeline = pipeline
        self.precision = precision

    def forward_backward(
        self, model: nn.Module, batch: Any, loss_of: LossOf, accum: int
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        # The loss comes from the recipe's `loss_from_output`, which the pipeline was given,
        # divided by `accum` there; a schedule gives no metrics but the loss.
        with self.precision.autocast():
            return self.pipeline.step(batch), {}

    def evaluate_batch(self, model: nn.Module, batch: Any, evaluate: Evaluate) -> dict[str, Any]:
        # The schedule's forward gives the loss alone.
        with self.precision.autocast():
            return {"loss": self.pipeline.evaluate(batch)}

    def finish_gradients(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float | None
    ) -> torch.Tensor | None:
        tied = self.pipeline.tied
        tied.sum(model)
        uncounted = tied.uncounted(model)  # another process counts them
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        counted = [
            p.grad for p in model.parameters() if p.grad is not None and id(p) not in uncounted
        ]
        return pipeline_norm(grads, max_norm, self.pipeline.group, self.pipeline.device, counted)

    def agree_buffers(self, model: nn.Module) -> None:
        self.pipeline.agree_buffers(model)
