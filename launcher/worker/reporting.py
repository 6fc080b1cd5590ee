"""What a run says: rank 0's log lines and metrics records, and every rank's status records
for the live table (files: `launcher.metrics.telemetry`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from launcher.checkpoint.store import Best
from launcher.config.spec import RunSpec
from launcher.metrics.telemetry import Telemetry
from launcher.parallel.base import Strategy
from launcher.worker.flops import Speed, describe
from launcher.worker.metrics_window import MetricsWindow
from launcher.worker.param_groups import Grouping

# The axes of `launcher.parallel.dims` whose processes each take their own batches.
DATA_AXES = {"dp_replicate", "dp_shard"}


class Reporter:
    def __init__(
        self,
        spec: RunSpec,
        strategy: Strategy,
        telemetry: Telemetry,
        total_steps: int,
        steps_per_epoch: int | None,  # None: a stream
        speed: Speed,
    ) -> None:
        self.spec, self.strategy, self.telemetry, self.speed = spec, strategy, telemetry, speed
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.last_loss: float | None = None
        self.last_val: float | None = None  # the table's `val` column
        monitor = spec.checkpoint.monitor or spec.early_stop.monitor
        self.shown_val = monitor or "val/loss"
        # What looks at each logged window's means, and may warn (`watch`).
        self._watchers: list[Callable[[dict[str, float], int], str | None]] = []

    def watch(self, watcher: Callable[[dict[str, float], int], str | None]) -> None:
        """`watcher(means, steps)` sees each logged window (its means over the replicas and
        its number of steps); what it returns is said as a warning."""
        self._watchers.append(watcher)

    def introduce(self, grouping: Grouping, samples: int | None, resumed_at: int | None) -> None:
        """`samples`: this rank's share of an epoch; None for a stream."""
        strategy = self.strategy
        per_epoch = (
            "a stream" if self.steps_per_epoch is None else f"{self.steps_per_epoch} per epoch"
        )
        share = "its share of the stream" if samples is None else f"{samples:,} samples per epoch"
        # Every rank says this; the display folds identical lines into one `[ranks 0-N]` line.
        dims, devices = strategy.dims, strategy.world_size * strategy.devices_per_process
        # Named where it is more than one data axis (every axis, a new one too, says so).
        split = {axis for axis, degree in dims.as_record().items() if degree > 1} if dims else set()
        layout = f" ({dims.describe()})" if dims and (split - DATA_AXES or len(split) > 1) else ""
        self.say(
            f"{grouping.count()} | {strategy.name}{layout} on {devices} x "
            f"{strategy.device.type} | {self.total_steps} steps, {per_epoch}"
            + (f" | resumed at step {resumed_at}" if resumed_at is not None else ""),
            every_rank=True,
        )
        devices = strategy.devices_per_process
        self.say(
            f"process {strategy.rank}/{strategy.world_size}: pid {os.getpid()}, "
            f"{strategy.device}{f' and {devices - 1} more devices' if devices > 1 else ''}, "
            f"{share}",
            every_rank=True,
        )
        for line in grouping.lines():
            self.say(line)
        # Said right before the first step: the start is over (`launcher.worker.startup`).
        from launcher.worker.startup import over

        over()

    def say(self, text: str, every_rank: bool = False) -> None:
        if text and (every_rank or self.strategy.is_main):
            print(text, flush=True)

    def say_for_run(self, text: str) -> None:
        """A line of the run's values (reduced over every replica): once per run, by the
        rank 0 of the group that saves the step's checkpoint, which is every run's rank 0
        but under replica groups, whose each rank 0 would say the same (the group leading
        the quorum, another while it is lost)."""
        if self.strategy.engine.saves_checkpoints:
            self.say(text)

    def log(
        self,
        window: MetricsWindow,
        step: int,
        epoch: int,
        rates: dict[str, float],
        own: torch.Tensor,
        receive_own: Callable[[list[float]], None],
        pace: dict[str, list[float | None]] | None = None,
    ) -> None:
        """The window's means over every replica, read without stalling the device. `rates`:
        the learning rates step `step` used (`lr`, and `lr/<group>` where groups differ).
        `own` (this rank's values, not reduced) rides along; `receive_own` gets their host
        values. `pace`: each rank's seconds per step in its parts (`launcher.worker.
        stragglers.by_rank`), recorded as they are."""
        local = window.mean()
        names = list(local)
        reduced = self.strategy.reduce_mean(torch.stack([local[k] for k in names]))
        # This rank's own loss rides along too, for its heartbeat.
        values = torch.cat(
            [reduced, local["loss"].reshape(1).to(reduced.dtype), own.to(reduced.dtype)]
        )
        per_step = window.seconds_per_step()
        steps = window.steps
        by_rank = pace or {}

        def report(host: list[float]) -> None:
            mean = dict(zip(names, host[: len(names)], strict=True))
            self._report(mean, host[len(names)], step, epoch, rates, per_step, by_rank)
            for watcher in self._watchers:
                said = watcher(mean, steps)
                if said:
                    self.say_for_run(f"warning: {said}")
            receive_own(host[len(names) + 1 :])

        self.strategy.read(values, report)

    def _report(
        self, mean: dict[str, float], own_loss: float, step: int, epoch: int,
        rates: dict[str, float], per_step: float, by_rank: dict[str, list[float | None]],
    ) -> None:  # fmt: skip
        rate = self.spec.train.grad_accum_steps * self.spec.data.batch_size / per_step
        total = self.total_steps
        self.last_loss = mean["loss"]
        speed = self.speed.fields(per_step)  # this rank's: the table shows each rank's own
        self.telemetry.status(
            step=step, max_steps=total, loss=own_loss, samples_per_s=rate, val=self.last_val,
            **speed,
        )  # fmt: skip
        rate *= self.strategy.replicas
        engine = self.strategy.engine.metrics()  # across replica groups: bytes, syncs
        self.telemetry.metrics(
            step=step,
            epoch=epoch,
            **rates,
            samples_per_s=rate,
            **mean,
            **speed,
            **engine,
            **by_rank,
        )
        extras = "".join(f" | {k} {v:.4g}" for k, v in mean.items() if k != "loss")
        self.say_for_run(
            f"step {step}/{total} | loss {mean['loss']:.4f}{extras} | lr {rates['lr']:.2e} | "
            f"{rate:,.{0 if rate >= 100 else 2}f} samples/s | {1000 * per_step:.1f} ms/step"
            + describe(speed)
        )

    def evaluation(self, step: int, epoch: int, metrics: dict[str, float], seconds: float) -> None:
        self.last_val = metrics.get(self.shown_val)
        self.telemetry.status(step=step, max_steps=self.total_steps, val=self.last_val)
        self.telemetry.metrics(step=step, epoch=epoch, eval_s=round(seconds, 3), **metrics)
        shown = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self.say_for_run(f"eval at step {step} | {shown} | {seconds:.2f} s")

    def finish(
        self,
        step: int,
        memory: dict[str, int],
        backend: dict[str, Any],
        best: Best | None,
        skipped: int,
        last: Path | None,
        written: list[float],
    ) -> None:
        """summary.json and the last line. Collective on GPUs (each rank's peak memory)."""
        speed = self.speed.summary(self.telemetry.step_times.median)
        if self.strategy.device.type == "cuda":
            memory_now = self.speed.fields(0.0)  # memory only: no step time
            speed["device_memory"] = self.strategy.control.gather(memory_now)
        self.telemetry.write_summary(
            **speed,
            final_loss=self.last_loss,
            world_size=self.strategy.world_size,
            replicas=self.strategy.replicas,
            memory=memory,
            **({"best_checkpoint": str(best.path), "best_score": best.score} if best else {}),
            **({"skipped_updates": skipped} if skipped else {}),
            **({"checkpoint_written_s": [round(s, 4) for s in written]} if written else {}),
            **backend,
        )
        shown = {k: v for k, v in backend.items() if not isinstance(v, dict | list)}
        self.say(
            f"done: {step} steps"
            + (f", {skipped} updates skipped (non-finite)" if skipped else "")
            + "".join(f" | {k} {v}" for k, v in shown.items())
            + (f"; last checkpoint {last}" if last else "")
            + (f"; best checkpoint {best.describe()}" if best else "")
        )
