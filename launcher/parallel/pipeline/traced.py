"""Any model torch.export can trace, cut by torch's tracer (`pipeline()`) where the split points
begin; each stage's graph then calls the model's own modules, with the arguments the model
gives them, bound by the names of each module's forward."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import ModuleCallSignature
from torch.export.graph_signature import ConstantArgument

from launcher.errors import UsageError
from launcher.parallel.pipeline.layout import DOCS
from launcher.parallel.pipeline.stages import StageModules


def cut(
    model: nn.Module,
    points: list[str],
    example: tuple[Any, ...],
    indices: list[int],
    autocast: Callable[[], Any],
) -> StageModules:
    """The stages of `model` (whole, on CPU) that begin at `points`, traced on `example`
    (one micro-batch's inputs); the modules of the stages in `indices` only."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {name: SplitPoint.BEGINNING for name in points}
    try:
        with warnings.catch_warnings():  # torch.export's own deprecations, nothing of the run's
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipeline(model, mb_args=example, split_spec=spec)
    except Exception as exc:  # torch.export cannot trace every model
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"parallel.pp: torch.export could not trace {type(model).__name__} to cut it into "
            f"stages: {why}",
            hint=f"Make the model's forward traceable by torch.export ({DOCS}).",
        ) from exc
    every = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    shapes = _example_activations(every, example, autocast)
    stages = [every[i] for i in indices]
    # Traced again after `pipeline()`, split points and all: the same graph, whose values
    # have the same names, now with a record of how the model calls each module.
    calls = _recorded_calls(model, example, _calls_to_bind(stages, model))
    for stage in stages:
        _point_at_the_models_modules(stage, model, calls)
    return StageModules(stages, indices, pipe.num_stages, examples=[shapes[i] for i in indices])


def _example_activations(
    stages: list[nn.Module], example: tuple[Any, ...], autocast: Callable[[], Any]
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Each stage's inputs and outputs on the example micro-batch, run stage after stage on
    CPU: the shapes and dtypes each stage sends and receives, given to torch's stages up
    front (its inference of them at the first step runs `autograd.grad`, which fsdp's
    gradient hooks do not support)."""
    out, inputs = [], example
    with torch.no_grad(), autocast():
        for stage in stages:
            outputs = stage(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            out.append((inputs, outputs))
            inputs = outputs
    return out


def _point_at_the_models_modules(
    stage: nn.Module, model: nn.Module, calls: dict[str, ModuleCallSignature]
) -> None:
    """The tracer's stage calls copies of the model's modules (torch's `InterpreterModule`,
    sharing the parameters); each call now goes to the model's own module of that name, so
    that the stage holds the model's classes (fsdp's units, float8's and the optimizer's
    groups find them) under the model's names. A copy takes the values its body reads in
    the tracer's order (the reverse of the order its body first read them), not in its
    forward's: each call is given the model's own arguments (`calls`), bound by the
    forward's names, since two tensors of one shape swapped run without an error."""
    for node in stage.graph.nodes:
        if node.op != "call_module":
            continue
        module = model.get_submodule(node.target)
        if not _binds_alone(module, node):
            copy = stage.get_submodule(node.target)
            node.args, node.kwargs = _the_models_call(node, copy, module, calls.get(node.target))
        parent_name, _, child = node.target.rpartition(".")
        parent = stage.get_submodule(parent_name) if parent_name else stage
        parent._modules[child] = module
    stage.recompile()


def _forward_of(module: nn.Module) -> Callable[..., Any]:
    """The module's own forward: `pipeline()` replaces a split point's with a wrapper that
    takes (*args, **kwargs), and keeps the module's as `_orig_forward`."""
    return getattr(module, "_orig_forward", module.forward)


