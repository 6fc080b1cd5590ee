"""The run spec: one typed section per YAML block, and the one place every key is documented.

Each field's `description` is the documentation: `train --help`, the config reference
(docs/config.md, `launcher.config.reference`) and error messages all read it from here.
"""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

# The fsdp section's keys need long descriptions; it lives apart, re-exported here.
from launcher.config.fault_tolerance import FaultToleranceSection
from launcher.config.fsdp import FSDPSection
from launcher.config.load import LoadSection
from launcher.config.log import LogSection

# Sections that need torch to check themselves live apart; the spec re-exports them.
from launcher.config.optim import OptimSection
from launcher.config.parallel import ParallelSection
from launcher.config.section import PositiveInt, Section
from launcher.config.straggler import StragglerSection
from launcher.config.training import EMASection, Precision, ProfileSection, TrainSection
from launcher.storage_url import (
    is_url,
    mask_urls,
    secrets_in,
    unkept_store_problem,
    url_credentials_problem,
)

Accelerator = Literal["auto", "cpu", "gpu", "tpu"]
StrategyName = Literal["ddp", "fsdp", "xla", "xla_spmd", "xla_fsdp"]
Mode = Literal["min", "max"]


# What a run's name may hold: it names folders, a SLURM job and a Kubernetes job.
RUN_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"


class RunSection(Section):
    name: str = Field(
        "run",
        pattern=rf"^{RUN_NAME_PATTERN}$",
        # It names folders, the longest torchelastic's `<name>-<8 hex>_<8 random>`: a file
        # name holds 255 bytes.
        max_length=128,
        description="Name of the run: letters, digits, `.`, `_` and `-`, at most 128 "
        "characters. New runs go to `<output_dir>/<name>/<timestamp>`, and `--resume latest` "
        "picks the newest run of this name.",
    )
    seed: int = Field(
        0,
        description="Seeds python, numpy and torch: the same on every rank for the weights and "
        "the datasets, then each data-parallel rank's own for training (dropout, augmentation); "
        "and the sampler.",
    )
    output_dir: str = Field(
        "runs", description="Folder that holds the runs, relative to the working directory."
    )


def _devices(value: Any) -> int | str:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(f"expected a positive number of devices or 'auto', got {value!r}")


class LaunchSection(Section):
    accelerator: Accelerator = Field(
        "auto",
        description="`cpu`, `gpu`, `tpu`, or `auto`: a TPU for the `xla*` strategies, else a GPU "
        "if CUDA sees one, else the CPU.",
    )
    devices: Annotated[int | str, BeforeValidator(_devices)] = Field(
        "auto",
        description="Devices to use on this machine: a number, or `auto` (every GPU or TPU "
        "device; 1 process on CPU). `ddp`/`fsdp` start a process per device, `xla` a replica "
        "per device (1 or all), `xla_spmd`/`xla_fsdp` one process driving all of them.",
    )
    strategy: StrategyName = Field(
        "ddp",
        description="How replicas share work. CPU/GPU: `ddp` (a model replica per process, "
        "gradients all-reduced) or `fsdp` (parameters, gradients and optimizer state sharded; "
        "see `fsdp`). TPU (torch_xla): `xla` (a process per device, gradients all-reduced), "
        "`xla_spmd` (SPMD data parallel: one process per host, the batch sharded over every "
        "device) or `xla_fsdp` (SPMD with parameters sharded too, FSDPv2); see `xla`.",
    )

    max_restarts: int = Field(
        0,
        ge=0,
        description="After a failure, restart every rank from the latest complete checkpoint, "
        "up to this many times (torch.distributed.elastic's restarts).",
    )
    worker_start: Literal["auto", "forkserver", "spawn"] = Field(
        "auto",
        description="How the training processes start. `forkserver`: forked by one process, "
        "itself a fork of the launcher made before the recipe is imported, that holds torch, "
        "the launcher and the installed libraries the recipe imports (transformers' modules, "
        "say), imported once (`launcher.worker.fork_server`): a worker starts in milliseconds "
        "instead of the seconds of CPU a new interpreter takes to import them, on every start "
        "and restart; the server never imports the recipe itself and touches no device. "
        "`spawn`: each a new interpreter, as torchrun starts them. `auto`: `forkserver` on "
        "Linux CPUs, else `spawn` (torch_xla starts the TPU processes itself; on GPUs it is "
        "not yet measured). A server that finds CUDA initialised by an import says so and the "
        "workers start as new interpreters.",
    )
    stall_timeout: float | None = Field(
        600.0,
        gt=0,
        description="Seconds without progress (no step finished) after which a rank counts as "
        "hung: the launcher shows the stalled ranks' Python stacks and stops the run. "
        "`null` turns the watchdog off.",
    )
    straggler: StragglerSection = Field(
        default_factory=StragglerSection,
        description="Naming a rank that is slower than the others: it sets the whole job's "
        "pace (docs/resume-and-faults.md).",
    )


