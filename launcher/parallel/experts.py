"""Expert parallelism (`parallel.ep`): a mixture-of-experts model's experts spread over `ep`
processes, each holding `1/ep` of every stacked expert tensor, with tokens sent to the process
that holds their expert and back by all-to-all.

Which tensors are experts is the model's expert plan, in transformers' form: `model.ep_plan`
(a Hugging Face model's, built from its config's `base_model_ep_plan`, e.g. Qwen3-MoE's
`model.layers.*.mlp.experts: ep_dispatch_experts` and its `gate_up_proj` and `down_proj`:
`grouped_gemm`), or the same attribute on a recipe's own model whose experts module follows
transformers' contract (`forward(hidden_states, top_k_index, top_k_weights)`, `num_experts`,
weights stacked `[num_experts, ...]`; docs/fsdp-and-parallelism.md, 'Expert parallelism').
transformers applies it (`apply_expert_parallelism`): each expert tensor becomes a DTensor
sharded on its first dimension over the `ep` axis, and the experts module's forward exchanges
the tokens (`AllToAllEP`).

The `ep` processes are data-parallel ranks that lend themselves to the experts, as in
torchtitan's dp2ep: `ep` divides `dp_shard`, every process still takes its own batch, and the
expert tensors are FSDP-sharded over the data ranks left (`efsdp`, `dp_shard / ep`), the other
weights over all of them. An expert's gradient then sums the tokens of the `ep` processes that
sent it some, so its reduction divides by every data rank, as the other weights' does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from launcher.errors import UsageError
from launcher.metrics.memory import size_text

DOCS = "docs/fsdp-and-parallelism.md, 'Expert parallelism'"
# transformers' style names: an experts module (hooked) and its stacked weights (sharded).
DISPATCH, STACKED = "ep_dispatch_experts", "grouped_gemm"
# The expert mesh's axes: replicas, the data ranks left to each expert (efsdp), ep, and a
# tensor-parallel axis of 1 (transformers' dispatch asks for the group sharing a batch).
EXPERT_AXES = ("dp_replicate", "efsdp", "ep", "etp")


@dataclass(frozen=True)
class ExpertPlan:
    """A model's expert plan, with its wildcards replaced by the model's layer numbers."""

    styles: dict[str, str]  # concrete module or parameter name -> transformers style
    experts: int  # experts per layer: the first dimension of every stacked tensor

    @property
    def modules(self) -> list[str]:
        """The experts modules (those whose forward exchanges the tokens)."""
        return [name for name, style in self.styles.items() if style == DISPATCH]

    def parameters(self) -> list[str]:
        return [name for name, style in self.styles.items() if style == STACKED]


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The expert plan `model` declares (`ep_plan`, with `*` for layer numbers); empty where
    it has none, or only styles other than the two this module applies."""
    plan = getattr(model, "ep_plan", None)
    if not isinstance(plan, dict):
        return {}
    return {k: v for k, v in plan.items() if v in (DISPATCH, STACKED)}


def expert_plan(model: nn.Module) -> ExpertPlan | None:
    """`model`'s expert plan over its own names; None where it has no experts."""
    plan = declared_plan(model)
    if not plan:
        return None
    styles: dict[str, str] = {}
    sizes = set()
    for name, param in model.named_parameters():
        style = plan.get(_wildcards(name))
        if style == STACKED:
            styles[name] = style
            sizes.add(param.shape[0])
    for name, _ in model.named_modules():
        if plan.get(_wildcards(name)) == DISPATCH:
            styles[name] = DISPATCH
    if not sizes or not any(s == DISPATCH for s in styles.values()):
        return None
    if len(sizes) > 1:
        raise UsageError(
            f"parallel.ep: {type(model).__name__}'s stacked expert tensors have "
            f"{' and '.join(map(str, sorted(sizes)))} experts; the launcher spreads one number",
            hint=f"Give every layer the same number of experts ({DOCS}).",
        )
    return ExpertPlan(styles, sizes.pop())


