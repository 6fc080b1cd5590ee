"""What resuming means to a worker: the state restored from a checkpoint, what changed said
once, and the line a restarted attempt starts with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.checkpoint import checkpointer as checkpoint
from launcher.config.spec import RunSpec
from launcher.parallel.base import Strategy
from launcher.parallel.dims import ParallelDims
from launcher.parallel.rng import rank_seed
from launcher.worker.optim import apply_after_load
from launcher.worker.state import TrainState


def restart_note(
    attempt: int, max_restarts: int, resume_from: Path | None, healing: bool = False
) -> str:
    """The first line of a restarted attempt (torch.distributed.elastic's restart count)."""
    where = f"resuming from {resume_from}" if resume_from else "no checkpoint yet: starting over"
    if healing:
        where = "copying the state of a live replica group"
    return f"attempt {attempt + 1} of {max_restarts + 1}: restarted after a failure; {where}"


def restore(
    path: Path,
    checkpointer: checkpoint.Checkpointer,
    state: TrainState,
    strategy: Strategy,
    spec: RunSpec,
    optim_settings: list[dict[str, Any]],
) -> None:
    """Collective: every state from the checkpoint at `path`; rank 0 says what differs.
    `optim_settings`: each optimizer group's settings as built now, which win over the
    checkpoint's (`apply_after_load`)."""

    def say(text: str) -> None:
        if strategy.is_main:
            print(text, flush=True)

    same_world = checkpointer.load(path)
    apply_after_load(optim_settings, checkpointer.model.optimizer, state.scheduler)
    for note in state.notes:
        say(note)
    if state.best is not None:
        # Best checkpoints are of this run folder (a branch starts its own record).
        note = state.best.retain(checkpointer.store.complete_steps())
        if note:
            say(note)
    if same_world:
        return
    # Saved with another world size: per-rank streams cannot continue; reseed them.
    strategy.rng.seed(rank_seed(spec.run.seed, strategy.dp_rank, state.progress.step))
    saved = checkpoint.saved_layout(checkpoint.read_meta(path))
    say(
        f"resuming on {_ranks(strategy.layout)} instead of {_ranks(saved)}: model, optimizer "
        "and data position continue; random streams are reseeded"
    )


def _ranks(layout: ParallelDims) -> str:
    """e.g. `4 processes (pp 2 x dp_shard 2)`; the layout left out where every process is a
    replica of its own."""
    world = layout.world
    plain = layout == ParallelDims(dp_replicate=world) or layout == ParallelDims(dp_shard=world)
    return f"{world} process{'es' if world != 1 else ''}" + (
        "" if plain else f" ({layout.describe()})"
    )