class RecipeSection(Section):
    source: str = Field(
        ...,
        description="The recipe: a `.py` file or a dotted module; it defines `build_model`, "
        "`build_dataset` and `loss`. A path in a YAML file is relative to that file; one given "
        "on the command line (`recipe.source=PATH`) is relative to the working directory.",
    )
    model: dict[str, Any] = Field({}, description="Keyword arguments for `build_model(**model)`.")
    dataset: dict[str, Any] = Field(
        {}, description="Keyword arguments for `build_dataset(split, **dataset)`."
    )


class DataSection(Section):
    batch_size: PositiveInt = Field(32, description="Samples per device per micro-step.")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes per rank.")
    worker_start: Literal["auto", "fork", "forkserver", "spawn"] = Field(
        "auto",
        description="How DataLoader workers start. `auto`: `forkserver` (`spawn` where the "
        "platform has none), as Python 3.14 does: a process with threads (gloo's, the "
        "launcher's) is not forked, so no worker inherits a lock another thread held, which "
        "hangs it (CPython gh-112275, before 3.10.15 and 3.11.10). Each worker imports the "
        "recipe file again and gets a copy of the dataset and `collate`, which must pickle. "
        "`fork`: workers share the dataset's memory, nothing is pickled, at that risk.",
    )
    shuffle: bool = Field(
        True,
        description="Reshuffle every epoch (seeded by `run.seed`); a stream (IterableDataset) "
        "shuffles itself.",
    )
    drop_last: bool = Field(
        True, description="Drop the last incomplete batch, so every step has the same shape."
    )