def _wildcards(name: str) -> str:
    """`name` with its layer numbers (`.3.` or a final `.3`) as `*`, as plans write them."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def checked_plan(model: nn.Module, ep: int) -> ExpertPlan:
    """`model`'s expert plan, refused (a `UsageError` naming `parallel.ep`) where it has no
    experts or `ep` does not divide them. `train validate` asks the same."""
    plan = expert_plan(model)
    name = type(model).__name__
    if plan is None:
        raise UsageError(
            f"parallel.ep: {ep}, but {name} has no experts to spread (no ep_plan naming an "
            f"experts module, `{DISPATCH}`, and its stacked weights, `{STACKED}`)",
            hint=f"Set parallel.ep: 1, or give the model an ep_plan ({DOCS}).",
        )
    if plan.experts % ep:
        raise UsageError(
            f"parallel.ep: {ep} does not divide {name}'s {plan.experts} experts per layer",
            hint=f"Choose an ep that divides {plan.experts}.",
        )
    return plan


def describe_experts(model: nn.Module, ep: int) -> str | None:
    """`train validate`'s line on `model`'s experts under `parallel.ep: ep` (refused where it
    cannot take it: `checked_plan`); None for a model without experts and ep 1."""
    plan = checked_plan(model, ep) if ep > 1 else expert_plan(model)
    if plan is None:
        return None
    named = dict(model.named_parameters())
    stacked = [named[name] for name in plan.parameters()]
    share = sum(p.numel() for p in stacked) / max(1, sum(p.numel() for p in model.parameters()))
    layer = sum(p.numel() * p.element_size() for p in stacked) / max(1, len(plan.modules))
    line = f"experts {share:.0%} of the parameters, {plan.experts} per layer"
    if ep == 1:
        return line + " in every process (parallel.ep spreads them)"
    return (
        f"{line}: {plan.experts // ep} in each process (parallel.ep {ep}), whose FSDP gathers "
        f"{size_text(layer / ep)} of a layer's {size_text(layer)} of expert weights"
    )


def apply_expert_parallel(model: nn.Module, mesh: Any) -> list[nn.Module]:
    """Spreads `model`'s experts over `mesh`'s `ep` axis (an expert mesh of `EXPERT_AXES`)
    in place; returns the experts modules, for FSDP to shard over the data ranks left."""
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError as missing:
        raise UsageError(
            f"parallel.ep: the experts are spread by transformers' expert parallelism ({missing})",
            hint="pip install 'transformers>=5', or set parallel.ep: 1.",
        ) from missing
    plan = checked_plan(model, mesh["ep"].size())
    apply_expert_parallelism(model, mesh["ep"], mesh["etp"], plan.styles)
    return [model.get_submodule(name) for name in plan.modules]


def expert_data_mesh(mesh: Any) -> Any:
    """The axes the expert tensors are FSDP-sharded (and, with replicas, reduced) over."""
    names = mesh.mesh_dim_names
    return mesh[("dp_replicate", "efsdp")] if "dp_replicate" in names else mesh["efsdp"]


def shard_experts(experts: list[nn.Module], mesh: Any, data_ranks: int, **fsdp: Any) -> None:
    """FSDP2 over the expert mesh's data axes, for each experts module: before the blocks
    that hold them (FSDP shards a module's children first). An expert's gradient sums the
    tokens of every process of its `ep` group, so it is divided by all `data_ranks`, not by
    the ranks it is reduced over alone (transformers' own FSDP does the same)."""
    from torch.distributed.fsdp import fully_shard

    data = expert_data_mesh(mesh)
    for module in experts:
        fully_shard(module, mesh=data, **fsdp)
        module.set_gradient_divide_factor(float(data_ranks))
        # A divide factor other than the group size goes through PREMUL_SUM, which gloo
        # refuses: sum, then divide locally. Without a reduce-scatter (one rank per expert
        # shard) FSDP divides alone, and a forced sum would divide twice.
        if mesh["efsdp"].size() > 1 and hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)


__all__ = [
    "EXPERT_AXES",
    "ExpertPlan",
    "apply_expert_parallel",
    "checked_plan",
    "describe_experts",
    "expert_plan",
    "shard_experts",
]
