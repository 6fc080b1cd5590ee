"""Streaming DiLoCo's fragments (`fault_tolerance.sync.fragments`): the model cut into runs of
whole blocks, synced one at a time, so that each sync sends a fragment's bytes instead of the
whole model's (Douillard et al., 2025).

The blocks are the model's FSDP units as `launcher.parallel.shard_units` finds them (a Hugging
Face model's `_no_split_modules`, the children of a `ModuleList`, ...): a transformer's layers.
Fragment `i` holds blocks `i * n / F` to `(i + 1) * n / F`; what is in no block (embeddings,
the last norm, the head) goes with the block that comes before it in the model's order (the
first fragment for what comes before every block).
"""

from __future__ import annotations

from torch import nn

from launcher.errors import UsageError
from launcher.parallel.shard_units import shard_units
from launcher.parallel.wrapper_names import named_parameters


def fragments_of(model: nn.Module, count: int, wrap: list[str] | None = None) -> list[list[str]]:
    """The names of the trained parameters of each of `count` fragments, in the model's
    order (`named_parameters`, wrapper names left out). Refuses (UsageError) a count that does
    not divide the model's blocks."""
    names = [n for n, p in named_parameters(model) if p.requires_grad]
    if count == 1:
        return [names]
    blocks = _blocks_in_order(model, wrap)
    if not blocks or len(blocks) % count:
        raise UsageError(
            f"fault_tolerance.sync.fragments: {count} does not divide the model's "
            f"{len(blocks)} blocks ({_block_classes(blocks)}): each fragment holds whole blocks",
            hint=f"Set fragments to a divisor of {len(blocks)}, or 1.",
        )
    owner = {id(p): i * count // len(blocks) for i, b in enumerate(blocks) for p in b.parameters()}
    fragments: list[list[str]] = [[] for _ in range(count)]
    current = 0
    for name, param in named_parameters(model):
        current = owner.get(id(param), current)
        if param.requires_grad:
            fragments[current].append(name)
    return fragments


def describe_fragments(fragments: list[list[str]], blocks: int) -> str:
    """`diloco: 2 fragments of 2 blocks each, synced in turn`."""
    count, each = len(fragments), blocks // len(fragments)
    return (
        f"diloco: {count} fragments of {each} block{'s' if each > 1 else ''} each, synced in turn"
    )


def block_count(model: nn.Module, wrap: list[str] | None = None) -> int:
    return len(_blocks_in_order(model, wrap))


def _blocks_in_order(model: nn.Module, wrap: list[str] | None) -> list[nn.Module]:
    chosen = {id(m) for m in shard_units(model, wrap).modules}
    return [m for m in model.modules() if id(m) in chosen]


def _block_classes(blocks: list[nn.Module]) -> str:
    classes = sorted({type(b).__name__ for b in blocks})
    return ", ".join(classes) if classes else "none found"