def _binds_alone(module: nn.Module, node: fx.Node) -> bool:
    """Whether the tracer's call binds without the model's record: one value for a forward
    of one parameter (a Linear, a norm, GPT's blocks) has only one name to take."""
    params = list(inspect.signature(_forward_of(module)).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(params) == 1 and params[0].kind in positional and len(node.args) == 1


def _calls_to_bind(stages: list[nn.Module], model: nn.Module) -> list[str]:
    """The modules the stages call that need the model's record of their call."""
    return [
        node.target
        for stage in stages
        for node in stage.graph.nodes
        if node.op == "call_module" and not _binds_alone(model.get_submodule(node.target), node)
    ]


def _recorded_calls(
    model: nn.Module, example: tuple[Any, ...], names: list[str]
) -> dict[str, ModuleCallSignature]:
    """How the model calls each module of `names`, as torch.export records it when told to
    keep those calls' signatures: the positional and keyword structure of the arguments, each
    tensor by the name the graph gives its value, the constants by their values."""
    if not names:
        return {}
    try:
        with warnings.catch_warnings():  # torch.export's own deprecations, nothing of the run's
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(
                model, example, preserve_module_call_signature=tuple(dict.fromkeys(names))
            )
    except Exception as exc:  # a call whose signature torch.export cannot keep
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"parallel.pp: torch.export could not record how {type(model).__name__} calls "
            f"{', '.join(dict.fromkeys(names))}: {why}",
            hint=f"Pass those modules tensors and plain values only ({DOCS}).",
        ) from exc
    return {e.fqn: e.signature for e in program.module_call_graph if e.signature is not None}


_NOT_CARRIED = object()  # where the model passes a value the stage does not carry


def _the_models_call(
    node: fx.Node, copy: nn.Module, module: nn.Module, call: ModuleCallSignature | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The model's own arguments to `module` (its positional and keyword structure, its
    constants), each tensor the stage's value of the same name; bound by the forward's
    names, so that a value the stage lacks, or a call the forward does not take, is refused
    here rather than run."""
    if call is None:
        raise _unbound(node.target, module, "torch.export kept no record of its call")
    values = _values_by_exported_name(node, copy, module, call)
    flat = [
        arg.value if isinstance(arg, ConstantArgument) else values.get(arg.name, _NOT_CARRIED)
        for arg in call.inputs
    ]
    args, kwargs = pytree.tree_unflatten(flat, call.in_spec)
    try:
        bound = inspect.signature(_forward_of(module)).bind(*args, **kwargs)
    except TypeError as exc:
        raise _unbound(node.target, module, f"its forward does not take that call ({exc})") from exc
    lacking = [
        name
        for name, value in bound.arguments.items()
        if any(leaf is _NOT_CARRIED for leaf in pytree.tree_leaves(value))
    ]
    if lacking:
        why = f"the model passes it {', '.join(lacking)}, which its traced body never reads"
        raise _unbound(node.target, module, f"{why}, so the stage does not carry it")
    return bound.args, bound.kwargs


def _values_by_exported_name(
    node: fx.Node, copy: nn.Module, module: nn.Module, call: ModuleCallSignature
) -> dict[str, Any]:
    """The tracer's values for `node`, by the name the exported graph gave each: the copy's
    placeholders match the call's arguments one for one, and each names the value it was
    made from (torch.fx's provenance), not the forward's parameter it stands for."""
    recorded = {arg.name for arg in call.inputs if not isinstance(arg, ConstantArgument)}
    placeholders = [n for n in copy.graph.nodes if n.op == "placeholder"]
    if node.kwargs or len(placeholders) != len(node.args):
        raise _unbound(node.target, module, "its traced call does not match its traced body")
    values = {}
    for placeholder, value in zip(placeholders, node.args, strict=True):
        names = _exported_names(placeholder) & recorded
        if len(names) != 1:
            why = f"its traced body reads a value the model does not pass it ({placeholder})"
            raise _unbound(node.target, module, why)
        values[names.pop()] = value
    return values


def _exported_names(node: fx.Node) -> set[str]:
    """The names of the values `node` was made from, back to the exported program's graph
    (`meta["from_node"]`, torch.fx's record of each copy's source)."""
    names, sources = set(), list(node.meta.get("from_node", []))
    while sources:
        source = sources.pop()
        names.add(source.name)
        sources.extend(source.from_node)
    return names


def _unbound(name: str, module: nn.Module, why: str) -> UsageError:
    return UsageError(
        f"parallel.pp: a stage cannot call {name} ({type(module).__name__}) as the model does: "
        f"{why}",
        hint=f"Pass each module the tensors its forward reads, and no others ({DOCS}).",
    )
