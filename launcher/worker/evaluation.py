"""Evaluation on the recipe's `val` split: the exact mean over the split, on any number of
replicas.

Every replica runs the same number of batches of the same shapes (FSDP gathers parameters in
every forward, XLA compiles each shape): the sampler pads the split to a multiple of the world
size by repeating samples, as DistributedSampler does. Padding is never counted: it sits at
the end of each replica's share, so a batch holding some is cut to its real samples before
it is collated (by the recipe's `collate`, if it has one), and a batch of padding alone runs
for the collectives but weighs nothing. Each batch's metrics are weighted by its number of
real samples, and sums and counts are reduced across replicas, so 1, 2 or 3 processes give
the same mean.

A streamed split (an IterableDataset) is read from its start at every evaluation, each rank
its own share (`launcher.worker.stream`), for exactly `eval.max_batches` batches on every rank;
the mean is over the samples read, as each batch counts them (`batch_size`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from launcher.config.spec import RunSpec
from launcher.errors import RunError, UsageError
from launcher.parallel.base import Strategy
from launcher.worker.data import batch_size, collate_fn, dataset_length, is_stream
from launcher.worker.loader_workers import worker_options
from launcher.worker.recipe import Recipe
from launcher.worker.stream import StreamShare


class Evaluator:
    def __init__(self, recipe: Recipe, spec: RunSpec, strategy: Strategy) -> None:
        self.recipe, self.strategy = recipe, strategy
        dataset = recipe.build_dataset("val", **spec.recipe.dataset)
        world, rank = strategy.dp_size, strategy.dp_rank
        self.batch = spec.data.batch_size * strategy.devices_per_process
        self.seed = spec.run.seed * 1_000_003 + rank
        limit = spec.eval.max_batches
        self.weights: list[int] | None = None  # a stream's batches weigh their own size
        if is_stream(dataset):
            self.stream_batches = stream_eval_batches(limit)
            share = StreamShare(dataset, rank, world, repeat=False)
            self.loader = self._loader(spec, share, batch_size=self.batch)
            return
        size = _same_everywhere(dataset_length(dataset, "val"), strategy)
        sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=False, drop_last=False
        )
        _check_spmd_hosts(size, world, self.batch, strategy.devices_per_process)
        batches = -(-sampler.num_samples // self.batch)
        batches = batches if limit is None else min(limit, batches)
        # The sampler deals the split round-robin: replica r's real samples are r, r+W, ...
        real, share = len(range(rank, size, world)), sampler.num_samples
        self.weights = [
            max(0, min(real - i * self.batch, share - i * self.batch, self.batch))
            for i in range(batches)
        ]
        batcher = _RealBatches(sampler, self.batch, self.weights)
        self.loader = self._loader(spec, dataset, batch_sampler=batcher)

    def _loader(self, spec: RunSpec, split: Any, **batching: Any) -> DataLoader:
        """The val split's loader: the recipe's collate told it is "val", workers as
        `data.worker_start` says."""
        collated = collate_fn(self.recipe.collate_hook(), "val")
        return DataLoader(
            split,
            num_workers=spec.data.num_workers,
            collate_fn=collated,
            pin_memory=self.strategy.device.type == "cuda",
            generator=torch.Generator(),  # its seeds never come from the training streams
            **batching,
            **worker_options(
                spec.data, {"the val dataset": split, "the recipe's collate": collated}
            ),
        )

    def run(self, model: torch.nn.Module, step: int, alive: Callable[[], None]) -> dict[str, float]:
        """Collective: the split's mean of every metric, as `val/<name>`, the same on every
        rank. The training random streams are left as they were; `alive` is called after
        each batch (the hang watchdog's heartbeat)."""
        strategy = self.strategy
        rng = strategy.rng.state()
        assert self.loader.generator is not None  # the same worker seeds at every evaluation
        self.loader.generator.manual_seed(self.seed)
        was_training = model.training
        model.eval()
        try:
            with strategy.phase("eval", step), torch.no_grad():
                strategy.steps.agree_buffers(model)
                sums, count = self._accumulate(model, alive)
                # The last batch's work runs on its own: on XLA, replicas whose last batches
                # differ in size would otherwise run different programs around one all-reduce.
                strategy.drain()
                names = sorted(sums)
                values = torch.stack([*(sums[k] for k in names), count])
                reduced = strategy.reduce_mean(values).cpu().tolist()
        finally:
            model.train(was_training)
            strategy.rng.set_state(rng)
        *totals, samples = reduced
        return {f"val/{k}": total / samples for k, total in zip(names, totals, strict=True)}

    def _accumulate(
        self, model: torch.nn.Module, alive: Callable[[], None]
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        device = self.strategy.device
        sums: dict[str, torch.Tensor] = {}
        count = torch.zeros((), device=device)
        if self.weights is None:
            limit = self.stream_batches
            weights: Iterable[int | None] = itertools.repeat(None, limit)
            batches = self.strategy.loader(itertools.islice(self.loader, limit))
        else:
            weights = self.weights
            batches = self.strategy.loader(self.loader)
        taken = 0
        for weight, batch in zip(weights, batches, strict=False):
            taken += 1
            if weight is None:
                weight = batch_size(batch)
            metrics = self.strategy.steps.evaluate_batch(model, batch, self.recipe.evaluate)
            if sums and sorted(metrics) != sorted(sums):
                raise RunError(
                    f"recipe: evaluate() returned {sorted(metrics)} for one batch and "
                    f"{sorted(sums)} for another; every batch must give the same metrics"
                )
            # A tensor, not a Python number: XLA would bake each new number into its graph.
            w = torch.tensor(float(weight), device=device)
            for name, value in metrics.items():
                value = torch.as_tensor(value, device=device).detach().float() * w
                sums[name] = sums[name] + value if name in sums else value
            count = count + w
            alive()
        if self.weights is None and taken < self.stream_batches:
            # Every rank must run as many batches (FSDP's forward gathers across ranks).
            raise RunError(
                f"eval.max_batches: the val stream gave rank {self.strategy.rank} only {taken} "
                f"of {self.stream_batches} batches",
                hint="Lower eval.max_batches to what every rank's share of the stream holds.",
            )
        return sums, count


class _RealBatches:
    """The sampler's indices in batches, each cut to its real samples before it is collated
    (a batch of padding alone stays whole: it runs, weighing nothing); `weights[i]` is batch
    i's number of real samples, and there are as many batches as weights."""

    def __init__(self, sampler: DistributedSampler, batch: int, weights: list[int]) -> None:
        self.sampler, self.batch, self.weights = sampler, batch, weights

    def __len__(self) -> int:
        return len(self.weights)

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        for i, weight in enumerate(self.weights):
            chunk = indices[i * self.batch : (i + 1) * self.batch]
            yield chunk[:weight] if weight else chunk


def _same_everywhere(size: int, strategy: Strategy) -> int:
    """Every rank must build the same split: a rank with more batches would wait forever in
    a collective of its forward (FSDP) for ranks that are done."""
    sizes = strategy.control.gather(size)
    if len(set(sizes)) > 1:
        raise RunError(
            f"recipe: build_dataset('val') gives {', '.join(map(str, sizes))} samples on ranks "
            f"0-{len(sizes) - 1}; every rank must build the same split"
        )
    return size


def stream_eval_batches(limit: int | None) -> int:
    """The batches each rank evaluates of a streamed val split: `eval.max_batches`, which a
    stream needs, since it may never end."""
    if limit is None:
        raise UsageError(
            "eval.max_batches: the val split is a stream (an IterableDataset); set "
            "eval.max_batches, the batches each process evaluates"
        )
    return limit


def _check_spmd_hosts(size: int, world: int, batch: int, devices: int) -> None:
    # Under SPMD every host feeds its part of one global batch: batches cut to their real
    # samples would differ in size from host to host.
    if devices > 1 and world > 1 and size % (world * batch):
        raise UsageError(
            f"eval: with {world} hosts of {devices} devices, the val split ({size} samples) "
            f"must be a multiple of {world * batch} (hosts x data.batch_size x devices)",
            hint="Trim or pad the val split in the recipe's build_dataset.",
        )
