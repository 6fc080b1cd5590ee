"""The one training loop. It asks the strategy for everything backend-specific."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from launcher.run_layout import RunLayout
from launcher.spec import RunSpec
from launcher.telemetry import Telemetry
from launcher.train import checkpoint, memory
from launcher.train.data import batch_size, build_loader, start_epoch, steps_per_epoch
from launcher.train.metrics_window import MetricsWindow
from launcher.train.optim import build_optimizer, build_scheduler
from launcher.train.recipe import Recipe, WeightInit
from launcher.train.state import ModelState, Progress, TrainState
from launcher.train.strategies import Strategy


class Trainer:
    """Builds everything a run needs (`__init__`), then trains it (`fit`)."""

    def __init__(
        self,
        spec: RunSpec,
        recipe: Recipe,
        strategy: Strategy,
        run_dir: Path,
        attempt: int = 0,  # restarts of the run so far (torch.distributed.elastic's count)
        resume_from: Path | None = None,  # the plan's; `checkpoint.resume_point` decides
    ) -> None:
        self.spec, self.recipe, self.strategy, self.attempt = spec, recipe, strategy, attempt
        self.layout = RunLayout(run_dir)
        # First, so that the hang watchdog sees this process alive while it builds and restores.
        self.telemetry = Telemetry(run_dir, strategy.rank, strategy.is_main, attempt)
        self.telemetry.beat(0)
        strategy.seed(spec.run.seed)
        self.resume_from = checkpoint.resume_point(run_dir, resume_from, strategy)
        if attempt:
            where = "no checkpoint yet: starting over"
            if self.resume_from:
                where = f"resuming from {self.resume_from}"
            limit = spec.launch.max_restarts + 1
            self._say(
                f"attempt {attempt + 1} of {limit}: restarted after a failure; {where}",
                every_rank=True,
            )
        rss_before_build = memory.rss_bytes()
        self.model = strategy.build_model(
            lambda: recipe.build_model(**spec.recipe.model), WeightInit(recipe, spec.run.seed)
        )
        self.memory: dict[str, int] = {"build_rss_delta": memory.rss_bytes() - rss_before_build}
        self.loader = build_loader(
            recipe.build_dataset("train", **spec.recipe.dataset),
            spec.data,
            strategy.rank,
            strategy.world_size,
            spec.run.seed,
            pin_memory=strategy.device.type == "cuda",
            devices_per_process=strategy.devices_per_process,
        )
        self.steps_per_epoch = steps_per_epoch(len(self.loader), spec.train.grad_accum_steps)
        self.total_steps = _total_steps(spec, self.steps_per_epoch)
        self.optimizer = build_optimizer(
            spec.optim, self.model.parameters(), strategy.optimizer_defaults()
        )
        self.scheduler = build_scheduler(spec.optim, self.optimizer, self.total_steps)
        self.state = TrainState(strategy, self.scheduler, recipe, spec)
        self.checkpointer = checkpoint.Checkpointer(
            strategy,
            run_dir,
            ModelState(strategy, self.model, self.optimizer),
            self.state,
            keep_last=spec.checkpoint.keep_last,
            use_async=spec.checkpoint.async_,
        )
        self.last_loss: float | None = None

    @property
    def progress(self) -> Progress:
        return self.state.progress

    def fit(self) -> None:
        if self.resume_from is not None:
            self._restore(self.resume_from)
        self.telemetry.beat(self.progress.step)
        self._introduce()
        try:
            self._run()
        finally:
            self.telemetry.close()

    def _introduce(self) -> None:
        strategy = self.strategy
        n_params = sum(p.numel() for p in self.model.parameters())
        # Every rank says this; the display folds identical lines into one `[ranks 0-N]` line.
        self._say(
            f"{n_params:,} parameters | {strategy.name} on {strategy.replicas} x "
            f"{strategy.device.type} | {self.total_steps} steps, {self.steps_per_epoch} per epoch"
            + (f" | resumed at step {self.progress.step}" if self.resume_from else ""),
            every_rank=True,
        )
        devices = strategy.devices_per_process
        self._say(
            f"process {strategy.rank}/{strategy.world_size}: pid {os.getpid()}, "
            f"{strategy.device}{f' and {devices - 1} more devices' if devices > 1 else ''}, "
            f"{len(self.loader.sampler):,} samples per epoch",  # type: ignore[arg-type]
            every_rank=True,
        )

    def _run(self) -> None:
        spec, progress = self.spec, self.progress
        saved_at = progress.step
        stop_file = self.layout.stop_request
        stopped = False
        while progress.step < self.total_steps and not stopped:
            per_replica = progress.samples_in_epoch // self.strategy.world_size
            start_epoch(self.loader, progress.epoch, per_replica, spec.run.seed, self.strategy.rank)
            batches = iter(self.strategy.loader(self.loader))
            left = len(self.loader) // spec.train.grad_accum_steps
            for _ in range(min(left, self.total_steps - progress.step)):
                started = time.perf_counter()
                self._step(batches)
                self.telemetry.step_done(time.perf_counter() - started)
                self.telemetry.beat(progress.step)
                if progress.step % spec.train.log_every == 0 or progress.step == self.total_steps:
                    self._log()
                every = spec.checkpoint.every_n_steps
                if every and progress.step % every == 0 and spec.checkpoint.enabled:
                    self._save()
                    saved_at = progress.step
                self.checkpointer.poll()
                # The launcher asks for a stop (Ctrl-C, SIGTERM) with a file; every rank must
                # agree on the step, or a rank that saw it late would wait for the others.
                if self.strategy.any_rank(stop_file.exists()):
                    stopped = True
                    self._say(f"stop requested: stopping after step {progress.step}")
                    break
            if progress.step < self.total_steps and not stopped:  # the epoch ran out
                progress.epoch += 1
                progress.samples_in_epoch = 0
        if saved_at != progress.step and spec.checkpoint.enabled:
            self._save()
        self._finish()

    def _finish(self) -> None:
        self.checkpointer.close()
        self.strategy.drain()
        self.memory.update(
            params=memory.local_bytes(self.model.parameters()),
            optimizer=memory.optimizer_bytes(self.optimizer),
            peak_rss=memory.peak_rss_bytes(),
        )
        backend = self.strategy.summary()
        self.telemetry.write_summary(
            final_loss=self.last_loss,
            world_size=self.strategy.world_size,
            replicas=self.strategy.replicas,
            memory=self.memory,
            **backend,
        )
        last = self.layout.latest_complete()
        self._say(
            f"done: {self.progress.step} steps"
            + "".join(f" | {k} {v}" for k, v in backend.items())
            + (f"; last checkpoint {last}" if last else "")
        )

    def _step(self, batches: Any) -> None:
        accum = self.spec.train.grad_accum_steps
        total_loss: torch.Tensor | None = None
        totals: dict[str, torch.Tensor] = {}
        samples = 0
        for i in range(accum):
            batch = next(batches)
            samples += batch_size(batch)
            with self.strategy.sync_gradients(self.model, sync=i == accum - 1):
                with self.strategy.autocast():
                    loss, metrics = self.recipe.loss(self.model, batch)
                self.strategy.backward(loss / accum if accum > 1 else loss)
            # Accumulate on the device: reading a value here would stall the pipeline.
            loss = loss.detach().float()
            total_loss = loss if total_loss is None else total_loss + loss
            for k, v in metrics.items():
                value = torch.as_tensor(v, device=self.strategy.device).detach().float()
                totals[k] = totals[k] + value if k in totals else value
        if "grads" not in self.memory:
            self.memory["grads"] = memory.local_bytes(p.grad for p in self.model.parameters())
        waited = self.checkpointer.before_update()
        if waited:
            self.telemetry.checkpoint_blocked(waited, same_save=True)
        self.strategy.optimizer_step(self.model, self.optimizer, self.spec.train.grad_clip_norm)
        self.scheduler.step()
        assert total_loss is not None
        if accum > 1:
            total_loss, totals = total_loss / accum, {k: v / accum for k, v in totals.items()}
        # Before the step's graph is cut (XLA): the window's sums are part of the step.
        self.state.window.add(total_loss, totals)
        self.strategy.on_step_end(self.progress.step + 1)
        self.progress.step += 1
        # Every replica's shard has the same length (the sampler pads), so the global count is
        # exact, also for a short last batch (data.drop_last: false).
        self.progress.samples_in_epoch += samples * self.strategy.world_size

    def _log(self) -> None:
        window = self.state.window
        local = window.mean()
        names = list(local)
        reduced = self.strategy.reduce_mean(torch.stack([local[k] for k in names]))
        # This rank's own loss rides along, for its heartbeat.
        values = torch.cat([reduced, local["loss"].reshape(1).to(reduced.dtype)])
        step, epoch = self.progress.step, self.progress.epoch
        lr = self.scheduler.get_last_lr()[0]
        per_step = window.seconds_per_step()
        self.state.window = MetricsWindow()
        self.strategy.read(
            values, lambda host: self._report(names, host, step, epoch, lr, per_step)
        )

    def _report(
        self,
        names: list[str],
        values: list[float],
        step: int,
        epoch: int,
        lr: float,
        per_step: float,
    ) -> None:
        mean = dict(zip(names, values[:-1], strict=True))
        rate = self.spec.train.grad_accum_steps * self.spec.data.batch_size / per_step
        total = self.total_steps
        self.last_loss = mean["loss"]
        self.telemetry.status(step=step, max_steps=total, loss=values[-1], samples_per_s=rate)
        rate *= self.strategy.replicas
        self.telemetry.metrics(step=step, epoch=epoch, lr=lr, samples_per_s=rate, **mean)
        extras = "".join(f" | {k} {v:.4g}" for k, v in mean.items() if k != "loss")
        self._say(
            f"step {step}/{total} | loss {mean['loss']:.4f}{extras} | lr {lr:.2e} | "
            f"{rate:,.{0 if rate >= 100 else 2}f} samples/s | {1000 * per_step:.1f} ms/step"
        )

    def _save(self) -> None:
        started = time.perf_counter()
        # Saving must not move the random streams (XLA advances its seed at every graph cut),
        # or the run would go on drawing other numbers than a run resumed from this save.
        rng = self.strategy.rng_state()
        self.checkpointer.save(self.progress.step)
        self.telemetry.beat(self.progress.step)  # a long save is not a hang
        self.strategy.set_rng_state(rng)
        self.telemetry.checkpoint_blocked(time.perf_counter() - started)

    def _restore(self, path: Path) -> None:
        if self.checkpointer.load(path):
            return
        # Saved with another world size: per-rank streams cannot continue; reseed them.
        self.strategy.seed(self.spec.run.seed + self.progress.step + self.strategy.rank)
        self._say(
            f"resuming with {self.strategy.world_size} replicas instead of "
            f"{checkpoint.read_meta(path)['world_size']}: model, optimizer and data position "
            "continue; random streams are reseeded"
        )

    def _say(self, text: str, every_rank: bool = False) -> None:
        if every_rank or self.strategy.is_main:
            print(text, flush=True)


def _total_steps(spec: RunSpec, steps_per_epoch: int) -> int:
    limits = [spec.train.max_steps or math.inf]
    if spec.train.max_epochs:
        limits.append(spec.train.max_epochs * steps_per_epoch)
    return int(min(limits))
