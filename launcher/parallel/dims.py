"""The dimensions of parallelism of a run, and the device mesh they make.

The world is a grid of `pp x dp_replicate x dp_shard x tp` processes, in that order: pipeline
stages outermost (their groups may span nodes: a stage passes one activation per micro-batch),
tensor parallelism innermost (the `tp` processes of one group are consecutive ranks, so they
stay on one node and its fast links). A process's coordinates in that grid say everything of
its place: its data-parallel rank is its (dp_replicate, dp_shard) coordinate, so every process
of a tensor-parallel group and every stage of a pipeline gets the same batch.

Used by both processes: the launcher checks the degrees against the world before anything
starts (`resolve_dims`), and each worker builds the mesh from the same answer. Modelled on
torchtitan's `ParallelDims`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.config.parallel import ParallelSection
from launcher.errors import UsageError
from launcher.parallel.experts import DOCS as EXPERT_DOCS
from launcher.parallel.experts import EXPERT_AXES

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
DOCS = "docs/fsdp-and-parallelism.md, 'Parallelism as dimensions'"


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    # Expert parallelism: data-parallel ranks of one replica (a divisor of dp_shard) that
    # share their experts, each holding 1/ep of them (`launcher.parallel.experts`). Not an
    # axis of the world's grid: the experts have a mesh of their own (`build_expert_mesh`).
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: groups of processes that each take their own batch."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s place on each axis of the grid (`MESH_AXES`, the last varying fastest)."""
        place = {}
        for axis, degree in reversed(list(zip(MESH_AXES, self.astuple(), strict=True))):
            rank, place[axis] = divmod(rank, degree)
        return place

    def dp_rank(self, rank: int) -> int:
        place = self.coordinates(rank)
        return place["dp_replicate"] * self.dp_shard + place["dp_shard"]

    def pp_rank(self, rank: int) -> int:
        return self.coordinates(rank)["pp"]

    def as_record(self) -> dict[str, int]:
        """The layout as a checkpoint's meta.json keeps it (`from_record` reads it back)."""
        return {**dict(zip(MESH_AXES, self.astuple(), strict=True)), "ep": self.ep}

    @classmethod
    def from_record(cls, record: dict[str, Any] | None, world: int, tp: int = 1) -> ParallelDims:
        """A layout `as_record` wrote; for a checkpoint older than it, which kept `tp` alone,
        the layout that maps its ranks to data ranks alike."""
        if record:
            return cls(**{axis: int(record.get(axis, 1)) for axis in (*MESH_AXES, "ep")})
        return cls(dp_replicate=max(1, world // tp), tp=tp)

    @property
    def hybrid(self) -> bool:
        """HSDP: replicas of a sharded model."""
        return self.dp_replicate > 1 and self.dp_shard > 1

    def build_mesh(self, device_type: str) -> Any:
        """The world's `DeviceMesh`, with an axis for each degree above 1, named as in
        `MESH_AXES` (one `dp_shard` axis for a world of 1). Collective: every process calls
        it, and each axis costs a process group."""
        from torch.distributed.device_mesh import init_device_mesh

        axes = [(n, d) for n, d in zip(MESH_AXES, self.astuple(), strict=True) if d > 1]
        names, shape = zip(*axes, strict=True) if axes else (("dp_shard",), (1,))
        return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))

    def build_expert_mesh(self, device_type: str) -> Any:
        """The experts' `DeviceMesh` (`launcher.parallel.experts.EXPERT_AXES`): each replica's
        `dp_shard` ranks as `efsdp x ep`, `ep` the consecutive ranks that share their experts;
        None without expert parallelism. Collective, as `build_mesh` is."""
        if self.ep == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.dp_replicate, self.dp_shard // self.ep, self.ep, 1)
        return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_AXES)

    def describe(self) -> str:
        """e.g. `pp 2 x dp_shard 2 x tp 2`, leaving out the degrees of 1 (`ep` last)."""
        named = [f"{axis} {degree}" for axis, degree in zip(MESH_AXES, self.astuple(), strict=True)]
        shown = [text for text, degree in zip(named, self.astuple(), strict=True) if degree > 1]
        shown += [f"ep {self.ep}"] if self.ep > 1 else []
        return " x ".join(shown) or "1 process"

    def astuple(self) -> tuple[int, int, int, int]:
        return self.pp, self.dp_replicate, self.dp_shard, self.tp


def data_mesh(mesh: Any) -> Any | None:
    """The sub-mesh of `mesh`'s data axes: 1-D for FSDP, 2-D (dp_replicate, dp_shard) for
    HSDP; None where it has none (tensor parallelism alone)."""
    names = mesh.mesh_dim_names or ()
    axes = tuple(axis for axis in ("dp_replicate", "dp_shard") if axis in names)
    return mesh[axes] if axes else None


def resolve_dims(
    section: ParallelSection, strategy: str, world: int, per_node: int
) -> ParallelDims:
    """The degrees `section` means for `strategy` on `world` processes, `per_node` on each
    node; a `UsageError` naming the key where they cannot be."""
    if strategy == "ddp":
        return _ddp_dims(section, world)
    if strategy == "fsdp":
        return _fsdp_dims(section, world, per_node)
    degrees = {axis: getattr(section, axis) for axis in (*MESH_AXES, "ep")}
    given = [key for key, value in degrees.items() if value not in (None, 1)]
    if given:
        raise UsageError(
            f"parallel.{given[0]}: launch.strategy {strategy} has no such dimension; the "
            "parallel section is for ddp and fsdp",
            hint="Remove the parallel section (the xla strategies set their own sharding).",
        )
    return ParallelDims(dp_replicate=world)


