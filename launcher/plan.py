"""From a validated spec and the command line to a `LaunchPlan`: plain, resolved values.

Nothing here starts a process or writes a file, so every decision can be unit-tested.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher import checkpoint
from launcher.checkpoint_format import read_metadata
from launcher.devices import Devices, resolve_accelerator, resolve_devices, xla_device_type
from launcher.errors import UsageError
from launcher.nodes import Nodes
from launcher.ranks import parse_ranks
from launcher.spec import RunSpec
from launcher.strategies import strategy_info, worker_env
from launcher.tpu_pod import host_index


@dataclass(frozen=True)
class LaunchPlan:
    spec: RunSpec
    run_dir: Path
    accelerator: str  # "cpu", "gpu" or "tpu": never "auto"
    devices: Devices  # this node's devices, processes and replicas
    resume_from: Path | None  # a complete checkpoint folder
    show_ranks: frozenset[int] | None  # --ranks display filter; None shows every rank
    omp_threads: int
    debug: bool = False
    notes: tuple[str, ...] = ()  # warnings for the user, printed before the run starts
    host_index: int = 0  # a TPU pod's host: its processes' ranks come after the hosts before it
    nodes: Nodes = field(default_factory=Nodes)  # the run's nodes; this plan is one node's

    @property
    def nproc(self) -> int:
        """Worker processes the elastic agent starts on this node."""
        return self.devices.processes

    def worker_env(self) -> dict[str, str]:
        """Environment the workers start with, on top of the launcher's own (which wins for
        the defaults below, so a user's setting is kept)."""
        env = {
            "OMP_NUM_THREADS": str(self.omp_threads),
            **worker_env(self.spec.launch.strategy, self.accelerator),
        }
        # XLA's CPU client cannot load the executables it serialises: TPUs only.
        if self.accelerator == "tpu" and self.spec.xla.compile_cache and xla_device_type() == "TPU":
            env["XLA_PERSISTENT_CACHE_PATH"] = str(self.run_dir / "xla_cache")
        env = {k: os.environ.get(k, v) for k, v in env.items()}
        if self.host_index:
            env["LAUNCHER_RANK_OFFSET"] = str(self.rank_offset)
        return env | self.devices.env  # the device count is the plan's, not a leftover's

    @property
    def node_dir(self) -> Path:
        """This node's own files (spec copy, agent logs) when the run folder is shared by
        several nodes or TPU hosts; the run folder itself for a run of one machine."""
        if self.nodes.multi:
            return self.run_dir / "nodes" / self.nodes.name
        if self.host_index:
            return self.run_dir / "nodes" / f"host-{self.host_index}"
        return self.run_dir

    @property
    def writes_shared_files(self) -> bool:
        """Whether this node writes the run's own files (spec.yaml): node 0 only."""
        if self.nodes.multi:
            return self.nodes.node_rank == 0
        return self.host_index == 0

    @property
    def rank_offset(self) -> int:
        """The global rank of this host's first log on a TPU pod (torch_xla numbers hosts'
        devices one host after the other); 0 elsewhere."""
        return self.host_index * self.devices.replica_logs


def make_plan(
    spec: RunSpec,
    *,
    run_dir: Path | None = None,
    resume: str | None = None,
    ranks: str | None = None,
    debug: bool = False,
    nodes: Nodes | None = None,
) -> LaunchPlan:
    nodes = nodes or Nodes()
    # Before the accelerator is resolved (which fails without torch_xla): `auto` means a TPU
    # exactly for the strategies that run on nothing else.
    tpu_only = strategy_info(spec.launch.strategy).accelerators == ("tpu",)
    if nodes.multi and (spec.launch.accelerator == "tpu" or tpu_only):
        raise UsageError(
            f"--nnodes {nodes.max}: TPU hosts do not rendezvous through the launcher; run the "
            "same train command, without --nnodes, on every host of the pod",
            hint="gcloud compute tpus tpu-vm ssh NAME --worker=all --command='train ...' "
            "(README: TPU pods).",
        )
    accelerator = resolve_accelerator(spec.launch.accelerator, spec.launch.strategy)
    if spec.launch.strategy == "fsdp" and spec.fsdp.cpu_offload and accelerator != "gpu":
        raise UsageError(
            "fsdp.cpu_offload: moves shards from GPU memory to CPU memory, so it needs "
            f"--accelerator gpu (this run is on {accelerator}, where they already are)"
        )
    info = strategy_info(spec.launch.strategy)
    if spec.checkpoint.async_ and not info.async_checkpoints:
        raise UsageError(
            f"checkpoint.async: not available with strategy {spec.launch.strategy}; its "
            "checkpoints are written synchronously",
            hint="Set checkpoint.async=false.",
        )
    if accelerator == "tpu" and spec.train.precision == "fp16":
        raise UsageError(
            "train.precision: fp16 is not supported on TPU",
            hint="Use bf16: TPUs compute in it natively, and it needs no loss scaling.",
        )
    devices = resolve_devices(spec.launch.devices, accelerator, spec.launch.strategy)
    notes: list[str] = []
    if accelerator == "tpu" and not spec.data.drop_last:
        # A short last batch is a new input shape, and every new shape is a new XLA compile.
        spec = spec.model_copy(update={"data": spec.data.model_copy(update={"drop_last": True})})
        notes.append(
            "data.drop_last=false is ignored on TPU: a short last batch would be a new shape, "
            "and XLA would compile the whole step again for it"
        )
    on_tpu = accelerator == "tpu" and xla_device_type() == "TPU"
    output_dir = Path(spec.run.output_dir)
    if nodes.job_id is not None:
        run_dir, resume_from = _job_run(nodes.job_id, output_dir, spec.run.name, run_dir, resume)
    else:
        run_dir, resume_from = _own_run(output_dir, spec.run.name, run_dir, resume)
    try:
        show = parse_ranks(ranks) if ranks else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return LaunchPlan(
        spec=spec,
        run_dir=run_dir,
        accelerator=accelerator,
        devices=devices,
        resume_from=resume_from,
        show_ranks=show,
        omp_threads=_omp_threads(accelerator, devices.processes),
        debug=debug,
        notes=tuple(notes),
        host_index=host_index(os.environ) if on_tpu else 0,
        nodes=nodes,
    )


