"""Where a Hugging Face model's modules go when it is cut into pipeline stages: read from the
model's own plan (`config.base_model_pp_plan`, e.g. Llama's `embed_tokens`, `layers`, `norm`),
or, for a model without one (GPT-2), from the order its base model registers its modules
around its one list of blocks.

The rule, for a plan and for an order alike:
- the blocks of the layer list are divided between the stages;
- modules with parameters before the list (the embeddings) belong to the first stage; those
  after it (the final norm) and the head outside the base model (`lm_head`) to the last;
- modules without parameters (a rotary embedding, dropout) run on every stage: each stage
  computes positions, rotary embeddings and masks as the whole model computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from launcher.errors import UsageError
from launcher.parallel.hugging_face import is_hf_model
from launcher.parallel.pipeline.layout import DOCS


@dataclass(frozen=True)
class HFPlan:
    """Names are the whole model's (`model.layers`, `lm_head`)."""

    layers: str  # the list of blocks the stages divide
    first: list[str]  # modules with parameters that only the first stage runs
    last: list[str]  # ... only the last stage
    tied_to_last: list[str]  # first-stage modules whose weights the last stage's head shares
    source: str  # where the plan came from, for the start-up line

    def layer_names(self, model: nn.Module) -> list[str]:
        return [f"{self.layers}.{i}" for i in range(len(model.get_submodule(self.layers)))]


def hf_plan(model: nn.Module) -> HFPlan | None:
    """The plan of a Hugging Face model (see the module's docstring); None for other models,
    which torch's tracer cuts. A UsageError for one that has no single list of blocks."""
    if not is_hf_model(model):
        return None
    config = getattr(model, "config", None)
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UsageError(
            f"parallel.pp: {name} is an encoder-decoder model: its stages would pass both the "
            "encoder's output and the decoder's states, which the launcher does not cut",
            hint="Train it with parallel.pp: 1 (fsdp and tp split it), or give the recipe a "
            f"decoder-only model ({DOCS}).",
        )
    base = getattr(model, "base_model", model)
    prefix = next((n + "." for n, m in model.named_modules() if m is base and n), "")
    declared = dict(getattr(config, "base_model_pp_plan", None) or {})
    children = list(base.named_children())
    layers = _layer_list(base, children, declared)
    if layers is None:
        raise UsageError(
            f"parallel.pp: {name} has no single list of blocks to divide into stages "
            "(config.base_model_pp_plan names none, and its base model holds "
            f"{sum(isinstance(m, nn.ModuleList) for _, m in children)} nn.ModuleList)",
            hint="Give its config a base_model_pp_plan that names the list of blocks, or "
            f"train it with parallel.pp: 1 ({DOCS}).",
        )
    order = [n for n, _ in children]
    at = order.index(layers)
    first = [prefix + n for n, m in children[:at] if _has_params(m)]
    last = [prefix + n for n, m in children[at + 1 :] if _has_params(m)]
    last += [n for n, m in model.named_children() if m is not base and _has_params(m)]
    return HFPlan(
        layers=prefix + layers,
        first=first,
        last=last,
        tied_to_last=_tied(model, first, last),
        source="its config's base_model_pp_plan" if declared else "the order of its modules",
    )


def _layer_list(
    base: nn.Module, children: list[tuple[str, nn.Module]], declared: dict[str, object]
) -> str | None:
    """The name of the base model's list of blocks: the plan's, else its only ModuleList."""
    lists = [n for n, m in children if isinstance(m, nn.ModuleList)]
    named = [n for n in declared if n in lists]
    if len(named) == 1:
        return named[0]
    return lists[0] if len(lists) == 1 else None


def _tied(model: nn.Module, first: list[str], last: list[str]) -> list[str]:
    """The first stage's modules that share a parameter with the last stage's (an input
    embedding tied to the output head): the last stage holds them too, so that the tied
    weight keeps one name (the embedding's) on both stages."""
    in_last = {id(p) for name in last for p in model.get_submodule(name).parameters()}
    return [
        name
        for name in first
        if any(id(p) in in_last for p in model.get_submodule(name).parameters())
    ]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None
