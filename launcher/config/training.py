"""The `train` section: how long and how to step (`launcher.config.spec` re-exports it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from launcher.config.section import PositiveInt, Section

Precision = Literal["fp32", "bf16", "fp16"]


class ProfileSection(Section):
    start_step: PositiveInt = Field(
        10,
        description="The first profiled step: leave the first steps (compilation, warm-up) out.",
    )
    steps: PositiveInt = Field(
        5,
        description="Steps profiled. Each rank writes a Chrome/Perfetto trace (TensorBoard "
        "reads it too) to `<run dir>/profile/`, and on a GPU a CUDA memory snapshot "
        "(pytorch.org/memory_viz).",
    )


class EMASection(Section):
    decay: float = Field(
        ...,
        gt=0,
        lt=1,
        description="The average's decay per optimizer step: `average = decay * average + (1 - "
        "decay) * weights`, e.g. 0.999 (about the last 1,000 steps).",
    )


class TrainSection(Section):
    max_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps.")
    max_epochs: PositiveInt | None = Field(
        None, description="Stop after this many passes over the data (whichever limit comes first)."
    )
    grad_accum_steps: PositiveInt = Field(
        1, description="Micro-batches per optimizer step; gradients sync only on the last one."
    )
    grad_clip_norm: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this value (off when unset)."
    )
    precision: Precision = Field(
        "fp32",
        description="`fp32`, `bf16` (autocast) or `fp16` (autocast, plus a gradient scaler on GPU).",
    )
    log_every: PositiveInt = Field(
        10, description="Print and record metrics every this many steps."
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="When the loss or the gradient norm is NaN or infinite: `stop` ends the run "
        "(exit 1) at the next log line, naming the step, the rank and the newest finite "
        "checkpoint; `skip` drops that step's update (one host sync per step) and stops after "
        "10 skips in a row. A checkpoint with non-finite weights is never saved.",
    )

    compile: bool = Field(
        False,
        description="`torch.compile` (inductor) each repeated block of the model (the units "
        "fsdp shards, see `fsdp.wrap`), or the whole model where it has none. The compiled "
        "code is cached in `<run dir>/compile_cache`, so a resumed run does not compile "
        "again; a recompilation after the first step is reported. Not for the XLA "
        "strategies, which compile every step already.",
    )
    tf32: bool = Field(
        True,
        description="On CUDA, fp32 matrix multiplications and convolutions use TensorFloat-32 "
        "tensor cores (`torch.set_float32_matmul_precision('high')`): several times faster, "
        "with a 10-bit mantissa in the products. `false`: full fp32.",
    )
    float8: bool = Field(
        False,
        description="The model's large linear layers compute in float8 (torchao's float8 "
        "training, tensorwise scaling, as torchtitan does; the output head and layers too "
        "small to gain stay in `train.precision`). GPUs with float8 tensor cores only "
        "(compute capability 8.9+: H100, H200, L40S, B200), strategies ddp and fsdp without "
        "tensor parallelism; needs the `float8` extra (torchao). Pair it with "
        "`train.compile: true`, which fuses the casts to float8: without it they cost more "
        "than float8 saves.",
    )
    ema: EMASection | None = Field(
        None,
        description="An exponential moving average of the weights, e.g. `{decay: 0.999}`, kept "
        "on each rank's own shards (fsdp never gathers it), updated after every optimizer "
        "step and checkpointed. Evaluations report it as `val_ema/...` beside `val/...`, "
        "`checkpoint.monitor` may name either, and `train export --ema` writes it. `null`: off.",
    )
    profile: ProfileSection | None = Field(
        None,
        description="Profile a few steps with `torch.profiler`, e.g. `{start_step: 20, steps: "
        "5}`; `null`: no profiling.",
    )

    @model_validator(mode="after")
    def _has_a_limit(self) -> TrainSection:
        if self.max_steps is None and self.max_epochs is None:
            raise ValueError("set train.max_steps or train.max_epochs (or both)")
        return self
