"""The loop's own state, as an object the checkpointer saves and loads
(`launcher.checkpoint.state.LoopState`): progress, the scheduler, the best checkpoints, early
stopping, and each rank's random streams, metrics window, recipe state and data position."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from launcher.config.spec import RunSpec
from launcher.parallel.base import Strategy
from launcher.worker.flops import Speed
from launcher.worker.metrics_window import MetricsWindow
from launcher.worker.monitors import BestCheckpoints, EarlyStopping
from launcher.worker.nonfinite import NonFiniteWatch
from launcher.worker.recipe import Recipe

if TYPE_CHECKING:
    import torch


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    samples_in_epoch: int = 0  # global samples consumed in `epoch`: valid across world sizes


class TrainState:
    """The loop's own state: progress, the scheduler, the best checkpoints, early stopping
    and the count of skipped updates, the same on every rank (`state_dict`), and each rank's
    RNG streams, metrics window and recipe state (`rank_state_dict`), which continue exactly
    only with the world size they were saved at."""

    def __init__(
        self,
        strategy: Strategy,
        scheduler: Any,
        recipe: Recipe,
        spec: RunSpec,
        feed: Any,
        speed: Speed,
        config_file: dict[str, Any] | None = None,
    ) -> None:
        self.strategy, self.scheduler, self.recipe = strategy, scheduler, recipe
        self.speed = speed  # the FLOP count: a resumed run's first step needs no recount
        # The YAML file as the launch read it, for the record: the next resume compares it with
        # the file as it is then (`launcher.config.resume`); never loaded.
        self.config_file = config_file
        self.feed = feed  # where the train data stands (a stream's positions; launcher.worker.data)
        self.notes: list[str] = []  # for the user, after a load
        self.spec = spec  # saved for the record (what made this checkpoint); never loaded
        self.progress = Progress()
        self.window = MetricsWindow()
        ckpt, early = spec.checkpoint, spec.early_stop
        self.best = BestCheckpoints(ckpt) if ckpt.monitor else None
        self.early = EarlyStopping(early) if early.monitor else None
        self.nonfinite = NonFiniteWatch(spec.train.on_nonfinite, strategy, spec.optim.lr)

    def state_dict(self) -> dict[str, Any]:
        return {
            "progress": asdict(self.progress),
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.strategy.world_size,
            "tp": self.strategy.layout.tp,  # what checkpoints before "layout" kept
            "layout": self.strategy.layout.as_record(),
            "spec": self.spec.model_dump(mode="json", by_alias=True),
            "config_file": self.config_file,
            "best": self.best.state_dict() if self.best else None,
            "early_stop": self.early.state_dict() if self.early else None,
            "nonfinite": self.nonfinite.state_dict(),
        }

    def recent_loss(self) -> torch.Tensor | None:
        window = self.window
        return window.sums["loss"] / window.count if window.count is not None else None

    def rank_state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.strategy.rng.state(),
            "window": self.window.state_dict(),
            "recipe": self.recipe.state_dict(),
            "data": self.feed.state_dict(),
            "flops": self.speed.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], own: dict[str, Any] | None) -> None:
        """`own` is this rank's saved state, or None when the checkpoint was saved with
        another world size: the rank's random streams are then reseeded."""
        self.scheduler.load_state_dict(state["scheduler"])
        # In place: the loop holds this object (a healed replica group loads mid-run).
        vars(self.progress).update(asdict(Progress(**state["progress"])))
        for part, key in ((self.best, "best"), (self.early, "early_stop")):
            if part is not None:
                part.load_state_dict(state.get(key))
        self.nonfinite.load_state_dict(state.get("nonfinite"))
        taken = self.progress.samples_in_epoch
        note = self.feed.load_state_dict(own.get("data") if own else None, taken)
        self.notes = [note] if note else []
        if own is None:
            return
        self.strategy.rng.set_state(own["rng"])
        self.speed.load_state_dict(own.get("flops"))
        self.window.load_state_dict(own["window"], self.strategy.device)
        self.recipe.load_state_dict(own["recipe"])