def _own_run(
    output_dir: Path, name: str, run_dir: Path | None, resume: str | None
) -> tuple[Path, Path | None]:
    """A run of one launcher: a new folder, or the folder of the run it resumes."""
    resume_from = _resume_point(resume, output_dir, name)
    explicit = run_dir is not None
    if run_dir is None:
        # A resumed run continues in its own folder; a new run, or one resumed from a
        # checkpoint that is not inside a run folder, gets a new one.
        in_a_run = resume_from is not None and resume_from.parent.name == "checkpoints"
        run_dir = (
            resume_from.parent.parent  # type: ignore[union-attr]
            if in_a_run
            else _new_run_dir(output_dir, name)
        )
    newest = checkpoint.latest_complete(run_dir)
    # Writing into a folder that holds a run is safe only when this run continues exactly
    # where that folder's newest checkpoint left off; anything else would mix two runs and
    # overwrite or prune the other run's checkpoints.
    if _holds_a_run(run_dir) and (resume_from is None or newest != resume_from):
        if not explicit:
            raise UsageError(
                f"--resume {resume_from}: its run already has a newer checkpoint "
                f"({newest}); continuing in place would overwrite it",
                hint="Branch off with --run-dir NEW_FOLDER, or resume the newest checkpoint.",
            )
        raise UsageError(
            f"--run-dir {run_dir}: already holds a run; it is never overwritten",
            hint=f"Continue it with --resume {newest or run_dir}, or choose a new --run-dir.",
        )
    return run_dir, resume_from


def _job_run(
    job_id: str, output_dir: Path, name: str, run_dir: Path | None, resume: str | None
) -> tuple[Path, Path | None]:
    """A run with a job id (`--rdzv-id`, a SLURM job): every node, and a requeued or
    restarted node, finds the same folder, <output_dir>/<name>/<job id>. Nodes join it while
    it has no checkpoint; once it has one, a node must say --resume to continue it."""
    run_dir = run_dir or output_dir / name / job_id
    newest = checkpoint.latest_complete(run_dir)
    if newest is None and (run_dir / "summary.json").exists():
        # Finished without a checkpoint (checkpoints off): nothing to continue, and starting
        # it over would replace its metrics.
        raise UsageError(
            f"run folder {run_dir} (job {job_id}) holds a finished run; it is never overwritten",
            hint="Use another --rdzv-id.",
        )
    if resume == "latest":
        # The job's own newest checkpoint, or none yet: a requeued job that was stopped
        # before its first save starts over, in its own folder.
        return run_dir, newest
    resume_from = _resume_point(resume, output_dir, name)
    if newest is not None and newest != resume_from:
        raise UsageError(
            f"run folder {run_dir} (job {job_id}) already has checkpoints; it is never overwritten",
            hint="Continue it with --resume latest on every node, or use another --rdzv-id.",
        )
    return run_dir, resume_from


def _resume_point(resume: str | None, output_dir: Path, name: str) -> Path | None:
    if resume is None:
        return None
    resume_from = checkpoint.resolve_resume(resume, output_dir, name)
    read_metadata(resume_from)  # a corrupt checkpoint is refused here, before any process
    return resume_from


def _omp_threads(accelerator: str, nproc: int) -> int:
    if "OMP_NUM_THREADS" in os.environ:
        value = os.environ["OMP_NUM_THREADS"]
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"OMP_NUM_THREADS={value!r}: expected a positive number, or unset it")
        return int(value)
    if accelerator == "cpu":
        # Oversubscribed cores make every replica slower than fewer threads would.
        return max(1, (os.cpu_count() or 1) // nproc)
    return 1


def _new_run_dir(output_dir: Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = output_dir / name / stamp
    n = 1
    while candidate.exists():
        n += 1
        candidate = output_dir / name / f"{stamp}-{n}"
    return candidate


def _holds_a_run(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())
