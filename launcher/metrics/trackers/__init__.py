"""Experiment trackers (`log.trackers`): TensorBoard, W&B, MLflow and a CSV file, each a sink of
rank 0's background writer (`launcher.metrics.sinks`, which builds them by name through
`registry.py`), so a slow or failing tracker never slows or fails a step. W&B and MLflow are
optional extras, imported only in the writer's thread of a run that asks for them."""

from __future__ import annotations

import importlib.util

from launcher.errors import UsageError
from launcher.metrics.trackers.registry import tracker_check, tracker_info


def check_trackers_usable(trackers: list[str]) -> None:
    """Refuses, before anything starts, a tracker this environment cannot serve: its package
    is not installed, or its own check (W&B: the folder `WANDB_DIR` names can be written)
    fails."""
    for tracker in trackers:
        package = tracker_info(tracker).package
        if package and importlib.util.find_spec(package) is None:
            raise UsageError(
                f"log.trackers: {tracker} needs the {package} package, which is not installed",
                hint=f"pip install 'launcher[{tracker}]', or take {tracker} out of log.trackers.",
            )
    for tracker in trackers:
        if (check := tracker_check(tracker)) is not None:
            check()
