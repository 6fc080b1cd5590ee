"""Streaming datasets (an `IterableDataset` from `build_dataset`): shares, repeats, positions.

Shares. Every reader (a rank, or a DataLoader worker of a rank) takes its own part of the
stream: rank r takes items `r + k * world`, and worker w of W takes every W-th of those, so
items `r + world * w + m * world * W`. Every reader reads the whole stream and skips what is
not its own. A Hugging Face `datasets.IterableDataset` is split by its own
`split_dataset_by_node` instead (whole files per rank where it can), and splits itself among
workers.

Repeats. A reader whose share ends starts it again (a new pass, `set_epoch(pass)` where the
dataset has it), so every rank always has a next batch: ranks never need to agree on where a
finite stream ends, and the run is `train.max_steps` long.

Positions. Each batch carries, from the worker that made it, where that worker's share stood
after it. The training process keeps the position of the last batch it *took* (not the ones
prefetched), per worker, and a checkpoint saves them. A dataset with `state_dict()` /
`load_state_dict()` (torchdata's Stateful protocol; HF datasets) is restored from its own state;
any other is fast-forwarded by reading and skipping the items its share already gave. An HF
stream's state holds no shuffle buffer: restored, it starts with the buffer empty, and the
resume says so (`shuffle_buffer`).
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from torch.utils.data import IterableDataset, default_collate, get_worker_info

from launcher.errors import UsageError


@dataclass
class Position:
    """Where one worker's share of the stream stands."""

    passes: int = 0  # passes over the share completed
    taken: int = 0  # items of the share given in the current pass
    state: Any = None  # the dataset's own state_dict() after the last item given, if it has one


@dataclass(frozen=True)
class Tag:
    """Rides with each batch from the worker that made it."""

    worker: int
    position: Position


def is_hf_stream(dataset: Any) -> bool:
    return type(dataset).__module__.split(".")[0] == "datasets" and hasattr(dataset, "n_shards")


def shuffle_buffer(dataset: Any) -> Any | None:
    """What holds a Hugging Face stream's shuffle buffer (`dataset.shuffle(buffer_size=...)`),
    or None where it has none. Its state_dict() keeps the stream's position, not the buffer's
    content. Found by class name, as `datasets` is not the launcher's dependency: its
    `BufferShuffledExamplesIterable` among the iterables the stream wraps (every version), or
    the shuffling config the 2.x-4.x versions keep."""
    pending = [getattr(dataset, "_ex_iterable", None)]
    seen = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return node
        pending.append(getattr(node, "ex_iterable", None))
        inner = getattr(node, "ex_iterables", None)  # interleaved or concatenated streams
        pending.extend(inner if isinstance(inner, list | tuple) else [])
    return getattr(dataset, "_shuffling", None)


def stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


class StreamShare(IterableDataset):
    """One rank's share of `dataset`, split among its DataLoader workers.

    With `repeat`, each worker's share starts over when it ends, and every `batch`-th item
    comes with a `Tag` (the position after it), for `TaggedCollate`. `start` holds each
    worker's position to continue from; the DataLoader copies it into its workers."""

    def __init__(
        self, dataset: IterableDataset, rank: int, world: int, repeat: bool, batch: int = 1
    ) -> None:
        self.native = is_hf_stream(dataset)
        if self.native:  # HF's own node split, as its docs ask for distributed training
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank=rank, world_size=world)
        self.dataset, self.rank, self.world = dataset, rank, world
        self.repeat, self.batch = repeat, batch
        self.start: dict[int, Position] = {}

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if self.native:
            index, count = 0, 1
        else:
            index, count = self.rank + self.world * worker, self.world * workers
        position = replace(self.start.get(worker, Position()))
        items = self._items(index, count, position)
        if not self.repeat:
            return items
        return self._tagged(items, worker, position)

    def _tagged(self, items: Iterator[Any], worker: int, position: Position) -> Iterator[Any]:
        with_state = stateful(self.dataset)
        for given, item in enumerate(items, start=1):
            if given % self.batch:
                yield item, None
                continue
            if with_state:
                position.state = self.dataset.state_dict()  # type: ignore[attr-defined]
            yield item, Tag(worker, replace(position))

    def _items(self, index: int, count: int, position: Position) -> Iterator[Any]:
        """This reader's items, from `position` on, pass after pass (`position` is updated)."""
        skip, state = position.taken, position.state
        while True:
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(position.passes)  # type: ignore[attr-defined]
            first, seen = index, 0
            if state is not None:  # the dataset goes on after the last item this share took
                self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
                first, seen, skip, state = count - 1, position.taken, 0, None
            for item in itertools.islice(iter(self.dataset), first, None, count):
                seen += 1
                if seen <= skip:
                    continue
                position.taken = seen
                yield item
            if not self.repeat:
                return
            if seen == 0:
                raise UsageError(
                    f"recipe: the train stream gives rank {self.rank} (reader {index} of "
                    f"{count}) no items: it holds fewer items than readers",
                    hint="Lower data.num_workers, or use fewer processes.",
                )
            skip = max(0, skip - seen)  # a fast-forward longer than a pass goes on
            position.passes, position.taken = position.passes + 1, 0


