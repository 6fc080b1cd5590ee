"""The two pipeline hooks a Hugging Face causal language model needs no recipe to give: its
batches are dicts with `input_ids` and `labels` (as its own `forward` takes them), and its
loss is its own shifted next-token cross entropy (`model.loss_function`: labels of -100
ignored, the mean over a micro-batch's tokens), as `model(**batch).loss` computes it.

A recipe that defines `split_batch` or `loss_from_output` keeps its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from launcher.errors import UsageError
from launcher.parallel.hugging_face import is_hf_model
from launcher.parallel.pipeline.given import PipelineInput
from launcher.parallel.pipeline.layout import DOCS


def complete_hooks(given: PipelineInput, model: nn.Module) -> PipelineInput:
    """`given` with the hooks its recipe leaves out supplied for `model`; a UsageError where
    the model is not a Hugging Face causal LM, which the launcher cannot supply them for."""
    missing = [
        name
        for name, hook in (
            ("split_batch", given.split),
            ("loss_from_output", given.loss_from_output),
        )
        if hook is None
    ]
    if not missing:
        return given
    if not is_causal_lm(model):
        raise UsageError(
            f"parallel.pp: {given.source} defines no {' and no '.join(missing)}, and "
            f"{type(model).__name__} is not a Hugging Face causal language model, whose "
            "hooks the launcher supplies: a pipeline computes the loss on the last stage's "
            "output, so the recipe says what of a batch goes into the model and what the "
            "loss compares its output with",
            hint="Define split_batch(batch) -> (inputs, targets) and "
            "loss_from_output(output, targets) -> loss (docs/recipes.md#pipeline-"
            "parallelism), or set parallel.pp: 1.",
        )
    return dataclasses.replace(
        given,
        split=given.split or split_causal_lm_batch,
        loss_from_output=given.loss_from_output or model_loss(model),
    )


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face model that generates text from its own outputs' logits alone."""
    config = getattr(model, "config", None)
    generates = getattr(model, "can_generate", None)
    return (
        is_hf_model(model)
        and callable(generates)
        and bool(generates())
        and not getattr(config, "is_encoder_decoder", False)
    )


def split_causal_lm_batch(batch: Any) -> tuple[tuple[Any, ...], Any]:
    """A dict batch's model inputs (everything but the labels, by name) and its labels."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "labels" not in batch:
        what = (
            f"a dict with {', '.join(batch)}"
            if isinstance(batch, Mapping)
            else type(batch).__name__
        )
        raise UsageError(
            f"parallel.pp: a batch is {what}; without a split_batch hook the launcher takes a "
            "causal language model's batches as dicts with input_ids and labels",
            hint="Make the dataset (or collate) give input_ids and labels, or define "
            f"split_batch(batch) -> (inputs, targets) in the recipe ({DOCS}).",
        )
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    return (inputs,), batch["labels"]


def model_loss(model: nn.Module) -> Callable[[Any, Any], Any]:
    """The model's own loss of its logits against the labels."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)

    def loss_from_output(logits: Any, labels: Any) -> Any:
        # Looked up at the call, as the model's forward looks it up (transformers says which
        # loss it falls back to the first time, in the process that computes it).
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    return loss_from_output
