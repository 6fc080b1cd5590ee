"""From a validated spec and the command line to a `LaunchPlan`: plain, resolved values.

Nothing here starts a process or writes a file, so every decision can be unit-tested.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from launcher import checkpoint
from launcher.errors import UsageError
from launcher.ranks import parse_ranks
from launcher.spec import RunSpec
from launcher.strategies import available_strategies, worker_env

XLA_STRATEGIES = ("xla", "xla_fsdp")


@dataclass(frozen=True)
class LaunchPlan:
    spec: RunSpec
    run_dir: Path
    accelerator: str  # "cpu", "gpu" or "tpu": never "auto"
    nproc: int  # processes on this node
    resume_from: Path | None  # a complete checkpoint folder
    show_ranks: frozenset[int] | None  # --ranks display filter; None shows every rank
    omp_threads: int
    debug: bool = False

    def worker_env(self) -> dict[str, str]:
        """Environment the workers start with, on top of the launcher's own."""
        env = {
            "OMP_NUM_THREADS": str(self.omp_threads),
            **worker_env(self.spec.launch.strategy, self.accelerator),
        }
        return {k: os.environ.get(k, v) for k, v in env.items()}


def make_plan(
    spec: RunSpec,
    *,
    run_dir: Path | None = None,
    resume: str | None = None,
    ranks: str | None = None,
    debug: bool = False,
) -> LaunchPlan:
    accelerator = resolve_accelerator(spec.launch.accelerator, spec.launch.strategy)
    if spec.launch.strategy == "fsdp" and spec.fsdp.cpu_offload and accelerator != "gpu":
        raise UsageError(
            "fsdp.cpu_offload: moves shards from GPU memory to CPU memory, so it needs "
            f"--accelerator gpu (this run is on {accelerator}, where they already are)"
        )
    nproc = resolve_devices(spec.launch.devices, accelerator)
    output_dir = Path(spec.run.output_dir)
    resume_from = checkpoint.resolve_resume(resume, output_dir, spec.run.name) if resume else None
    explicit = run_dir is not None
    if run_dir is None:
        # A resumed run continues in its own folder; a new run gets a new one.
        run_dir = (
            resume_from.parent.parent if resume_from else _new_run_dir(output_dir, spec.run.name)
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
    try:
        show = parse_ranks(ranks) if ranks else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return LaunchPlan(
        spec=spec,
        run_dir=run_dir,
        accelerator=accelerator,
        nproc=nproc,
        resume_from=resume_from,
        show_ranks=show,
        omp_threads=_omp_threads(accelerator, nproc),
        debug=debug,
    )


def resolve_accelerator(requested: str, strategy: str) -> str:
    if requested != "tpu" and strategy not in available_strategies():
        raise UsageError(
            f"launch.strategy: {strategy!r} is not available in this version "
            f"(available: {', '.join(available_strategies())})"
        )
    if requested == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if requested == "gpu" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise UsageError(
            f"--accelerator gpu: no CUDA GPU is visible (torch {torch.__version__}, {build})",
            hint="Use --accelerator cpu, or install a CUDA build of torch on a machine with a GPU.",
        )
    if requested == "tpu" and strategy in ("ddp", "fsdp"):
        raise UsageError(
            f"--accelerator tpu: strategy {strategy!r} is for CPUs and GPUs; TPUs use "
            f"{'xla_fsdp' if strategy == 'fsdp' else 'xla'} (torch_xla), which this version "
            "does not support yet"
        )
    if requested == "tpu":
        raise UsageError(
            "--accelerator tpu: needs strategy xla or xla_fsdp and torch_xla, which this "
            "version does not support yet",
        )
    return requested


def resolve_devices(devices: int | str, accelerator: str) -> int:
    if accelerator == "gpu":
        visible = torch.cuda.device_count()
        if devices == "auto":
            return visible
        if int(devices) > visible:
            raise UsageError(
                f"--devices {devices}: only {visible} GPU(s) visible on this machine",
                hint="Lower --devices, or check CUDA_VISIBLE_DEVICES.",
            )
        return int(devices)
    # On CPU every process is a replica sharing the cores; `auto` keeps to one.
    return 1 if devices == "auto" else int(devices)


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
