"""Strategy `fsdp`: parameters, gradients and optimizer state sharded with FSDP2 (`fully_shard`),
over the data axes of the run's mesh (`launcher.parallel.dims`): one axis (FSDP), or replicas of
a sharded model (HSDP); after tensor parallelism, where `parallel.tp` asks for it.

The initial weights are bitwise what ddp starts from, built one of two ways (`fsdp.init`):

- on the meta device: the model is sharded unit by unit, then materialised: each rank allocates
  only its shards (`to_empty`) and the model's explicit initialisation (`WeightInit`) fills
  them exactly as it fills the unsharded model (`sharded_init`). No rank ever holds the whole
  model. Exact only where such an initialisation defines the weights: constructors that draw
  weights themselves (torchvision's ResNet) are not run again on the materialised shards.
- on CPU: every process builds the whole model as ddp does, and `fully_shard` shards it and
  moves the shards to the device. Exact for any model; needs the whole model in host memory
  in every process for a moment.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from launcher.config.spec import FSDPSection
from launcher.metrics.memory import local_bytes, size_text
from launcher.parallel.dims import ParallelDims, data_mesh
from launcher.parallel.experts import apply_expert_parallel, shard_experts
from launcher.parallel.pipeline.given import PipelineInput
from launcher.parallel.pipeline.runner import build_pipeline
from launcher.parallel.pipeline.stages import StageParts
from launcher.parallel.precision import dtype_of
from launcher.parallel.shard_units import shard_units
from launcher.parallel.sharded_init import MetaBuildFailed, UnsetByInit, build_on_meta, initialize
from launcher.parallel.steps import PipelinedSteps
from launcher.parallel.tensor_parallel import ParallelizeHook, apply_tensor_parallel
from launcher.parallel.torch_distributed import TorchDistributedStrategy
from launcher.parallel.weight_init import WeightInit


class FSDPStrategy(TorchDistributedStrategy):
    name = "fsdp"
    parallelize: ParallelizeHook | None = None  # the recipe's tensor-parallel plan

    def __init__(
        self, accelerator: str, precision: str, options: FSDPSection, **train: Any
    ) -> None:
        super().__init__(accelerator, precision, **train)
        self.options = options
        self.cpu_collectives = options.cpu_offload
        # DTensor warns once per process that a CPU mesh has no RNG state of its own. The
        # initial fills never use DTensor's random ops (`sharded_init` draws whole tensors from
        # torch's generator), so on every CPU run the warning only adds noise.
        warnings.filterwarnings(
            "ignore", message="DTensor random operators may not have complete support"
        )

    def build_model(
        self,
        factory: Callable[[], nn.Module],
        init: WeightInit,
        parallelize: ParallelizeHook | None = None,
        pipeline: PipelineInput | None = None,
    ) -> nn.Module:
        self.parallelize = parallelize
        if self.layout.pp > 1:  # the one place a step's shape is chosen (`self.steps`)
            assert pipeline is not None  # the loop gives it where the layout has stages
            return self._build_stages(init.build(factory), pipeline)
        if not shards_the_model(self.options, self.world_size):
            self.say(
                "fsdp: 1 process, nothing to shard: the model runs unwrapped, as ddp's does "
                "(fsdp.cpu_offload or fsdp.param_dtype keep FSDP)"
            )
            return self._plain(init.build(factory))
        if self.options.init == "cpu":  # built once, on CPU
            return self._build_on_cpu(init.build(factory), "fsdp.init: cpu")
        try:
            model = build_on_meta(factory)
        except MetaBuildFailed as failed:
            if self.options.init != "auto":
                raise
            why = (
                f"fsdp.init: auto: {failed.reason}, so it is built as under fsdp.init: cpu "
                "(set it to skip this try)"
            )
            return self._build_on_cpu(init.build(factory), why)
        self.say(shard_units(model, self.options.wrap).describe(model))
        return self._initialise_on_meta(model, factory, init)

    def _initialise_on_meta(
        self, model: nn.Module, factory: Callable[[], nn.Module], init: WeightInit
    ) -> nn.Module:
        """`model`, built on the meta device, sharded and initialised on each rank's shards;
        or, under `fsdp.init: auto` where no explicit initialisation defines every weight,
        built again on CPU."""
        choice, exact, name = self.options.init, init.exact(model), type(model).__name__
        if choice == "auto" and exact is None:
            # Its constructors define its weights: it is built again, on CPU (fsdp.init: cpu
            # builds it once).
            why = (
                f"fsdp.init: auto: {name} has no explicit initialisation (an init_weights of "
                "the recipe or the model, or a Hugging Face model's), so its constructors define "
                "its weights"
            )
            return self._build_on_cpu(init.build(factory), why, units_said=True)
        try:
            model = self._materialise(model, init)
        except UnsetByInit as unset:
            if choice != "auto":
                raise
            left = ", ".join(unset.names[:4]) + (" ..." if len(unset.names) > 4 else "")
            why = f"fsdp.init: auto: {exact} leaves {left} unset on the meta device"
            return self._build_on_cpu(init.build(factory), why, units_said=True)
        if exact is None:
            self.say(
                f"fsdp.init: meta: {name} has no explicit initialisation, so each module's "
                "reset_parameters() initialised its shards: not proven equal to a plain build "
                "(ddp), whose constructors may draw otherwise; fsdp.init: cpu builds it exactly"
            )
        else:
            self.say(f"fsdp.init: {choice}: {exact} initialised each rank's shards (meta device)")
        return model

    def _build_stages(self, model: nn.Module, given: PipelineInput) -> nn.Module:
        """This process's pipeline stages of `model` (built whole on CPU, as ddp builds it:
        every stage starts from ddp's weights), each laid out as fsdp lays out a model; from
        here on the steps run through them."""
        assert self.dims is not None
        self.prepare_layers(model)
        mesh = self.dims.build_mesh(self.device.type)
        pipeline, stages = build_pipeline(
            model, given, self.parallel, self.options.wrap, self.dims, self.rank, mesh,
            self.device, self.precision.example_autocast, dtype_of(self.options.param_dtype),
        )  # fmt: skip
        shard_units(model, self.options.wrap)  # fsdp.wrap names classes of the whole model
        for stage in stages.modules:
            if data_mesh(mesh) is None:  # pipeline and tensor parallelism alone: not sharded
                stage.to(self.device)
            options = self.options.model_copy(update={"wrap": _present(stage, self.options.wrap)})
            with warnings.catch_warnings():  # a plan's layers that other stages hold
                warnings.filterwarnings("ignore", message="Parallelize plan key")
                lay_out(stage, self.dims, mesh, options, self.parallelize, self.compile_units)
        self.steps = PipelinedSteps(pipeline, self.precision)
        return StageParts(stages.modules)

    def _materialise(self, model: nn.Module, init: WeightInit) -> nn.Module:
        self.wrap_model(model)
        # Offloaded shards live in CPU memory; FSDP moves them to the GPU when it needs them.
        model.to_empty(device="cpu" if self.options.cpu_offload else self.device)
        initialize(model, init)
        return model

    def _build_on_cpu(self, model: nn.Module, why: str, units_said: bool = False) -> nn.Module:
        """Shards `model`, built whole on CPU in every process, as ddp builds it. `units_said`:
        the shard units were named already, from the model on the meta device."""
        if not units_said:
            self.say(shard_units(model, self.options.wrap).describe(model))
        full_bytes = local_bytes(itertools.chain(model.parameters(), model.buffers()))
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torch.distributed's own
        self.say(
            f"{why}: every process builds the whole model on CPU as ddp does, then shards it: "
            f"{size_text(full_bytes)} of host memory per process, {size_text(full_bytes * processes)} "
            f"for the {processes} on this machine"
        )
        # fully_shard moves each unit to the mesh's device as it shards it (offloaded shards
        # go back to CPU), so the device never holds more than one whole unit.
        return self.wrap_model(model)

    def _plain(self, model: nn.Module) -> nn.Module:
        self.prepare_layers(model)
        model.to(self.device)
        units = shard_units(model, self.options.wrap).modules
        checkpoint_activations(units, self.options)
        self.compile_units(model, units)
        return model

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self.prepare_layers(model)
        assert self.dims is not None  # set by setup
        mesh = self.dims.build_mesh(self.device.type)
        source = lay_out(model, self.dims, mesh, self.options, self.parallelize, self.compile_units)
        if source:
            self.say(f"tensor parallel over {self.dims.tp} processes: {source}")
            # A gathered output (the logits of a `Replicate` head) is a view of DTensor's
            # buffer, and FSDP2 warns on every rank that an in-place op on it would skip its
            # hook: true of any output, and nothing the run does.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        return model

    def sync_gradients(
        self, model: nn.Module, sync: bool
    ) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()


def _present(stage: nn.Module, wrap: list[str] | None) -> list[str] | None:
    """The classes of `fsdp.wrap` that `stage` holds: the list names the whole model's."""
    if wrap is None:
        return None
    held = {type(m).__name__ for m in stage.modules()}
    return [name for name in wrap if name in held]


