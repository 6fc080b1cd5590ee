"""Sharding the user's dataset across replicas; recipes never write samplers."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    default_collate,
)

from launcher.config.spec import DataSection, TrainSection
from launcher.errors import UsageError
from launcher.worker.loader_workers import worker_options
from launcher.worker.recipe import collate_takes_split


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way through an epoch, so a resumed run sees
    exactly the samples an uninterrupted run would have seen next."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self._skip = min(skip, self.num_samples)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self._skip :])

    def __len__(self) -> int:
        return self.num_samples - self._skip


class EpochFeed:
    """A map-style dataset's batches: epochs of known length, positioned by the run's
    progress alone (the sampler's order is a function of the seed and the epoch)."""

    def __init__(self, loader: DataLoader, seed: int, rank: int, world: int) -> None:
        self.loader, self.seed, self.rank, self.world = loader, seed, rank, world
        self.samples: int | None = len(loader.sampler)  # type: ignore[arg-type]
        self.batches_per_epoch: int | None = len(loader)

    def start(self, epoch: int, samples_taken: int) -> DataLoader:
        """The loader, at `samples_taken` (global) into `epoch`."""
        start_epoch(self.loader, epoch, samples_taken // self.world, self.seed, self.rank)
        return self.loader

    def batches(self, loaded: Iterable[Any]) -> Iterator[Any]:
        return iter(loaded)

    def steps_left(self, accum: int) -> float:
        return len(self.loader) // accum

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any, samples_taken: int) -> str | None:
        return None


def build_feed(
    dataset: Dataset,
    data: DataSection,
    train: TrainSection,
    rank: int,
    world_size: int,
    seed: int,
    pin_memory: bool,
    devices_per_process: int = 1,
    collate: Callable[..., Any] | None = None,
) -> Any:
    """This process's batches of the train split: an `EpochFeed`, or a `StreamFeed` for a
    stream (`launcher.worker.stream`). Both give the loop the same methods. `collate`: the
    recipe's `collate(samples)` (`Recipe.collate_hook`), None for torch's default_collate."""
    if not is_stream(dataset):
        loader = build_loader(
            dataset, data, rank, world_size, seed, pin_memory, devices_per_process, collate
        )
        return EpochFeed(loader, seed, rank, world_size)
    from launcher.worker.stream import StreamFeed, StreamShare, TaggedCollate

    check_stream_limits(train)
    batch = data.batch_size * devices_per_process
    share = StreamShare(dataset, rank, world_size, repeat=True, batch=batch)  # type: ignore[arg-type]
    tagged = TaggedCollate(collate_fn(collate, "train") or default_collate)
    loader = DataLoader(
        share,
        batch_size=batch,
        num_workers=data.num_workers,
        collate_fn=tagged,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed * 1_000_003 + rank),
        **worker_options(data, {"the train dataset": share, "the recipe's collate": tagged}),
    )
    return StreamFeed(loader, share, max(1, data.num_workers), world_size)


def build_loader(
    dataset: Dataset,
    data: DataSection,
    rank: int,
    world_size: int,
    seed: int,
    pin_memory: bool,
    devices_per_process: int = 1,
    collate: Callable[..., Any] | None = None,
) -> DataLoader:
    """This process's loader: `data.batch_size` samples for each device it drives, collated
    by the recipe's `collate` where it has one."""
    size = dataset_length(dataset, "train")
    batch_size = data.batch_size * devices_per_process
    if size < batch_size * world_size and data.drop_last:
        raise UsageError(
            f"data.batch_size: {size} samples cannot fill one batch of {data.batch_size} "
            f"on each of {world_size * devices_per_process} replicas; lower data.batch_size "
            "or set data.drop_last=false"
        )
    sampler = ResumableSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=data.shuffle,
        seed=seed,
        drop_last=data.drop_last,
    )
    collated = collate_fn(collate, "train")
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=data.num_workers,
        drop_last=data.drop_last,
        collate_fn=collated,
        pin_memory=pin_memory,
        # Workers restart each epoch and are seeded by start_epoch(), so a resumed epoch's
        # workers get the same seeds as the original's (persistent ones would keep old seeds).
        persistent_workers=False,
        generator=torch.Generator(),
        **worker_options(data, {"the train dataset": dataset, "the recipe's collate": collated}),
    )


def is_stream(dataset: Any) -> bool:
    """Whether a split is streamed (an IterableDataset): no length, no sampler, no epochs."""
    return isinstance(dataset, IterableDataset)


def check_stream_limits(train: TrainSection) -> None:
    """A stream has no epochs to count: its run is `train.max_steps` long."""
    if train.max_steps is None:
        raise UsageError(
            "train.max_steps: the train split is a stream (an IterableDataset), which has no "
            "epochs; set train.max_steps (train.max_epochs cannot be counted)"
        )


def dataset_length(dataset: Dataset, split: str) -> int:
    """The number of samples of a split; a clear error for a dataset a sampler cannot shard."""
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(
            f"recipe: build_dataset({split!r}) returned a {type(dataset).__name__}, which has "
            "no __len__",
            hint="Return a map-style Dataset (__getitem__ and __len__), or a "
            "torch.utils.data.IterableDataset to stream it.",
        ) from None
    if size == 0:
        raise UsageError(f"recipe: build_dataset({split!r}) is empty")
    return size


