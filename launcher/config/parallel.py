"""The `parallel` section: the degrees of each dimension of parallelism (`launcher.config.spec`
re-exports it). What they resolve to on a given world is `launcher.parallel.dims`'s question."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from launcher.config.section import Section

Degree = Annotated[int, Field(ge=1)] | Literal["auto"]


class ParallelSection(Section):
    dp_replicate: Degree | None = Field(
        None,
        description="Data-parallel replicas of the model. Under fsdp, more than 1 is HSDP: each "
        "replica is sharded over `dp_shard` processes, and gradients are reduced within a "
        "replica, then all-reduced across replicas, so the all-gathers stay on a replica's own "
        "(fast) links. `auto`: one replica per node. Unset: the world under ddp (every process "
        "a replica); under fsdp, what the world leaves after `dp_shard` and `tp` where "
        "`dp_shard` is given, else 1.",
    )
    dp_shard: Degree | None = Field(
        None,
        description="Processes each replica's parameters, gradients and optimizer state are "
        "sharded over (fsdp only). Unset or `auto`: what the world leaves after `dp_replicate` "
        "and `tp`. Under ddp it is 1.",
    )
    tp: int = Field(
        1,
        ge=1,
        description="Tensor-parallel degree: each matmul of the model split over `tp` "
        "processes of one node (consecutive ranks), by the recipe's `parallelize(model, mesh)` "
        "or a Hugging Face model's own `base_model_tp_plan`. The processes of one tensor-"
        "parallel group share each batch, so `data.batch_size` stays per data-parallel rank "
        "(of which there are world / tp). fsdp only (it shards over the rest of the world).",
    )


def kept_on_resume(strategy: str, name: str, value: Any) -> bool:
    """Whether a run resumed as `launch.strategy` (given now) keeps its stored
    `parallel.<name>: value`, or drops it to the default (`launcher.config.resume`): fsdp keeps
    every dimension; ddp only replicas left to the world (unset or `auto`: its only layout);
    the xla strategies lay the model out themselves and keep none. What is kept is checked
    against the world at launch (`launcher.parallel.dims`)."""
    if strategy == "fsdp":
        return True
    if strategy == "ddp" and name == "dp_replicate":
        return value in (None, "auto")
    return value in (None, 1)
