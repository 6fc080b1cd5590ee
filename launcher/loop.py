"""The one training loop. It asks the strategy for everything backend-specific."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from launcher import checkpoint
from launcher.data import build_loader
from launcher.errors import RunError
from launcher.optim import build_optimizer, build_scheduler
from launcher.recipe import Recipe
from launcher.rng import seed_everything
from launcher.spec import RunSpec
from launcher.strategies import Strategy
from launcher.telemetry import Telemetry


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    samples_in_epoch: int = 0  # global samples consumed in `epoch`: valid across world sizes


@dataclass
class Trainer:
    spec: RunSpec
    recipe: Recipe
    strategy: Strategy
    run_dir: Path

    def fit(self, resume_from: Path | None = None) -> None:
        spec, strategy = self.spec, self.strategy
        seed_everything(spec.run.seed)
        raw_model = self.recipe.build_model(**spec.recipe.model)
        n_params = sum(p.numel() for p in raw_model.parameters())
        self.model = strategy.wrap_model(raw_model)
        dataset = self.recipe.build_dataset("train", **spec.recipe.dataset)
        self.loader = build_loader(
            dataset,
            spec.data,
            strategy.rank,
            strategy.world_size,
            spec.run.seed,
            pin_memory=strategy.device.type == "cuda",
        )
        self.steps_per_epoch = len(self.loader) // spec.train.grad_accum_steps
        if self.steps_per_epoch == 0:
            raise RunError(
                f"train.grad_accum_steps={spec.train.grad_accum_steps} needs more batches than "
                f"one epoch has ({len(self.loader)} per replica)"
            )
        self.total_steps = _total_steps(spec, self.steps_per_epoch)
        self.optimizer = build_optimizer(spec.optim, self.model.parameters())
        self.scheduler = build_scheduler(spec.optim, self.optimizer, self.total_steps)
        self.progress = Progress()
        if resume_from is not None:
            self._restore(resume_from)
        self.telemetry = Telemetry(self.run_dir, strategy.rank, strategy.is_main)
        # Every rank says this; the display folds identical lines into one `[ranks 0-N]` line.
        self._say(
            f"{n_params:,} parameters | {strategy.name} on {strategy.world_size} x "
            f"{strategy.device.type} | {self.total_steps} steps, {self.steps_per_epoch} per epoch"
            + (f" | resumed at step {self.progress.step}" if resume_from else ""),
            every_rank=True,
        )
        self._say(
            f"replica {strategy.rank}/{strategy.world_size}: pid {os.getpid()}, "
            f"{strategy.device}, {len(self.loader.sampler):,} samples per epoch",  # type: ignore[arg-type]
            every_rank=True,
        )
        try:
            self._run()
        finally:
            self.telemetry.close()

    def _run(self) -> None:
        spec, progress = self.spec, self.progress
        saved_at = progress.step
        window = _Window()
        while progress.step < self.total_steps:
            per_replica = progress.samples_in_epoch // self.strategy.world_size
            self.loader.sampler.set_epoch(progress.epoch, skip=per_replica)  # type: ignore[attr-defined]
            batches = iter(self.strategy.loader(self.loader))
            left = len(self.loader) // spec.train.grad_accum_steps
            for _ in range(min(left, self.total_steps - progress.step)):
                started = time.perf_counter()
                loss, metrics = self._step(batches)
                self.telemetry.step_done(time.perf_counter() - started)
                window.add(loss, metrics)
                if progress.step % spec.train.log_every == 0 or progress.step == self.total_steps:
                    self._log(window)
                    window = _Window()
                every = spec.checkpoint.every_n_steps
                if every and progress.step % every == 0:
                    self._save()
                    saved_at = progress.step
            if progress.step < self.total_steps:  # the epoch ran out before the step budget
                progress.epoch += 1
                progress.samples_in_epoch = 0
        if saved_at != progress.step:
            self._save()
        final = self._last_loss
        self.telemetry.write_summary(final_loss=final, world_size=self.strategy.world_size)
        self._say(
            f"done: {progress.step} steps; last checkpoint {checkpoint.checkpoint_dir(self.run_dir, progress.step)}"
        )

    def _step(self, batches: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        accum = self.spec.train.grad_accum_steps
        total_loss = torch.zeros((), device=self.strategy.device)
        totals: dict[str, torch.Tensor] = {}
        for i in range(accum):
            batch = next(batches)
            with self.strategy.sync_gradients(self.model, sync=i == accum - 1):
                with self.strategy.autocast():
                    loss, metrics = self.recipe.loss(self.model, batch)
                self.strategy.backward(loss / accum)
            # Accumulate on the device: reading a value here would stall the pipeline.
            total_loss += loss.detach().float()
            for k, v in metrics.items():
                totals[k] = (
                    totals.get(k, 0)
                    + torch.as_tensor(v, device=self.strategy.device).detach().float()
                )
        self.strategy.optimizer_step(self.model, self.optimizer, self.spec.train.grad_clip_norm)
        self.scheduler.step()
        self.strategy.on_step_end()
        self.progress.step += 1
        self.progress.samples_in_epoch += (
            accum * self.spec.data.batch_size * self.strategy.world_size
        )
        return total_loss / accum, {k: v / accum for k, v in totals.items()}

    def _log(self, window: _Window) -> None:
        local = window.mean()
        names = list(local)
        reduced = self.strategy.reduce_mean(torch.stack([local[k] for k in names])).tolist()
        mean = dict(zip(names, reduced, strict=True))
        elapsed = time.perf_counter() - window.started
        samples = window.steps * self.spec.train.grad_accum_steps * self.spec.data.batch_size
        rate = samples * self.strategy.world_size / elapsed
        lr = self.scheduler.get_last_lr()[0]
        step, total = self.progress.step, self.total_steps
        self._last_loss = mean["loss"]
        self.telemetry.heartbeat(
            step=step,
            max_steps=total,
            loss=float(local["loss"]),
            samples_per_s=rate / self.strategy.world_size,
        )
        self.telemetry.metrics(
            step=step, epoch=self.progress.epoch, lr=lr, samples_per_s=rate, **mean
        )
        extras = "".join(f" | {k} {v:.4g}" for k, v in mean.items() if k != "loss")
        self._say(
            f"step {step}/{total} | loss {mean['loss']:.4f}{extras} | lr {lr:.2e} | "
            f"{rate:,.0f} samples/s | {1000 * elapsed / window.steps:.1f} ms/step"
        )

    def _save(self) -> None:
        state = self.strategy.state_dict(self.model, self.optimizer)
        meta = {
            "progress": asdict(self.progress),
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.strategy.world_size,
            "spec": self.spec.model_dump(mode="json"),
        }
        checkpoint.save(
            self.strategy,
            self.run_dir,
            self.progress.step,
            state,
            meta,
            self.spec.checkpoint.keep_last,
        )

    def _restore(self, path: Path) -> None:
        state = self.strategy.state_dict(self.model, self.optimizer)
        try:
            checkpoint.load(path, state)
        except Exception as exc:  # DCP wraps per-rank failures; the first line says what
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunError(
                f"--resume {path}: cannot load this checkpoint into the model: {first}",
                hint="Resume with the same recipe and model arguments the checkpoint was saved with.",
            ) from exc
        self.strategy.load_state_dict(self.model, self.optimizer, state)
        meta = checkpoint.read_meta(path)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.progress = Progress(**meta["progress"])

    def _say(self, text: str, every_rank: bool = False) -> None:
        if every_rank or self.strategy.is_main:
            print(text, flush=True)

    _last_loss: float | None = None


class _Window:
    """Metrics of the steps since the last log line, kept on the device until then."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        self.steps += 1
        for k, v in {"loss": loss, **metrics}.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def mean(self) -> dict[str, torch.Tensor]:
        return {k: v / self.steps for k, v in self.sums.items()}


def _total_steps(spec: RunSpec, steps_per_epoch: int) -> int:
    limits = [spec.train.max_steps or math.inf]
    if spec.train.max_epochs:
        limits.append(spec.train.max_epochs * steps_per_epoch)
    return int(min(limits))
