"""The `fsdp` section: options of `launch.strategy: fsdp` (`launcher.config.spec` re-exports it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from launcher.config.section import Section


class FSDPSection(Section):
    wrap: list[str] | None = Field(
        None,
        description="Module class names that become their own shard unit, e.g. `[Block]`. "
        "Default: a Hugging Face model's `_no_split_modules` classes, else the children of "
        "every `nn.ModuleList`, else the outermost repeated modules that hold parameters "
        "(blocks such as ResNet's `BasicBlock` before single layers). Rank 0 prints the units "
        "chosen, or that the whole model is one unit.",
    )
    init: Literal["auto", "meta", "cpu"] = Field(
        "auto",
        description="How fsdp gets its initial weights. `meta`: build on the meta device, "
        "shard, then run the model's explicit initialisation on each rank's own shards (no "
        "rank ever holds the whole model); ddp's build runs it too, after seeding alike, so "
        "the weights are bitwise ddp's where there is one: the recipe's `init_weights(model)`, "
        "the model's `init_weights()` or a Hugging Face model's own init. Without one, each "
        "module's `reset_parameters()` runs instead, which differs from constructors that "
        "initialise weights themselves (torchvision's ResNet), and rank 0 says so. `cpu`: "
        "every process builds the whole model on CPU as ddp does, then shards it: ddp's "
        "weights for any model, for the model's size in host memory per process (rank 0 "
        "prints it). `auto`: `meta` where the model can be built on the meta device (its "
        "constructor reads no weight's value) and an explicit initialisation exists and writes "
        "every parameter and buffer, else `cpu`, said in one line.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="Free gathered parameters after forward (ZeRO-3); `false` keeps them until "
        "backward (ZeRO-2 style: faster, more memory).",
    )
    param_dtype: Literal["fp32", "bf16"] | None = Field(
        None,
        description="Mixed precision: dtype of gathered parameters in compute (unset: as built).",
    )
    reduce_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="Mixed precision: dtype of gradient reduce-scatter (unset: as computed)."
    )
    cpu_offload: bool = Field(
        False,
        description="Keep sharded parameters, gradients and optimizer state in CPU memory "
        "between uses (GPU runs only).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each shard unit's activations in backward instead of keeping them.",
    )
