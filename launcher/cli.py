"""`train`: the command line. It parses, builds a plan, and calls one function."""

from __future__ import annotations

from launcher import cli_interrupt  # first: Ctrl-C during the slow imports below

# isort: split
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from launcher.cli_spec import load_cli_spec
from launcher.errors import LauncherError
from launcher.spec import LaunchSection, RunSpec

EXAMPLES = """
Examples:

  train --config configs/quickstart.yaml

  train --config configs/quickstart.yaml --devices 2 --accelerator cpu

  train --config my_run.yaml --devices 4 optim.lr=3e-4 train.max_steps=500

  train --config my_run.yaml --resume latest

  train --config my_run.yaml --nnodes 2 --node-rank 0 --rdzv-endpoint node01:29500 --rdzv-id exp42

  train validate --config my_run.yaml     (check a spec and its recipe, run nothing)

  train slurm --config my_run.yaml --nodes 4 --gpus-per-node 8 > job.sbatch

  train export runs/my_run/20261121-103405 --out model.safetensors   (the newest checkpoint's model)
"""


class _DefaultToRun(TyperGroup):
    """`train --config x` means `train run --config x`: the run command is the default."""

    def parse_args(self, ctx, args):  # type: ignore[no-untyped-def]
        if not args or args[0] not in self.commands:
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_DefaultToRun,
    add_completion=False,
    no_args_is_help=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _doc(key: str) -> str:
    return LaunchSection.model_fields[key].description or ""


ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="The run spec (YAML).")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Overrides of spec keys, e.g. optim.lr=3e-4 train.max_steps=500.", show_default=False
    ),
]


@app.command("run", epilog=EXAMPLES, context_settings={"allow_interspersed_args": True})
def run_command(
    config: ConfigOpt,
    overrides: Overrides = None,
    accelerator: Annotated[str | None, typer.Option(help=_doc("accelerator"))] = None,
    devices: Annotated[str | None, typer.Option(help=_doc("devices"))] = None,
    strategy: Annotated[str | None, typer.Option(help=_doc("strategy"))] = None,
    max_restarts: Annotated[str | None, typer.Option(help=_doc("max_restarts"))] = None,
    stall_timeout: Annotated[str | None, typer.Option(help=_doc("stall_timeout"))] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Continue from a checkpoint folder, a run folder (its newest complete checkpoint), "
            "`latest`: the newest run of this run.name (with --rdzv-id or in SLURM, that job's "
            "own folder, if it has a checkpoint yet), or `best`: that run's best checkpoint by "
            "checkpoint.monitor."
        ),
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            help="Write this run here instead of <run.output_dir>/<run.name>/<timestamp>; "
            "an existing run is never overwritten."
        ),
    ] = None,
    ranks: Annotated[
        str | None,
        typer.Option(
            help="Show only these ranks' output, e.g. 0,2-3. Warnings, errors and tracebacks "
            "of every rank are always shown."
        ),
    ] = None,
    nnodes: Annotated[
        str | None,
        typer.Option(
            help="Nodes in the run: N, or MIN:MAX for an elastic run. Every node runs the same "
            "command. Inside SLURM's srun: the allocation's.",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    node_rank: Annotated[
        str | None,
        typer.Option(
            help="This node's rank, 0 to N-1: node K runs global ranks K*devices onwards, and "
            "node 0 hosts the rendezvous. Inside srun: SLURM_NODEID.",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT of the rendezvous on node 0, the same on every node. Inside srun: "
            "the first node of the allocation.",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    rdzv_id: Annotated[
        str | None,
        typer.Option(
            help="The job's name, the same on every node; the run folder is "
            "<run.output_dir>/<run.name>/<rdzv-id>. Inside srun: the SLURM job id.",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    strict_compile: Annotated[
        bool,
        typer.Option(
            "--strict-compile",
            help="XLA: stop the run when a new graph is compiled after warm-up "
            "(sets xla.strict_compile).",
        ),
    ] = False,
    debug: Annotated[
        bool, typer.Option(help="Show tracebacks and the elastic agent's logs.")
    ] = False,
) -> None:
    """Train: launch one process per device, wrap the model, stream every replica's logs."""

    def go() -> int:
        from launcher.launch.execute import execute
        from launcher.launch.nodes import resolve_nodes
        from launcher.launch.plan import make_plan

        nodes = resolve_nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, env=os.environ)

        spec = load_cli_spec(
            config,
            overrides,
            strict_compile=strict_compile,
            accelerator=accelerator,
            devices=devices,
            strategy=strategy,
            max_restarts=max_restarts,
            stall_timeout=stall_timeout,
        )
        _check_recipe(spec)  # a recipe that cannot load or take its arguments fails here
        plan = make_plan(
            spec, run_dir=run_dir, resume=resume, ranks=ranks, debug=debug, nodes=nodes
        )
        return execute(plan)

    raise typer.Exit(_guarded(go, debug))


@app.command("validate")
def validate_command(
    config: ConfigOpt,
    overrides: Overrides = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Check a spec and its recipe: build its datasets, a batch and the model (on the meta
    device), and report their sizes. Starts no processes."""

    def go() -> int:
        from launcher.train.recipe_check import dry_build

        summary = dry_build(load_cli_spec(config, overrides))
        err.print(Text(f"{config}: ok · {summary}"))
        return 0

    raise typer.Exit(_guarded(go, debug))


@app.command("slurm", context_settings={"allow_interspersed_args": True})
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
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Print an sbatch script that runs this spec on a SLURM cluster and requeues itself when
    preempted. Submit it with: train slurm ... > job.sbatch && sbatch job.sbatch"""

    def go() -> int:
        from launcher.launch.slurm import sbatch_script

        spec = load_cli_spec(config, overrides)
        _check_recipe(spec)
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

    raise typer.Exit(_guarded(go, debug))


@app.command("export")
def export_command(
    source: Annotated[
        Path,
        typer.Argument(
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
    debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False,
) -> None:
    """Write a checkpoint's model as one file that plain PyTorch loads: the whole, unsharded
    state_dict, for any strategy and number of processes. Starts no processes."""

    def go() -> int:
        from launcher.train.export import export

        typer.echo(export(source, out, best=best).describe())
        return 0

    raise typer.Exit(_guarded(go, debug))


def _check_recipe(spec: RunSpec) -> None:
    """Imports the recipe as the workers will (from the working directory) and checks that it
    defines what the launcher calls, with arguments its functions take; builds nothing."""
    from launcher.train.recipe_check import load_checked

    load_checked(spec)


def _guarded(fn, debug: bool) -> int:  # type: ignore[no-untyped-def]
    """Known failures print a short message; a traceback only with --debug."""
    try:
        return cli_interrupt.unwinding(fn)
    except LauncherError as exc:
        if debug:
            traceback.print_exc()
        err.print(Text("error: ", style="bold red") + Text(exc.render()))
        return exc.exit_code


def main() -> None:
    app(prog_name="train")


if __name__ == "__main__":
    sys.exit(main())
