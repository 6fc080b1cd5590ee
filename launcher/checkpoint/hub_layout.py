"""A Hugging Face model's weights as the Hub keeps them, turned into the model's own names
and shapes: transformers' conversion mapping, which `from_pretrained` applies and
`save_pretrained` reverts.

transformers 5 stores a mixture of experts' experts stacked (`experts.gate_up_proj`,
`[num_experts, 2 * inner, hidden]`), but the Hub's files, and every `save_pretrained` folder
(`train export --hf` too), keep one tensor per expert and projection
(`experts.0.gate_proj.weight`, ...). `load.weights` of such a folder reads the files and
converts them as `from_pretrained` does: renamings, and converters that merge a list of
tensors into one. The names and shapes are converted first on the meta device, from the
files' headers alone, so that they are checked before any tensor is read.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class HubLayout:
    """transformers' conversion of `model`'s checkpoint names (`hub_layout` builds it)."""

    def __init__(self, model: nn.Module, renamings: list[Any], converters: list[Any]) -> None:
        self.model, self.renamings, self.converters = model, renamings, converters

    def shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The model's names and shapes for the files' `shapes` (converted on meta)."""
        meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
        return {name: tuple(t.shape) for name, t in self.convert(meta).items()}

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The files' `tensors` under the model's names, merged where the model stacks them."""
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        by_pattern = {p: c for c in self.converters for p in c.source_patterns}
        merged: dict[str, Any] = {}
        out: dict[str, torch.Tensor] = {}
        for name in sorted(tensors, key=dot_natural_key):
            target, pattern = rename_source_key(name, self.renamings, self.converters)
            if pattern is None:
                out[target] = tensors[name]
                continue
            converter = merged.setdefault(target, copy.deepcopy(by_pattern[pattern]))
            converter.add_tensor(target, name, pattern, tensors[name])
        for target, converter in merged.items():
            converted = converter.convert(target, model=self.model, config=self.model.config)
            for name, value in converted.items():
                out[name] = value[0] if isinstance(value, list) else value
        return out


def hub_layout(model: nn.Module) -> HubLayout | None:
    """`model`'s conversion from the Hub's layout, for a Hugging Face model with one; None for
    any other model (or where transformers has no such mapping)."""
    from launcher.parallel.hugging_face import is_hf_model

    if not is_hf_model(model):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers before 5: no such layout to convert
        return None
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    return HubLayout(model, renamings, converters) if converters or renamings else None
