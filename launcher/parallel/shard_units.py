"""Which submodules become their own FSDP unit, and the line that says so.

A unit's parameters are gathered whole while it runs, so the largest unit bounds what a rank
holds beyond its shards; the root takes what no unit took. A model that is one unit gathers
all of itself in every forward, so that is never chosen silently.

Without `fsdp.wrap` the units are, in order of preference: the classes a Hugging Face model
names in `_no_split_modules` (as its own `device_map` splitting does); the children of every
`nn.ModuleList` (a transformer's blocks); else the outermost instances of repeated module
classes that hold parameters, preferring composite blocks (torchvision's `BasicBlock`) over
leaf layers (`Conv2d`), the way FSDP1's wrap policies pick repeated blocks. Generic containers
(`Sequential`, `ModuleList`, `ModuleDict`) are never units by repetition, and neither is a
module that shares a parameter with the rest of the model (tied weights must stay in one
unit).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from launcher.errors import UsageError
from launcher.parallel.hugging_face import no_split_classes

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class ShardUnits:
    modules: list[nn.Module]  # innermost first: FSDP2 shards bottom-up
    chosen_by: str

    def describe(self, model: nn.Module) -> str:
        """One line naming the units by class and count."""
        root = type(model).__name__
        if not self.modules:
            classes = sorted({type(m).__name__ for m in model.modules()})
            return (
                f"fsdp: the whole model is one shard unit ({self.chosen_by}): every forward "
                f"gathers all of it; name the classes to shard in fsdp.wrap (classes in this "
                f"model: {', '.join(classes)})"
            )
        counts = Counter(type(m).__name__ for m in reversed(self.modules))
        units = ", ".join(f"{n} x {name}" for name, n in counts.items())
        return f"fsdp: shard units: {units} ({self.chosen_by}), and the root {root}"


def shard_units(model: nn.Module, wrap: list[str] | None) -> ShardUnits:
    """The submodules that become their own FSDP unit (see the module's docstring)."""
    present = {type(m).__name__ for m in model.modules()}
    if wrap is not None:
        unknown = [name for name in wrap if name not in present]
        if unknown:
            raise UsageError(
                f"fsdp.wrap: {', '.join(unknown)} matches no module of the model",
                hint=f"Module classes in this model: {', '.join(sorted(present))}",
            )
        return ShardUnits(_of_classes(model, set(wrap)), "fsdp.wrap")
    no_split = no_split_classes(model) & present
    if no_split:
        return ShardUnits(_of_classes(model, no_split), "the model's _no_split_modules")
    listed = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    if listed:
        return ShardUnits(listed[::-1], "the children of nn.ModuleList")
    repeated, composite = repeated_modules(model)
    if repeated:
        kind = "repeated blocks" if composite else "repeated layers: no block repeats"
        return ShardUnits(repeated, f"{kind}; fsdp.wrap names others")
    return ShardUnits([], "no nn.ModuleList and no repeated module with parameters")


def _of_classes(model: nn.Module, names: set[str]) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in names and m is not model][::-1]


def repeated_modules(model: nn.Module) -> tuple[list[nn.Module], bool]:
    """The outermost instances of the repeated classes that hold parameters, innermost first,
    and whether they are composite blocks, which are preferred over leaf layers."""
    shares = _sharing(model)
    candidates = [
        m
        for m in model.modules()
        if m is not model and not isinstance(m, _CONTAINERS) and _has_params(m) and not shares(m)
    ]
    repeated = {cls for cls, n in Counter(type(m) for m in candidates).items() if n > 1}
    composite = {
        type(m) for m in candidates if type(m) in repeated and any(map(_has_params, m.children()))
    }
    chosen = composite or repeated
    found: list[nn.Module] = []
    _outermost(model, chosen, shares, found, set())
    return found[::-1], bool(composite)


def _outermost(
    module: nn.Module,
    classes: set[type],
    shares: Callable[[nn.Module], bool],
    found: list[nn.Module],
    seen: set[int],
) -> None:
    for child in module.children():
        if id(child) in seen:
            continue
        seen.add(id(child))
        if type(child) in classes and not shares(child):
            found.append(child)
        else:
            _outermost(child, classes, shares, found, seen)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _sharing(model: nn.Module) -> Callable[[nn.Module], bool]:
    """A test: whether a module holds a parameter that the model also uses elsewhere."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def shares(module: nn.Module) -> bool:
        own = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        return any(uses[key] > n for key, n in own.items())

    return shares
