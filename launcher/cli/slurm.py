"""`train slurm`: print an sbatch script for a SLURM cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from launcher.cli.options import ConfigOpt, DebugOpt, Overrides, print_from_spec
from launcher.clusters.slurm import CPUS_PER_GPU

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


def slurm_command(
    config: ConfigOpt,
    nodes: Annotated[int, typer.Option(min=1, help="Nodes to allocate.")],
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node.")],
    overrides: Overrides = None,
    partition: Annotated[str | None, typer.Option(help="#SBATCH --partition.")] = None,
    time: Annotated[str | None, typer.Option(help="#SBATCH --time, e.g. 24:00:00.")] = None,
    account: Annotated[str | None, typer.Option(help="#SBATCH --account.")] = None,
    cpus_per_task: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="#SBATCH --cpus-per-task: CPU cores for each node's train, its processes and "
            f"their DataLoader workers. Left out: {CPUS_PER_GPU} per GPU; 0: none asked for (the "
            "cluster's default, one core).",
            show_default=False,
        ),
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Print an sbatch script that runs this spec on a SLURM cluster and requeues itself when
    preempted. Submit it with: train slurm ... > job.sbatch && sbatch job.sbatch"""

    def script(spec: RunSpec) -> str:
        from launcher.clusters.slurm import sbatch_script

        return sbatch_script(
            str(config),
            nodes,
            gpus_per_node,
            spec.run.name,
            partition=partition,
            time=time,
            account=account,
            cpus_per_task=cpus_per_task,
            extra_args=list(overrides or []),
        )

    print_from_spec(config, overrides, debug, script)
