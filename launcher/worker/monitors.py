"""What evaluations decide: which checkpoints are the best (`checkpoint.monitor`) and when a
run has stopped improving (`early_stop`). Both are part of every checkpoint, so a resumed run
goes on with the same history (Lightning's `best_k_models`, its EarlyStopping's `wait_count`).
"""

from __future__ import annotations

import math
from typing import Any

from launcher.config.spec import CheckpointSection, EarlyStopSection
from launcher.errors import RunError


def improves(score: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    """Whether `score` beats `best` by more than `min_delta`; NaN never does."""
    if math.isnan(score):
        return False
    if best is None:
        return True
    return score < best - min_delta if mode == "min" else score > best + min_delta


def score_of(metrics: dict[str, float], monitor: str, key: str) -> float:
    if monitor not in metrics:
        raise RunError(
            f"{key}: the evaluation gives no {monitor!r}; it gives {', '.join(sorted(metrics))}",
            hint="Name one of those, or return it from the recipe's evaluate(model, batch).",
        )
    return metrics[monitor]


class BestCheckpoints:
    """The best `keep_best` evaluations by `monitor`, best first: (step, score)."""

    def __init__(self, section: CheckpointSection) -> None:
        assert section.monitor is not None
        self.monitor, self.mode, self.keep = section.monitor, section.mode, section.keep_best
        self.kept: list[tuple[int, float]] = []
        self.changed_from: str | None = None  # the record a resume found, when another

    def offer(self, step: int, metrics: dict[str, float]) -> bool:
        """Records an evaluation; returns whether it is among the best (save it)."""
        score = score_of(metrics, self.monitor, "checkpoint.monitor")
        full = len(self.kept) >= self.keep
        if math.isnan(score) or (full and not improves(score, self.kept[-1][1], self.mode)):
            return False
        sign = 1 if self.mode == "min" else -1
        # A tie keeps the earlier step first: it reached that score first.
        self.kept = sorted([*self.kept, (step, score)], key=lambda e: (sign * e[1], e[0]))
        self.kept = self.kept[: self.keep]
        return True

    def steps(self) -> set[int]:
        return {step for step, _ in self.kept}

    def state_dict(self) -> dict[str, Any]:
        # run_layout.RunLayout.best reads this from meta.json.
        return {"monitor": self.monitor, "mode": self.mode, "kept": [list(e) for e in self.kept]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.changed_from = None
        # Scores of another metric, or of the other direction, rank nothing here.
        if state and (state["monitor"], state["mode"]) == (self.monitor, self.mode):
            self.kept = [(int(step), float(score)) for step, score in state["kept"]]
            self.kept = self.kept[: self.keep]
        elif state and state["kept"]:
            self.changed_from = f"{state['monitor']} ({state['mode']})"

    def retain(self, steps: set[int]) -> str:
        """Forgets the best evaluations with no checkpoint among `steps`; returns what the
        user should know about the change of record, if anything."""
        self.kept = [(step, score) for step, score in self.kept if step in steps]
        if self.changed_from is None:
            return ""
        return (
            f"checkpoint.monitor is now {self.monitor} ({self.mode}): the best checkpoints by "
            f"{self.changed_from} are no longer kept apart from checkpoint.keep_last"
        )


class EarlyStopping:
    def __init__(self, section: EarlyStopSection) -> None:
        assert section.monitor is not None
        self.monitor, self.mode = section.monitor, section.mode
        self.patience, self.min_delta = section.patience, section.min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0  # evaluations since the last improvement

    def update(self, step: int, metrics: dict[str, float]) -> None:
        score = score_of(metrics, self.monitor, "early_stop.monitor")
        if improves(score, self.best, self.mode, self.min_delta):
            self.best, self.best_step, self.waited = score, step, 0
        else:
            self.waited += 1

    @property
    def should_stop(self) -> bool:
        return self.waited >= self.patience

    def message(self) -> str:
        best = "none finite" if self.best is None else f"{self.best:.6g} at step {self.best_step}"
        return (
            f"early stop: {self.monitor} did not improve for {self.waited} evaluations "
            f"(best {best})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best": self.best,
            "best_step": self.best_step,
            "waited": self.waited,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and (state["monitor"], state["mode"]) == (self.monitor, self.mode):
            self.best, self.best_step = state["best"], state["best_step"]
            self.waited = state["waited"]
