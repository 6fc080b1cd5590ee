"""The experiment trackers `log.trackers` may name, as both processes know them: the module
and class that implement each (imported by name, by rank 0 of a run that names it; its
optional package, mlflow or wandb, only when it connects, in its sink's thread), the optional
package it needs, and the check that refuses, before launch, an environment it cannot serve.

A tracker's class builds its sink for a run with `for_run(spec, run_dir, records)` (records:
the run's trackers.json, shared by its trackers); `TrackerSink` (`base.py`) gives its
subclasses one. A new tracker is a module of this folder and one line here, plus its name in
the spec's `TrackerName` (`launcher/config/log.py`, which cannot import this room; a test
checks the two agree)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.errors import UsageError

# Where the trackers' modules are: `TrackerInfo.module` names one of this folder.
_FOLDER = "launcher.metrics.trackers"


@dataclass(frozen=True)
class TrackerInfo:
    module: str  # its module in this folder: "csv_file" is launcher.metrics.trackers.csv_file
    cls: str
    # The package it imports that the launcher does not install: the extra `launcher[<name>]`
    # does. A run that names the tracker without it is refused before launch.
    package: str | None = None
    # A function of `module`, called before launch, that raises UsageError where this
    # environment cannot serve the tracker (a folder it cannot write).
    check: str | None = None


TRACKERS = {
    "tensorboard": TrackerInfo("tensorboard", "TensorBoardSink"),
    "csv": TrackerInfo("csv_file", "CsvSink"),
    "mlflow": TrackerInfo("mlflow_run", "MlflowSink", package="mlflow"),
    "wandb": TrackerInfo("wandb_run", "WandbSink", package="wandb", check="check_usable"),
}


def tracker_info(name: str) -> TrackerInfo:
    if name not in TRACKERS:  # the spec only takes these: a name here and not there is a bug
        raise UsageError(
            f"log.trackers: {name!r} is not a tracker (available: {', '.join(sorted(TRACKERS))})"
        )
    return TRACKERS[name]


def tracker_class(name: str) -> Any:
    """The class that implements tracker `name`, its module imported now."""
    info = tracker_info(name)
    return getattr(importlib.import_module(f"{_FOLDER}.{info.module}"), info.cls)


def tracker_check(name: str) -> Callable[[], None] | None:
    """The function that checks, before launch, that this environment can serve tracker
    `name`, or None where it has none."""
    info = tracker_info(name)
    if info.check is None:
        return None
    return getattr(importlib.import_module(f"{_FOLDER}.{info.module}"), info.check)
