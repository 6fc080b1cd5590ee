"""What the loop gives a strategy to cut the model into pipeline stages (`parallel.pp`): torch-
free, so that the strategy interface names it without importing torch's pipelining."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PipelineInput:
    # The recipe's hooks; None where it has none (a Hugging Face causal LM's are supplied:
    # `launcher.parallel.pipeline.causal_lm`).
    split: Callable[[Any], tuple[tuple[Any, ...], Any]] | None  # batch -> (inputs, targets)
    loss_from_output: Callable[[Any, Any], Any] | None  # on the last stage's output
    example: Any  # one batch as training collates it: the shapes the stages are traced with
    batch_size: int  # samples in a batch of one data-parallel rank (data.batch_size)
    accum: int  # train.grad_accum_steps
    source: str = "the recipe"  # for messages: the recipe that gave (or left out) the hooks
