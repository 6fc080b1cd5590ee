"""A Hugging Face model cut into pipeline stages by its own plan (`hf_plan`), each stage
running the model's own forward.

A stage is a view of the whole model: the same modules under the same names, except those
other stages hold, which are stand-ins without parameters: a block or final module another
stage runs passes its input through (`_Skipped`); an embedding the first stage holds gives
zeros (`_AbsentEmbedding`). A later stage calls the model with placeholder token ids of the
received hidden states' shape (the model computes positions, rotary embeddings and causal
masks from them, as it does whole), and the hidden states it received replace the input of
its first block. A stage before the last gives its last block's output; the last gives the
model's logits. So the model's code runs as written: blocks get their arguments as the model
passes them, by name, whatever their order.

The stage's parameters and state dict are the whole model's, under the whole model's names
(`model.layers.2.mlp.up_proj.weight`): checkpoints, EMA, optimizer groups, `load.weights`
and `export --hf` see the model they always see.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from launcher.errors import UsageError
from launcher.parallel.pipeline.hf_plan import HFPlan
from launcher.parallel.pipeline.layout import DOCS
from launcher.parallel.pipeline.stages import StageModules, example_activations, shared_parameters


class _Skipped(nn.Module):
    """A module another stage runs: its first input passes through. It keeps the plain
    attributes of the module it stands for (a block's `attention_type`, `layer_idx`), which
    some models read as they loop over their blocks."""

    def __init__(self, like: nn.Module) -> None:
        super().__init__()
        for key, value in vars(like).items():
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, type(None))):
                vars(self).setdefault(key, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class _Received:
    """The hidden states a stage received, while it runs (for its embeddings' stand-ins)."""

    tensor: torch.Tensor | None = None


class _AbsentEmbedding(nn.Module):
    """An embedding the first stage holds: zeros in the received states' dtype, whatever
    the model adds them to is replaced at the stage's first block."""

    def __init__(self, dim: int, received: _Received) -> None:
        super().__init__()
        self.dim, self.received = dim, received

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        like = self.received.tensor
        assert like is not None  # set by the stage around each call
        return like.new_zeros((*ids.shape, self.dim))


_STAND_INS = (_Skipped, _AbsentEmbedding)


class HFStage(nn.Module):
    """One stage of a Hugging Face model. Its children are the whole model's (by name), with
    stand-ins for what other stages hold; `forward(x, **kwargs)` takes token ids on the first
    stage and hidden states on the others, and the model's other inputs (an attention mask)
    by name on every stage."""

    stage_of_hf_model = True  # its blocks' classes are the model's (`no_split_classes`)

    def __init__(
        self, model: nn.Module, plan: HFPlan, owned: range, count: int, index: int
    ) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == count - 1
        received = _Received()
        view = _view(model, _stand_ins(model, plan, owned, self.first, self.last, received))
        # The view's own containers, so that fsdp and tp (which set parameters where they
        # live) change what the view runs.
        self._modules, self._parameters, self._buffers = (
            view._modules, view._parameters, view._buffers,
        )  # fmt: skip
        blocks = view.get_submodule(plan.layers)
        vars(self).update(
            _view_of=view,
            _received=received,
            _first_block=blocks[owned.start],
            _last_block=blocks[owned.stop - 1],
            _takes=set(inspect.signature(model.forward).parameters),
        )
        # What the launcher reads of a Hugging Face model (its config, its tp plan, its blocks'
        # classes) reads the same of its stages.
        self.config = getattr(model, "config", None)
        self.tp_plan = _held_plan(getattr(model, "tp_plan", None), view)
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        self._tied_weights_keys = getattr(model, "_tied_weights_keys", None)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        hooks, captured = [], []
        if self.first:
            ids = x
        else:  # placeholder ids: the model reads their shape, for positions and masks
            self._received.tensor = x
            ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
            hooks.append(
                self._first_block.register_forward_pre_hook(
                    _replacing_input(x), with_kwargs=True, prepend=True
                )
            )
        if not self.last:
            hooks.append(
                self._last_block.register_forward_hook(lambda m, a, out: captured.append(out))
            )
        if "use_cache" in self._takes:  # no key-value cache in training
            kwargs = {"use_cache": False, **kwargs}
        try:
            output = self._view_of(input_ids=ids, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
            self._received.tensor = None
        if not self.last:
            return _first_tensor(captured[-1])
        return output.logits if hasattr(output, "logits") else _first_tensor(output)


def _held_plan(plan: dict[str, Any] | None, view: nn.Module) -> dict[str, Any] | None:
    """The entries of the model's tensor-parallel plan that name modules this stage runs:
    torch's styles refuse a stand-in (`lm_head` on the first stage)."""
    if not plan:
        return plan
    held = [name for name, m in view.named_modules() if not isinstance(m, _STAND_INS)]
    return {key: style for key, style in plan.items() if any(fnmatch(n, key) for n in held)}


def _replacing_input(hidden: torch.Tensor) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (hidden, *args[1:]), kwargs
        name = next(iter(kwargs))  # the model passed its hidden states by name
        return args, {**kwargs, name: hidden}

    return hook


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return next(v for v in (value.values() if isinstance(value, Mapping) else value))


def _stand_ins(
    model: nn.Module, plan: HFPlan, owned: range, first: bool, last: bool, received: _Received
) -> dict[str, nn.Module]:
    """What replaces the modules of other stages in this stage's view, by name."""
    out: dict[str, nn.Module] = {
        name: _Skipped(model.get_submodule(name))
        for i, name in enumerate(plan.layer_names(model))
        if i not in owned
    }
    if not first:
        for name in plan.first:
            module = model.get_submodule(name)
            dim = getattr(module, "embedding_dim", None)
            stand_in = _AbsentEmbedding(dim, received) if dim is not None else _Skipped(module)
            if last and name in plan.tied_to_last:
                # Held, not run: the head's weight under the embedding's name, so that the
                # two stages name the tied weight alike.
                for key, param in module.named_parameters(recurse=False):
                    stand_in.register_parameter(key, param)
            out[name] = stand_in
    if not last:
        out.update({name: _Skipped(model.get_submodule(name)) for name in plan.last})
    return out


def _view(module: nn.Module, replaced: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of `module` with the submodules named in `replaced` swapped; the
    modules on the way to them are copied too, every other submodule is the model's own."""
    view = copy.copy(module)
    for key, value in list(vars(view).items()):
        if isinstance(value, dict):  # its own registries (children, hooks), not the model's
            vars(view)[key] = type(value)(value)
    nested: dict[str, dict[str, nn.Module]] = {}
    for name, stand_in in replaced.items():
        head, _, rest = name.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = stand_in
        else:
            view._modules[head] = stand_in
    for head, inner in nested.items():
        view._modules[head] = _view(module._modules[head], inner)  # type: ignore[arg-type]
    return view


def cut_by_plan(
    model: nn.Module,
    plan: HFPlan,
    points: list[str],
    example: tuple[tuple[Any, ...], dict[str, Any]] | None,
    indices: list[int],
    autocast: Callable[[], Any],
) -> StageModules:
    """The stages of `model` that begin at `points` (names of blocks of the plan's layer
    list); the modules of the stages in `indices`, and each one's example activations on
    `example` (one micro-batch's inputs to the first stage, and the inputs by name that
    every stage takes; None: no example activations)."""
    names = plan.layer_names(model)
    outside = [point for point in points if point not in names]
    if outside:
        raise UsageError(
            f"parallel.pp_split_points: {', '.join(outside)} is not a block of "
            f"{type(model).__name__}'s {plan.layers}: its stages begin at a block",
            hint=f"Name blocks, e.g. {names[len(names) // 2]} ({DOCS}).",
        )
    starts = [0, *(names.index(point) for point in points), len(names)]
    count = len(starts) - 1
    every = [HFStage(model, plan, range(starts[i], starts[i + 1]), count, i) for i in range(count)]
    shapes = example_activations(every, example, autocast) if example else [((), ())] * count
    return StageModules(
        [every[i] for i in indices],
        indices,
        count,
        examples=[shapes[i] for i in indices],
        route=router(model),
        shared=shared_parameters(every),
    )


def router(model: nn.Module) -> Callable[[tuple[Any, ...]], tuple[tuple[Any, ...], dict]]:
    """How a batch's model inputs reach the stages: bound by name to the model's forward,
    the token ids go to the first stage and every other input to every stage."""
    signature = inspect.signature(model.forward)

    def route(inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(inputs) == 1 and isinstance(inputs[0], Mapping):
            bound = dict(inputs[0])
        else:
            bound = dict(signature.bind_partial(*inputs).arguments)
        ids = bound.pop("input_ids", None)
        if ids is None:
            raise UsageError(
                f"parallel.pp: the model's inputs name no input_ids ({', '.join(bound)}): "
                "the first stage of a Hugging Face model takes token ids",
                hint=f"Make split_batch give the token ids first ({DOCS}).",
            )
        return (ids,), {k: v for k, v in bound.items() if v is not None and k != "labels"}

    return route