class TaggedCollate:
    """Collates the items (with the recipe's `collate`, else torch's default_collate) and
    hands on the tag of the batch's last item: the tag never reaches the collate."""

    def __init__(self, collate: Callable[[list[Any]], Any] = default_collate) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[Any, Tag | None]]) -> tuple[Any, Tag | None]:
        return self.collate([item for item, _ in items]), items[-1][1]


class StreamFeed:
    """The training process's side: batches in the order an uninterrupted run takes them,
    and the positions of the batches it took, for checkpoints.

    A DataLoader deals batches round-robin from its workers, starting at worker 0; after a
    resume the next batch is due from another worker, so the first batches are put back in
    that order (at most one batch per worker is held)."""

    def __init__(self, loader: Any, share: StreamShare, workers: int, world: int) -> None:
        self.loader, self.share, self.workers, self.world = loader, share, workers, world
        self.positions: dict[int, Position] = {}
        self.next_worker = 0

    samples: int | None = None  # a stream has no length and no epochs
    batches_per_epoch: int | None = None

    def start(self, epoch: int, samples_taken: int) -> Iterable[Any]:
        """The batches from where the positions stand (the arguments are the epoch feed's)."""
        self.share.start = dict(self.positions)
        return _in_turn(self.loader, self.next_worker, self.workers)

    def steps_left(self, accum: int) -> float:
        return math.inf

    def batches(self, tagged: Iterable[Any]) -> Iterator[Any]:
        for batch, tag in tagged:
            self.positions[tag.worker] = tag.position
            self.next_worker = (tag.worker + 1) % self.workers
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "next_worker": self.next_worker,
            "positions": {str(w): asdict(p) for w, p in self.positions.items()},
        }

    def load_state_dict(self, state: dict[str, Any] | None, samples_taken: int) -> str | None:
        """Continues where the checkpoint's run stood; returns a note for the user when that
        cannot be exact (another world size or number of workers) or costs time."""
        if state is None or state["workers"] != self.workers:
            # Each reader skips its part of what all readers took (a few items near the
            # boundary may be seen again or missed: the old shares do not map onto the new).
            readers = self.world * self.workers
            per_reader = samples_taken // readers
            self.positions = {w: Position(taken=per_reader) for w in range(self.workers)}
            self.next_worker = 0
            return (
                f"the train stream continues after about {samples_taken:,} items: it was "
                "saved with another number of processes or data.num_workers, so its position "
                "is approximate"
            )
        self.positions = {int(w): Position(**p) for w, p in state["positions"].items()}
        self.next_worker = state["next_worker"]
        if any(p.state is not None for p in self.positions.values()):
            return _empty_buffer_note(self.share.dataset)
        skips = [p.taken for p in self.positions.values() if p.state is None and p.taken]
        if not skips:
            return None
        return (
            f"the train stream has no state_dict(): each reader reads again and skips the "
            f"items it took (up to {max(skips):,}), which takes time; a dataset with "
            "state_dict()/load_state_dict() continues at once"
        )


def _empty_buffer_note(dataset: Any) -> str | None:
    """Restored from its own state, a stream with a shuffle buffer continues at its position,
    but not as an uninterrupted run would (a read-and-skip fast-forward would refill the
    buffer as it was; a state does not)."""
    buffer = shuffle_buffer(dataset)
    if buffer is None:
        return None
    size = getattr(buffer, "buffer_size", None)
    of = f" of {size:,} samples" if isinstance(size, int) else ""
    return (
        f"the train stream resumes at its saved position, but its shuffle buffer{of} starts "
        "empty (Hugging Face datasets does not save it): the samples that were in it are "
        "skipped in this pass, and the samples after it come in another order than in an "
        "uninterrupted run"
    )


def _in_turn(loader: Iterable[Any], first: int, workers: int) -> Iterator[Any]:
    """The loader's batches, worker `first`'s first, then round-robin as it deals them."""
    held: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)
    due = first
    for batch, tag in loader:
        held[tag.worker].append((batch, tag))
        while held[due]:
            yield held[due].popleft()
            due = (due + 1) % workers