def _ddp_dims(section: ParallelSection, world: int) -> ParallelDims:
    if section.ep > 1:
        raise UsageError(
            f"parallel.ep: {section.ep}, but ddp keeps every expert in every process; "
            "experts spread over processes need launch.strategy: fsdp",
            hint="Set launch.strategy: fsdp (its parallel.dp_shard ranks lend themselves to the "
            f"experts), or parallel.ep: 1 ({EXPERT_DOCS}).",
        )
    if section.pp > 1 or section.tp > 1 or section.dp_shard not in (None, 1):
        key = "pp" if section.pp > 1 else "tp" if section.tp > 1 else "dp_shard"
        raise UsageError(
            f"parallel.{key}: ddp keeps a whole replica of the model in every process; "
            "sharding, pipelines and tensor parallelism need launch.strategy: fsdp",
            hint="Set launch.strategy: fsdp; with parallel.dp_shard: 1 it replicates the model "
            f"as ddp does ({DOCS}).",
        )
    if section.dp_replicate not in (None, "auto", world):
        raise UsageError(
            f"parallel.dp_replicate: {section.dp_replicate}, but ddp replicates the model on "
            f"every one of the {world} processes",
            hint="Remove parallel.dp_replicate, or set it to the world size.",
        )
    return ParallelDims(dp_replicate=world)


def _fsdp_dims(section: ParallelSection, world: int, per_node: int) -> ParallelDims:
    tp = section.tp
    if tp > 1 and per_node % tp:
        raise UsageError(
            f"parallel.tp: {tp} does not divide the {per_node} processes of a node, so a "
            "tensor-parallel group would span nodes, whose links are too slow for it",
            hint=f"Choose a tp that divides {per_node}.",
        )
    pp = section.pp
    if world % pp:
        raise UsageError(
            f"parallel.pp: {pp} stages do not divide the {world} processes of this run",
            hint=f"Choose a pp that divides {world}.",
        )
    stage_world = world // pp  # the processes of one stage
    nodes = max(1, stage_world // per_node)
    replicate, shard = section.dp_replicate, section.dp_shard
    if replicate == "auto":
        replicate = nodes
    if replicate is None:  # the rest of the world where dp_shard is given, else 1
        replicate = _rest(stage_world, shard * tp) if isinstance(shard, int) else 1
    if shard in (None, "auto"):
        shard = _rest(stage_world, replicate * tp)
    dims = ParallelDims(int(replicate), int(shard), tp, pp, section.ep)  # type: ignore[arg-type]
    if pp > 1 and section.pp_schedule == "ZBVZeroBubble" and dims.dp_size > 1:
        # Its backward computes weight gradients after the input gradients, apart, and FSDP
        # reduces them before they are all there: wrong gradients, without an error.
        raise UsageError(
            "parallel.pp_schedule: ZBVZeroBubble runs each backward in two parts, which "
            f"fsdp's gradient reduction does not follow; this layout has {dims.dp_size} "
            "data-parallel ranks",
            hint="Use Interleaved1F1B (two stages per process as well), or ZBVZeroBubble "
            "with the pipeline (and tp) alone.",
        )
    if dims.world != world or not replicate or not shard:
        stages = f"pp {pp} x " if pp > 1 else ""
        raise UsageError(
            f"parallel: {stages}dp_replicate {_shown(section.dp_replicate, replicate)} x "
            f"dp_shard {_shown(section.dp_shard, shard)} x tp {tp} does not make the {world} "
            "processes of this run",
            hint="Choose degrees whose product is the world size (the devices times the "
            "nodes), or leave one of dp_replicate or dp_shard unset to take what is left.",
        )
    if dims.ep > 1:
        _check_experts(dims)
    return dims


def _check_experts(dims: ParallelDims) -> None:
    """`ep` borrows from each replica's `dp_shard` ranks (torchtitan's dp2ep)."""
    ep = dims.ep
    if dims.pp > 1 or dims.tp > 1:
        key = "pp" if dims.pp > 1 else "tp"
        raise UsageError(
            f"parallel.ep: experts spread over processes do not yet combine with parallel.{key}",
            hint=f"Set parallel.{key}: 1 with parallel.ep, or parallel.ep: 1 ({EXPERT_DOCS}).",
        )
    if dims.dp_shard % ep:
        raise UsageError(
            f"parallel.ep: {ep} does not divide the {dims.dp_shard} data-parallel ranks of a "
            "replica (parallel.dp_shard), which lend themselves to the experts",
            hint=f"Choose an ep that divides {dims.dp_shard}, or set parallel.dp_shard to a "
            f"multiple of {ep}.",
        )


def _rest(world: int, taken: int) -> int:
    """What the world leaves after `taken` processes per group; 0 where it does not divide."""
    return world // taken if world % taken == 0 else 0


def _shown(given: object, resolved: object) -> str:
    if given in (None, "auto"):
        return f"{resolved} ({given or 'unset'})" if resolved else "(nothing left)"
    return str(given)


__all__ = ["MESH_AXES", "ParallelDims", "data_mesh", "resolve_dims"]
