"""`train`'s commands besides the run itself: validate, slurm, export and schema.

Each imports what it needs (torch included) inside its body, once its arguments are parsed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from launcher.cli.options import (
    AcceleratorOpt,
    ConfigOpt,
    DebugOpt,
    DevicesOpt,
    MaxRestartsOpt,
    Overrides,
    StallTimeoutOpt,
    StrategyOpt,
    StrictCompileOpt,
    err,
    run_guarded,
)

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec


def validate_command(
    config: ConfigOpt,
    overrides: Overrides = None,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="Also show each key that is not at its default, and where it came from: the "
            "YAML (file:line), a key=value override or a flag.",
        ),
    ] = False,
    accelerator: AcceleratorOpt = None,
    devices: DevicesOpt = None,
    strategy: StrategyOpt = None,
    max_restarts: MaxRestartsOpt = None,
    stall_timeout: StallTimeoutOpt = None,
    strict_compile: StrictCompileOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check a spec and its recipe: build its datasets, a batch and the model (on the meta
    device), and report their sizes. Starts no processes."""

    def go() -> int:
        from launcher.config.flags import load_cli_spec_and_sources

        # Its own mistakes are reported before torch is imported (seconds): spec_loader.
        spec, sources = load_cli_spec_and_sources(
            config,
            overrides,
            strict_compile,
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            max_restarts=max_restarts,
            stall_timeout=stall_timeout,
        )
        if explain:
            from launcher.config.sources import explain_text

            typer.echo(explain_text(spec, sources))
        from launcher.cli.recipe_check import dry_build

        summary = dry_build(spec)
        err.print(Text(f"{config}: ok · {summary}"))
        return 0

    run_guarded(go, debug)


def slurm_command(
    config: ConfigOpt,
    nodes: Annotated[int, typer.Option(min=1, help="Nodes to allocate.")],
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node.")],
    overrides: Overrides = None,
    partition: Annotated[str | None, typer.Option(help="#SBATCH --partition.")] = None,
    time: Annotated[str | None, typer.Option(help="#SBATCH --time, e.g. 24:00:00.")] = None,
    account: Annotated[str | None, typer.Option(help="#SBATCH --account.")] = None,
    cpus_per_task: Annotated[
        int | None, typer.Option(min=1, help="#SBATCH --cpus-per-task: CPU cores per node.")
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Print an sbatch script that runs this spec on a SLURM cluster and requeues itself when
    preempted. Submit it with: train slurm ... > job.sbatch && sbatch job.sbatch"""

    def go() -> int:
        from launcher.config.flags import load_cli_spec
        from launcher.launch.slurm import sbatch_script

        spec = load_cli_spec(config, overrides)
        check_recipe(spec)
        script = sbatch_script(
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
        sys.stdout.write(script)
        return 0

    run_guarded(go, debug)


def export_command(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="SOURCE",
            help="A checkpoint folder, or a run folder (its newest complete checkpoint).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            help="The file to write: .safetensors, or .pt/.pth/.bin (torch.save). An existing "
            "file is never overwritten."
        ),
    ],
    best: Annotated[
        bool,
        typer.Option(
            "--best", help="Export the run's best checkpoint by checkpoint.monitor instead."
        ),
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Write a checkpoint's model as one file that plain PyTorch loads: the whole, unsharded
    state_dict, for any strategy and number of processes. Starts no processes."""

    def go() -> int:
        from launcher.checkpoint.export import export

        typer.echo(export(source, out, best=best).describe())
        return 0

    run_guarded(go, debug)


def schema_command() -> None:
    """Print the run spec's JSON Schema, every key with its description, for editors:
    train schema > run.schema.json, then `# yaml-language-server: $schema=run.schema.json`
    as a line of the YAML."""
    from launcher.config.schema import schema_text

    sys.stdout.write(schema_text())


def check_recipe(spec: RunSpec) -> None:
    """Imports the recipe as the workers will (from the working directory) and checks that it
    defines what the launcher calls, with arguments its functions take; builds nothing."""
    from launcher.cli.recipe_check import load_checked

    load_checked(spec)
