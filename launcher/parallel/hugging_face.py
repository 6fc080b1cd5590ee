"""Hugging Face `transformers` models, recognised without importing transformers.

A `PreTrainedModel` initialises its weights in its own method, not in each module's
`reset_parameters()`: `post_init()` ends with `init_weights()`, which applies the model's
`_init_weights(module)` to every module (`initialize_weights()`; GPT-2's scales its residual
projections to std 0.02 / sqrt(2 * n_layer)) and then ties the tied weights (`tie_weights()`).
Two details of transformers 5 matter here:

- each module it initialised is marked `_is_hf_initialized`, and a marked module is skipped,
  so calling `init_weights()` on a built model a second time changes nothing;
- under `torch.device("meta")` `init_weights()` skips the initialisation (there is no memory
  to write), which `from_pretrained` runs later on what it materialised and did not load
  (`_initialize_missing_keys`: `initialize_weights()`, then `tie_weights()`).
"""

from __future__ import annotations

import itertools
import sys

import torch


def is_hf_model(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers `PreTrainedModel`. A model of that class can only
    exist once transformers is imported, so this never imports it."""
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def init_hf_weights(model: torch.nn.Module) -> None:
    """The model's own Hugging Face init of every weight, from the current random state.

    The marks of an earlier init (`post_init` of a plain build) are cleared first, so that a
    model built for real and one materialised from the meta device run the same init and draw
    the same numbers. As in `from_pretrained`, a tied weight is drawn by its source (the
    token embedding) only, not again by its targets (`lm_head`).
    """
    for owner in itertools.chain(model.modules(), model.parameters(), model.buffers()):
        if "_is_hf_initialized" in vars(owner):
            delattr(owner, "_is_hf_initialized")
    _skip_tied_targets(model)
    # fully_shard gives the model a class of its own, defined in torch, which transformers
    # takes for remote code (`is_custom_code()`) and then skips every module without
    # parameters of its own, such as GPT-2's attention, whose init scales c_proj. The class
    # the model was built as answers instead.
    built = next(c for c in type(model).__mro__ if not c.__module__.startswith("torch."))
    vars(model)["is_custom_code"] = getattr(built, "is_custom_code", lambda: False)
    try:
        model.init_weights()  # type: ignore[operator]
    finally:
        del vars(model)["is_custom_code"]


def _skip_tied_targets(model: torch.nn.Module) -> None:
    # from_pretrained marks the targets' tensors initialised while they are still apart from
    # their source. Here post_init has tied them into one tensor, which a mark would skip for
    # the source too; so a module that holds nothing but targets is marked instead.
    targets = set(getattr(model, "all_tied_weights_keys", None) or ())
    for name, module in model.named_modules():
        own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        if own and all(key in targets for key in own):
            module._is_hf_initialized = True


def no_split_classes(model: torch.nn.Module) -> set[str]:
    """The block classes a Hugging Face model says must not be split across devices
    (`_no_split_modules`, e.g. `GPT2Block`), as do its pipeline stages; empty for other
    models."""
    if not is_hf_model(model) and not getattr(model, "stage_of_hf_model", False):
        return set()
    return set(getattr(model, "_no_split_modules", None) or ())
