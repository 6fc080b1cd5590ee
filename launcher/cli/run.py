"""`train --config run.yaml`: the run itself. It loads the spec, checks the recipe, plans
and executes; torch is imported only once the spec is valid."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from launcher.cli.options import (
    AcceleratorOpt,
    ConfigOpt,
    DevicesOpt,
    MaxRestartsOpt,
    Overrides,
    StallTimeoutOpt,
    StrategyOpt,
    StrictCompileOpt,
    run_guarded,
)
from launcher.cli.validate import check_recipe


def run_command(
    config: ConfigOpt,
    overrides: Overrides = None,
    accelerator: AcceleratorOpt = None,
    devices: DevicesOpt = None,
    strategy: StrategyOpt = None,
    max_restarts: MaxRestartsOpt = None,
    stall_timeout: StallTimeoutOpt = None,
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
    strict_compile: StrictCompileOpt = False,
    debug: Annotated[
        bool, typer.Option(help="Show tracebacks and the elastic agent's logs.")
    ] = False,
) -> None:
    """Train: launch one process per device, wrap the model, stream every replica's logs."""

    def launch() -> int:
        from launcher.config.loader import load_cli_spec_and_sources
        from launcher.launch.nodes import resolve_nodes

        nodes = resolve_nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, env=os.environ)
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
        check_recipe(spec, sources)  # a recipe that cannot load or take its arguments fails here
        from launcher.launch.execute import execute
        from launcher.launch.plan import make_plan

        plan = make_plan(
            spec,
            run_dir=run_dir,
            resume=resume,
            ranks=ranks,
            debug=debug,
            nodes=nodes,
            sources=sources,
        )
        return execute(plan)

    run_guarded(launch, debug)