def start_epoch(loader: DataLoader, epoch: int, skip_samples: int, seed: int, rank: int) -> None:
    """Positions the loader at `skip_samples` into this replica's share of `epoch`."""
    loader.sampler.set_epoch(epoch, skip=skip_samples)  # type: ignore[attr-defined]
    # DataLoader worker seeds are drawn from this generator: make them a function of the epoch.
    assert loader.generator is not None
    loader.generator.manual_seed(((seed * 1_000_003 + epoch) * 65_537 + rank) % 2**63)


# The key of a dict batch by which a recipe's collate gives its number of samples, where its
# tensors' leading dimension cannot (a packed batch: all sequences in one row).
NUM_SAMPLES = "num_samples"


def batch_size(batch: Any) -> int:
    """Samples in a batch: its `num_samples` (an int in a dict batch), else the leading
    dimension its tensors share (default_collate stacks every tensor along it)."""
    if isinstance(batch, dict) and type(batch.get(NUM_SAMPLES)) is int:
        return batch[NUM_SAMPLES]
    sizes = dict(_leading_sizes(batch, "batch"))
    if not sizes:
        raise UsageError(
            "recipe: a batch holds no tensor; build_dataset items (or what collate returns) "
            "must contain tensors"
        )
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"{path} {size}" for path, size in list(sizes.items())[:4])
        raise UsageError(
            f"recipe: the batch's tensors disagree on its number of samples (leading "
            f"dimensions: {shown})",
            hint=f"A recipe's collate(samples) whose tensors are not one row per sample "
            f"returns a dict with the count: {{..., {NUM_SAMPLES!r}: len(samples)}} "
            "(docs/recipes.md#collate-padding-a-batch).",
        )
    return next(iter(sizes.values()))


def _leading_sizes(batch: Any, path: str) -> Iterator[tuple[str, int]]:
    """(where, leading dimension) of every tensor of a batch with one; a 0-d tensor, a
    number for the whole batch, has none."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() > 0:
            yield path, batch.shape[0]
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from _leading_sizes(value, f"{path}[{key!r}]")
    elif isinstance(batch, list | tuple):
        for i, value in enumerate(batch):
            yield from _leading_sizes(value, f"{path}[{i}]")


class Collate:
    """A recipe's `collate(samples)` as a DataLoader's collate_fn (a class, not a closure, so
    that it can be pickled into worker processes), given the split by name where it takes
    one (`collate(samples, split)`). Its batch must count the samples it was given
    (`batch_size`), which epoch positions, throughput and the exact evaluation mean rely on."""

    def __init__(self, hook: Callable[..., Any], split: str = "train") -> None:
        self.hook, self.split = hook, split
        self.takes_split = collate_takes_split(hook)

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.hook(samples, split=self.split) if self.takes_split else self.hook(samples)
        if isinstance(batch, Mapping) and not isinstance(batch, dict):
            batch = dict(batch)  # a tokenizer's BatchEncoding: moved to the device as a dict
        counted = batch_size(batch)
        if counted != len(samples):
            raise UsageError(
                f"recipe: collate() was given {len(samples)} samples, but its batch counts "
                f"{counted}",
                hint=f"A batch holds the samples collate was given: put {NUM_SAMPLES!r}: "
                "len(samples) in a dict batch whose tensors' leading dimension is not the "
                "number of samples, and filter samples in build_dataset, not in collate.",
            )
        return batch


def collate_fn(hook: Callable[..., Any] | None, split: str = "train") -> Collate | None:
    """The DataLoader's collate_fn of `split` ("train" or "val") for a recipe's collate hook;
    None (torch's default_collate) where the recipe has none."""
    return None if hook is None else Collate(hook, split)


def steps_per_epoch(batches: int, accum: int) -> int:
    """Optimizer steps in an epoch of `batches` micro-batches per replica."""
    steps = batches // accum
    if steps == 0:
        raise UsageError(
            f"train.grad_accum_steps: {accum} micro-batches per step, "
            f"but an epoch has only {batches} per replica; lower it or data.batch_size"
        )
    return steps


def total_steps(train: TrainSection, steps_per_epoch: int | None) -> int:
    """The run's length: `train.max_steps` or `train.max_epochs`, whichever comes first (a
    stream, with no epochs, has `steps_per_epoch` None)."""
    limits = [train.max_steps or math.inf]
    if train.max_epochs and steps_per_epoch:
        limits.append(train.max_epochs * steps_per_epoch)
    return int(min(limits))


def example_batch(dataset: Dataset, size: int, collate: Callable[..., Any] | None) -> Any:
    """A batch of the dataset's first `size` samples, collated as training collates them: the
    shapes a pipeline's stages are traced with (`launcher.parallel.pipeline`)."""
    if isinstance(dataset, IterableDataset):
        samples = [sample for sample, _ in zip(dataset, range(size), strict=False)]
    else:
        samples = [dataset[i] for i in range(min(size, len(dataset)))]  # type: ignore[arg-type]
    return (collate_fn(collate, "train") or default_collate)(samples)