class CheckpointSection(Section):
    enabled: bool = Field(
        True, description="Save checkpoints at all; `false` for throwaway runs and benchmarks."
    )
    every_n_steps: PositiveInt | None = Field(
        None,
        description="Save every this many steps; a last checkpoint is always saved at the end.",
    )
    keep_last: PositiveInt | None = Field(
        None,
        description="Keep only the newest this many complete checkpoints (all when unset); "
        "the best ones (`keep_best`) and the one an attempt resumed from are kept besides.",
    )
    async_: bool = Field(
        False,
        alias="async",
        description="Write checkpoints in the background: training waits only while the state "
        "is copied to memory.",
    )
    monitor: str | None = Field(
        None,
        description="Keep the best checkpoints by this evaluation metric, e.g. `val/loss` (or "
        "`val_ema/loss`, the weights' average: `train.ema`): an evaluation whose score enters "
        "the best `keep_best` saves one. Needs `eval.every_n_steps`.",
    )
    mode: Mode = Field(
        "min", description="Whether a lower (`min`) or higher (`max`) `monitor` is better."
    )
    keep_best: PositiveInt = Field(
        1,
        description="Best checkpoints kept by `monitor`, apart from `keep_last`: never pruned "
        "for being old. `--resume best` and `train export --best` use the best.",
    )
    dir: str | None = Field(
        None,
        description="Where checkpoints go: an fsspec URL (`s3://bucket/prefix/{run}`; `gs://`, "
        "`az://`, `file://` with their packages installed), `{run}` standing for the run "
        "folder's name. `null`: the run folder's `checkpoints/`. Every rank writes its own "
        "files there, so nodes with separate run folders share it. Refused before the run "
        "starts: credentials in the URL (`s3://KEY:SECRET@bucket`: they come from the "
        "environment, `AWS_ACCESS_KEY_ID`, ..., or a credentials file), and a store that keeps "
        "nothing: `memory://` (each process's own memory) or a read-only one (`https://`, "
        "`zip://`, `github://`, ...). See docs/checkpoint-stores.md.",
    )
    storage_options: dict[str, Any] = Field(
        {},
        description="fsspec's options for `dir`'s file system, e.g. `{endpoint_url: "
        "http://127.0.0.1:9000}`. A secret at any depth is refused, named by its dotted key "
        "and never by its value: a key whose name holds `secret`, `token`, `password`, "
        "`credential` or `access_key`, an S3 SSE-C key (`SSECustomerKey`), `key`, "
        "`account_key` or `connection_string`. Set its environment variable (the error names "
        "it) or use the store's credentials file instead.",
    )

    def store_url(self, run_name: str) -> str | None:
        """`dir` with `{run}` filled in; None where checkpoints stay in the run folder."""
        if not self.enabled or self.dir is None:
            return None
        return self.dir.replace("{run}", run_name)

    @field_validator("dir")
    @classmethod
    def _a_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not is_url(value):
            raise ValueError(
                f"{mask_urls(value)!r} is not a URL: give a store's, e.g. "
                "s3://bucket/prefix/{run}; for a folder of this machine, leave it unset "
                "(checkpoints go to the run folder, which --run-dir places)"
            )
        if problem := url_credentials_problem(value):
            raise ValueError(f"{problem}; set them in the environment ({_S3_VARIABLES})")
        if problem := unkept_store_problem(value):
            raise ValueError(
                f"{problem}; use a lasting store every node writes (s3://bucket/prefix/{{run}}, "
                "file:///shared/{run}), or leave it unset (the run folder)"
            )
        fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        if fields - {"run"}:
            raise ValueError(f"{{{sorted(fields - {'run'})[0]}}}: only {{run}} is filled in")
        return value

    @field_validator("storage_options")
    @classmethod
    def _no_secret(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Named by its whole dotted key, never by its value: the first with its fix, the
        # others by their keys inside storage_options, within one line.
        prefix = "checkpoint.storage_options"
        if secrets := secrets_in(value, prefix):
            (key, problem), others = secrets[0], [k for k, _ in secrets[1:]]
            also = ", ".join(k.removeprefix(prefix + ".") for k in others)
            raise ValueError(f"{key} {problem}" + (f" (also {also})" if others else ""))
        return value


# What an error tells a user who put S3's credentials in the spec to set instead.
_S3_VARIABLES = "for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"


class EvalSection(Section):
    every_n_steps: PositiveInt | None = Field(
        None,
        description="Evaluate the recipe's `val` split every this many steps and at the end of "
        "training; `null`: never.",
    )
    max_batches: PositiveInt | None = Field(
        None,
        description="Batches per replica in each evaluation; `null`: the whole split (a "
        "streamed split, an IterableDataset, needs a number).",
    )


class EarlyStopSection(Section):
    monitor: str | None = Field(
        None,
        description="Stop training when this evaluation metric (e.g. `val/loss`, or "
        "`val_ema/loss` with `train.ema`) stops improving; `null`: never. Needs "
        "`eval.every_n_steps`.",
    )
    mode: Mode = Field(
        "min", description="Whether a lower (`min`) or higher (`max`) `monitor` is better."
    )
    patience: PositiveInt = Field(
        3, description="Evaluations without improvement before the run stops."
    )
    min_delta: float = Field(
        0.0, ge=0, description="The least change of `monitor` that counts as an improvement."
    )


class XLASection(Section):
    strict_compile: bool = Field(
        False,
        description="Stop the run when XLA compiles a new graph after warm-up (also "
        "`--strict-compile`); by default it is a warning that names the step.",
    )
    warmup_steps: PositiveInt | None = Field(
        None,
        description="Steps in which new XLA graphs are expected. Default: through the step "
        "after the second log line, since the first steps, the first logged metrics, the step "
        "after them and a resumed run's restored state each trace graphs of their own.",
    )
    compile_cache: bool = Field(
        True,
        description="Keep compiled graphs in `<run dir>/xla_cache`, so a resumed run does "
        "not compile them again.",
    )


class RunSpec(Section):
    run: RunSection = Field(
        default_factory=RunSection, description="What the run is called and where it goes."
    )
    launch: LaunchSection = Field(
        default_factory=LaunchSection, description="Where and how replicas run."
    )
    recipe: RecipeSection = Field(..., description="The user's model, data and loss.")
    data: DataSection = Field(default_factory=DataSection, description="How batches are made.")
    optim: OptimSection = Field(
        # Built from its declared defaults, unvalidated: a factory's validation gets no context,
        # so the default's torch checks would import torch in a torch-free pass.
        default_factory=OptimSection.model_construct,
        description="Optimizer and learning-rate schedule.",
    )
    train: TrainSection = Field(..., description="How long and how to step.")
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="When to save, and what to keep."
    )
    eval: EvalSection = Field(
        default_factory=EvalSection, description="Evaluation on the recipe's `val` split."
    )
    early_stop: EarlyStopSection = Field(
        default_factory=EarlyStopSection, description="Stopping a run that stopped improving."
    )
    parallel: ParallelSection = Field(
        default_factory=ParallelSection,
        description="Degrees of data parallelism (replicated, sharded) and tensor parallelism "
        "on one device mesh; unset, `launch.strategy` alone decides (docs/fsdp-and-parallelism.md).",
    )
    fsdp: FSDPSection = Field(
        default_factory=FSDPSection, description="Options of `launch.strategy: fsdp`."
    )
    xla: XLASection = Field(
        default_factory=XLASection,
        description="Options of the torch_xla strategies `xla`, `xla_spmd` and `xla_fsdp`.",
    )
    fault_tolerance: FaultToleranceSection = Field(
        default_factory=FaultToleranceSection,
        description="Training on through the loss of a replica group, on torchft "
        "(docs/fault-tolerance.md).",
    )
    log: LogSection = Field(
        default_factory=LogSection, description="What each run records besides its logs."
    )
    load: LoadSection = Field(
        default_factory=LoadSection, description="Weights a new run starts from (fine-tuning)."
    )

    @model_validator(mode="after")
    def _monitors_need_evaluations(self) -> RunSpec:
        for key, monitor in (
            ("checkpoint.monitor", self.checkpoint.monitor),
            ("early_stop.monitor", self.early_stop.monitor),
        ):
            if monitor is None:
                continue
            if monitor.startswith("val_ema/") and self.train.ema is None:
                raise ValueError(f"{key}: {monitor} needs train.ema, the average it evaluates")
            if not monitor.startswith(("val/", "val_ema/")):
                raise ValueError(
                    f"{key}: expected an evaluation metric such as 'val/loss' or "
                    f"'val_ema/loss', got {monitor!r}"
                )
            if self.eval.every_n_steps is None:
                raise ValueError(f"{key}: needs evaluations; set eval.every_n_steps")
        if self.checkpoint.monitor and not self.checkpoint.enabled:
            raise ValueError("checkpoint.monitor: needs checkpoint.enabled: true")
        if self.train.compile and self.launch.strategy.startswith("xla"):
            raise ValueError(
                f"train.compile: not for launch.strategy {self.launch.strategy} (XLA compiles "
                "every step already); set it to false"
            )
        self._fault_tolerance_fits()
        return self

    def _fault_tolerance_fits(self) -> None:
        action = self.launch.straggler.action
        if action == "restart" and not self.fault_tolerance.enabled:
            raise ValueError(
                "launch.straggler.action: restart needs fault_tolerance (a replica group "
                "restarts and heals from another); without it use stop or warn"
            )
        if not self.fault_tolerance.enabled:
            return
        if action == "stop":
            raise ValueError(
                "launch.straggler.action: stop ends replica groups, which fault_tolerance "
                "restarts; use restart (the straggler's group restarts and heals) or warn"
            )
        if self.launch.strategy not in ("ddp", "fsdp"):
            raise ValueError(
                f"fault_tolerance: not for launch.strategy {self.launch.strategy}; torchft's "
                "replica groups train with ddp or fsdp (or set fault_tolerance.enabled: false)"
            )
        if self.train.precision == "fp16":
            raise ValueError(
                "fault_tolerance: not with train.precision fp16: each group's loss scale "
                "would scale its gradients differently before they are averaged; use bf16"
            )
        if self.parallel.pp > 1:
            raise ValueError(
                "fault_tolerance: not with parallel.pp > 1 yet; a replica group heals whole "
                "replicas, not pipeline stages (set parallel.pp: 1)"
            )


__all__ = [
    "EMASection",
    "FSDPSection",
    "FaultToleranceSection",
    "LoadSection",
    "OptimSection",
    "ParallelSection",
    "Precision",
    "ProfileSection",
    "RunSpec",
    "StragglerSection",
    "TrainSection",
]
