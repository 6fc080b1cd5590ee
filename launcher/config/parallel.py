"""The `parallel` section: the degrees of each dimension of parallelism (`launcher.config.spec`
re-exports it). What they resolve to on a given world is `launcher.parallel.dims`'s question."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from launcher.config.section import Section

Degree = Annotated[int, Field(ge=1)] | Literal["auto"]
# torch.distributed.pipelining's schedules by the names torchtitan gives them.
PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"]


class ParallelSection(Section):
    pp: int = Field(
        1,
        ge=1,
        description="Pipeline-parallel degree: the model cut into `pp` stages (after the "
        "split points, or evenly along its repeated blocks), each held by one group of "
        "processes, which pass activations forward and gradients back (torch's "
        "`torch.distributed.pipelining`). The outermost axis: its groups may span nodes. "
        "fsdp only. A Hugging Face model is cut by its own plan (`base_model_pp_plan`), and a "
        "causal LM with dict batches of `input_ids` and `labels` needs no hooks; for other "
        "models the recipe gives `split_batch` and `loss_from_output` "
        "(docs/fsdp-and-parallelism.md, 'Pipeline parallelism').",
    )
    pp_schedule: PipelineSchedule = Field(
        "1F1B",
        description="How the stages take the micro-batches: `GPipe` (every forward, then "
        "every backward), `1F1B` (one forward, one backward: fewer activations held), "
        "`Interleaved1F1B` and `ZBVZeroBubble` (two stages per process: smaller bubbles).",
    )
    pp_microbatches: int | None = Field(
        None,
        ge=1,
        description="Micro-batches each step's batch is cut into for the pipeline; must "
        "divide `data.batch_size`. Unset: `pp` (one per stage).",
    )
    pp_split_points: list[str] | None = Field(
        None,
        description="Where stages begin, by module name (e.g. `[blocks.4]`, or "
        "`[model.layers.16]` for a Hugging Face model, whose stages begin at a block of its "
        "layer list): `pp - 1` names, or `2 * pp - 1` for the two-stage schedules. Unset: the "
        "model's repeated blocks (those `fsdp.wrap` finds) divided evenly.",
    )
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
    ep: int = Field(
        1,
        ge=1,
        description="Expert-parallel degree: a mixture-of-experts model's experts spread over "
        "`ep` processes, each holding 1/ep of every expert tensor, tokens sent to their "
        "experts and back by all-to-all. The `ep` processes are data-parallel ranks of one "
        "replica: `ep` divides `dp_shard`, and the experts are FSDP-sharded over the "
        "`dp_shard / ep` ranks left. fsdp only, without `pp` or `tp` for now. The model's "
        "experts are its `ep_plan` (a Hugging Face model's `base_model_ep_plan`; "
        "docs/fsdp-and-parallelism.md, 'Expert parallelism').",
    )


def kept_on_resume(strategy: str, name: str, value: Any) -> bool:
    """Whether a run resumed as `launch.strategy` (given now) keeps its stored
    `parallel.<name>: value`, or drops it to the default (`launcher.config.resume`): fsdp keeps
    every dimension; ddp only replicas left to the world (unset or `auto`: its only layout);
    the xla strategies lay the model out themselves and keep none. What is kept is checked
    against the world at launch (`launcher.parallel.dims`)."""
    if strategy == "fsdp":
        return True
    if name.startswith("pp_"):  # how a pipeline runs: nothing without one
        return True
    if strategy == "ddp" and name == "dp_replicate":
        return value in (None, "auto")
    return value in (None, 1)
