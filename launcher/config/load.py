"""The `load` section: the weights a new run starts from (`launcher.config.spec` re-exports it)."""

from __future__ import annotations

from pydantic import Field, field_validator

from launcher.config.section import Section
from launcher.storage_url import url_credentials_problem


class LoadSection(Section):
    weights: str | None = Field(
        None,
        description="Start a new run from these weights only (fine-tuning): step 0, a fresh "
        "optimizer and schedule. A checkpoint folder of any run (any strategy and world size), "
        "a run folder (its newest complete checkpoint, named in the start line), `train "
        "export`'s `.safetensors` or `.pt` file, or a Hugging Face folder of `model.safetensors` "
        "(one file, or shards with `model.safetensors.index.json`). Also `--load-weights PATH`. "
        "A path in a YAML file is relative to that file; one given on the command line, to the "
        "working directory. A URL with credentials in it (`s3://KEY:SECRET@...`) is refused: they "
        "come from the environment. Not with `--resume`: a resumed run continues from its own "
        "checkpoint and never loads these again. `null`: the recipe's own initialisation.",
    )
    strict: bool = Field(
        True,
        description="Every weight of the model must be loaded and every loaded one must fit: "
        "missing, unexpected and mis-shaped names are listed and the run stops (exit 2). "
        "`false`: what matches is loaded, what does not is listed, and the rest keeps the "
        "recipe's initialisation (a new head, say).",
    )

    @field_validator("weights")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value is not None and (problem := url_credentials_problem(value)):
            raise ValueError(f"{problem}; the store's own variables or credentials file give them")
        return value
