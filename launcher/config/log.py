"""The `log` section: where a run's metrics go besides metrics.jsonl (`launcher.config.spec`
re-exports it). The sinks themselves are `launcher.metrics.sinks` and
`launcher.metrics.trackers`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from launcher.config.section import Section

TrackerName = Literal["tensorboard", "wandb", "mlflow", "csv"]


class WandbSection(Section):
    project: str | None = Field(
        None,
        description="The W&B project the run goes to. Unset: `WANDB_PROJECT`, else the run's "
        "name (`run.name`).",
    )
    entity: str | None = Field(
        None, description="The W&B team or user. Unset: `WANDB_ENTITY`, else your default."
    )
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")


class MlflowSection(Section):
    experiment: str | None = Field(
        None,
        description="The MLflow experiment the run goes to, made if missing. Unset: "
        "`MLFLOW_EXPERIMENT_NAME`, else the run's name (`run.name`). The server is "
        "`MLFLOW_TRACKING_URI` (MLflow's own default where unset).",
    )


class LogSection(Section):
    trackers: list[TrackerName] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Where rank 0 sends the run's metrics besides `metrics.jsonl`, from a "
        "background thread, so a slow or failing tracker never slows or fails a step: "
        "`tensorboard` (event files in `<run dir>/tb/`; no package needed), `wandb` (extra "
        "`launcher[wandb]`), `mlflow` (extra `launcher[mlflow]`) and `csv` (`<run dir>/"
        "metrics.csv`, a column per metric). Each tracker gets the resolved spec as "
        "hyperparameters, the train and `val/` metrics by step, the run's status at its end "
        "and the best checkpoint's path; a resumed or restarted run continues the same "
        "tracker run (docs/trackers.md). `[]`: none. (The older `tensorboard: false` still "
        "means no TensorBoard.)",
    )
    wandb: WandbSection = Field(
        default_factory=WandbSection, description="Options of the `wandb` tracker."
    )
    mlflow: MlflowSection = Field(
        default_factory=MlflowSection, description="Options of the `mlflow` tracker."
    )

    @model_validator(mode="before")
    @classmethod
    def _older_tensorboard_key(cls, data: Any) -> Any:
        # Runs written before `trackers` keep `log.tensorboard` in their spec.yaml, and
        # `train runs` and a resume still read them.
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        on = data.pop("tensorboard")
        trackers = [t for t in data.get("trackers", ["tensorboard"]) if t != "tensorboard"]
        data["trackers"] = (["tensorboard"] if on else []) + trackers
        return data

    @field_validator("trackers")
    @classmethod
    def _each_once(cls, trackers: list[str]) -> list[str]:
        twice = sorted({t for t in trackers if trackers.count(t) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed twice: name each tracker once")
        return trackers
