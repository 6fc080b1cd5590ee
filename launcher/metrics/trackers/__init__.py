"""Experiment trackers (`log.trackers`): TensorBoard, W&B, MLflow and a CSV file, each a sink of
rank 0's background writer (`launcher.metrics.sinks`), so a slow or failing tracker never
slows or fails a step. W&B and MLflow are optional extras, imported only in the writer's
thread of a run that asks for them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from launcher.config.spec import RunSpec
from launcher.errors import UsageError
from launcher.metrics.sinks import Sink
from launcher.rundir.layout import RunLayout

# The package each optional tracker imports, and the extra that installs it.
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}


def check_trackers_usable(trackers: list[str]) -> None:
    """Refuses, before anything starts, a tracker this environment cannot serve: its package
    is not installed, or (W&B) the folder `WANDB_DIR` names cannot be written."""
    for tracker in trackers:
        package = EXTRAS.get(tracker)
        if package and importlib.util.find_spec(package) is None:
            raise UsageError(
                f"log.trackers: {tracker} needs the {package} package, which is not installed",
                hint=f"pip install 'launcher[{tracker}]', or take {tracker} out of log.trackers.",
            )
    wandb_dir = os.environ.get("WANDB_DIR")
    if "wandb" in trackers and wandb_dir:
        from launcher.metrics.trackers.wandb_run import unwritable

        if (why := unwritable(Path(wandb_dir))) is not None:
            raise UsageError(
                f"WANDB_DIR={wandb_dir}: W&B cannot write there ({why})",
                hint="Point WANDB_DIR at a folder you can write in, or unset it: W&B then "
                "writes in the run folder (RUN_DIR/wandb/).",
            )


def build_trackers(spec: RunSpec, run_dir: Path) -> list[Sink]:
    """The sinks of the trackers `log.trackers` names, in its order."""
    from launcher.metrics.trackers.records import TrackerRecords

    layout = RunLayout(run_dir)
    records = TrackerRecords(layout.trackers)  # one for all: each rewrites the whole file
    sinks: list[Sink] = []
    for tracker in spec.log.trackers:
        if tracker == "tensorboard":
            from launcher.metrics.tensorboard import TensorBoardSink

            sinks.append(TensorBoardSink(layout.tensorboard_dir))
        elif tracker == "csv":
            from launcher.metrics.trackers.csv_file import CsvSink

            sinks.append(CsvSink(spec, run_dir, records))
        elif tracker == "mlflow":
            from launcher.metrics.trackers.mlflow_run import MlflowSink

            sinks.append(MlflowSink(spec, run_dir, records))
        elif tracker == "wandb":
            from launcher.metrics.trackers.wandb_run import WandbSink

            sinks.append(WandbSink(spec, run_dir, records))
    return sinks
