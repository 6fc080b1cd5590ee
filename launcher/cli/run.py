"""`train --config run.yaml`: the run itself. It loads the spec, checks the recipe, plans
and executes; torch is imported only once the spec is valid."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from launcher.cli.options import (
    AcceleratorOpt,
    DevicesOpt,
    LoadWeightsOpt,
    MaxRestartsOpt,
    Overrides,
    StallTimeoutOpt,
    StrategyOpt,
    StrictCompileOpt,
    run_guarded,
)
from launcher.errors import UsageError

if TYPE_CHECKING:
    from launcher.checkpoint.resume_decision import ResumeDecision
    from launcher.clusters.nodes import Nodes
    from launcher.config.loader import SpecLayers
    from launcher.config.spec import RunSpec
    from launcher.launch.plan import LaunchPlan


def run_command(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="The run spec (YAML). With --resume RUN|CHECKPOINT it may be left out: the "
            "run goes on with its own spec.",
            show_default=False,
        ),
    ] = None,
    overrides: Overrides = None,
    accelerator: AcceleratorOpt = None,
    devices: DevicesOpt = None,
    strategy: StrategyOpt = None,
    max_restarts: MaxRestartsOpt = None,
    stall_timeout: StallTimeoutOpt = None,
    load_weights: LoadWeightsOpt = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Continue from a checkpoint folder, a run folder (its newest complete checkpoint), "
            "`latest`: the newest run of this run.name (with --rdzv-id, in SLURM or in a "
            "Kubernetes pod, that job's own folder, if it has a checkpoint yet), or `best`: "
            "that run's best checkpoint by checkpoint.monitor."
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
            "command. Inside SLURM's srun or a Kubernetes pod: the job's.",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    node_rank: Annotated[
        str | None,
        typer.Option(
            help="This node's rank, 0 to N-1: node K runs global ranks K*devices onwards, and "
            "node 0 hosts the rendezvous. Inside srun: SLURM_NODEID; in a pod: its index.",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT of the rendezvous on node 0, the same on every node. Inside srun: "
            "the first node of the allocation; in a pod: the operator's master, or pod 0.",
            rich_help_panel="Multi-node",
        ),
    ] = None,
    rdzv_id: Annotated[
        str | None,
        typer.Option(
            help="The job's name, the same on every node; the run folder is "
            "<run.output_dir>/<run.name>/<rdzv-id>. Inside srun: the SLURM job id; in a pod: the "
            "job's name.",
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
        from launcher.clusters.nodes import resolve_nodes
        from launcher.config.loader import cli_layers

        nodes = resolve_nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, env=os.environ)
        # Its own mistakes are reported before torch is imported (seconds): config.loader.
        flags = {"accelerator": accelerator, "devices": devices, "strategy": strategy}
        flags |= {"max_restarts": max_restarts, "stall_timeout": stall_timeout}
        layers = cli_layers(config, overrides, strict_compile, load_weights, **flags)
        layers = with_operator_devices(layers, nodes)
        spec, sources, decided = spec_given(layers, resume, run_dir, nodes.job_id)
        from launcher.cli.recipe_check import check_recipe
        from launcher.launch.execute import execute
        from launcher.launch.fork_server import warm_server
        from launcher.launch.plan import make_plan

        # Forked now, before the recipe is imported: the workers' server never holds user code.
        with warm_server(spec) as fork_server:
            # A recipe that cannot load or take its arguments fails here.
            libraries = check_recipe(spec, sources)
            plan = make_plan(
                spec,
                run_dir=run_dir,
                resume=resume,
                ranks=ranks,
                debug=debug,
                nodes=nodes,
                sources=sources,
                layers=layers,
                resume_decided=decided,
            )
            plan = dataclasses.replace(plan, recipe_libraries=libraries)
            if plan.accelerator == "gpu":  # before it starts: a layout that will not fit
                plan = _with_memory_estimate(plan, sources.get("recipe.source", ""))
            return execute(plan, fork_server=fork_server)

    run_guarded(launch, debug)


def with_operator_devices(layers: SpecLayers, nodes: Nodes) -> SpecLayers:
    """The processes per node torchrun's PET_NPROC_PER_NODE asks for (a Kubeflow job sets
    it; so may a user used to torchrun), as a layer over the YAML file: `launch.devices=`
    overrides and `--devices`, which come after it, win."""
    from launcher.clusters.kubernetes import NPROC_PER_NODE

    if nodes.devices is None:
        return layers
    origin = f"{NPROC_PER_NODE} ({nodes.source})" if nodes.source else NPROC_PER_NODE
    given = ("launch.devices", nodes.devices, origin)
    return dataclasses.replace(layers, given=(given, *layers.given))


def spec_given(
    layers: SpecLayers, resume: str | None, run_dir: Path | None = None, job_id: str | None = None
) -> tuple[RunSpec, dict[str, str], ResumeDecision | None]:
    """The spec the command line describes: its YAML file's, or without `--config` the spec
    of the run `--resume` names; either way with its overrides and flags. Without `--config`
    the resume is decided here, once, for the plan (`launcher.checkpoint.resume_decision`)."""
    from launcher.config.loader import spec_from_layers

    if layers.config is not None:
        return (*spec_from_layers(layers), None)
    if resume is None:
        raise UsageError(
            "--config: required",
            hint="Give the run's YAML: train --config run.yaml (or continue a run without "
            "one: train --resume RUN_OR_CHECKPOINT_FOLDER).",
        )
    if resume in ("latest", "best"):
        raise UsageError(
            f"--resume {resume}: needs --config, whose run.name says which runs are this one's",
            hint="Or give the run's folder, or one of its checkpoints: --resume runs/NAME/STAMP",
        )
    from launcher.checkpoint.resume_decision import decide_resume

    decided = decide_resume(None, resume=resume, run_dir=run_dir, job_id=job_id, layers=layers)
    return decided.spec, decided.sources, decided


def _with_memory_estimate(plan: LaunchPlan, origin: str) -> LaunchPlan:
    """`plan` with the layout's memory estimate, for summary.json, and a warning where it
    will not fit the GPU (`launcher.cli.memory_check`)."""
    import dataclasses

    from launcher.cli.dry_build import gpu_memory_check

    world = plan.devices.processes * plan.nodes.max
    estimate, note = gpu_memory_check(plan.spec, origin, world, plan.devices.processes)
    notes = (*plan.notes, note) if note else plan.notes
    return dataclasses.replace(plan, notes=notes, memory_estimate=estimate)