def shards_the_model(options: FSDPSection, world_size: int) -> bool:
    """Whether fsdp wraps the model at all: on several processes, or on one for what only FSDP
    does (offloading, and gathering parameters in another dtype)."""
    return world_size > 1 or options.cpu_offload or options.param_dtype is not None


def lay_out(
    model: nn.Module,
    dims: ParallelDims,
    mesh: Any,
    options: FSDPSection,
    parallelize: ParallelizeHook | None,
    compile_units: Callable[[nn.Module, list[nn.Module]], None] | None = None,
) -> str | None:
    """Applies the run's dimensions to `model` in torchtitan's order: tensor parallelism
    (over `mesh`'s `tp` axis), then activation checkpointing and compile (`compile_units`),
    then FSDP or HSDP over the data axes. The training run and the memory estimate
    (`launcher.parallel.memory_estimate`) both lay a model out here. Returns where the
    tensor-parallel plan came from; None without one."""
    units = shard_units(model, options.wrap).modules
    source = apply_tensor_parallel(model, mesh["tp"], parallelize) if dims.tp > 1 else None
    expert_mesh = dims.build_expert_mesh(mesh.device_type) if dims.ep > 1 else None
    experts = apply_expert_parallel(model, expert_mesh) if expert_mesh is not None else []
    checkpoint_activations(units, options)
    if compile_units is not None:
        compile_units(model, units)
    data = data_mesh(mesh) if mesh is not None else None
    if experts:  # over the data ranks each expert has left, before the blocks holding them
        shard_experts(experts, expert_mesh, dims.dp_size, **fsdp_options(options))
    if data is not None:  # none: tensor parallelism alone
        shard_model(model, units, data, options)
    return source


def checkpoint_activations(units: list[nn.Module], options: FSDPSection) -> None:
    """`fsdp.activation_checkpointing`: each unit recomputes its activations in backward."""
    if options.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for unit in units:
            checkpoint(unit)


def shard_model(model: nn.Module, units: list[nn.Module], mesh: Any, options: FSDPSection) -> None:
    """FSDP2 over `mesh`: each unit, then the root. A 2-D mesh (dp_replicate, dp_shard) is HSDP:
    each unit's parameters sharded within a replica, its gradients all-reduced across them."""
    kwargs = fsdp_options(options)
    for unit in units:
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def fsdp_options(options: FSDPSection) -> dict[str, Any]:
    """`fully_shard`'s options, but the mesh, from the `fsdp` section."""
    kwargs: dict[str, Any] = {
        "reshard_after_forward": options.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=dtype_of(options.param_dtype),
            reduce_dtype=dtype_of(options.reduce_dtype),
        ),
    }
    if options.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs
