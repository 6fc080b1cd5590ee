"""`train validate`: check a spec and its recipe as a run would see them; starts nothing."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

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
    run_guarded,
)

if TYPE_CHECKING:
    pass


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
    device), run the loss on them, and report their sizes. Starts no processes."""

    def check() -> int:
        from launcher.cli.run import with_operator_devices
        from launcher.clusters.kubernetes import processes_per_node
        from launcher.clusters.nodes import Nodes
        from launcher.config.loader import cli_layers, spec_from_layers

        # Its own mistakes are reported before torch is imported (seconds): spec_loader.
        flags = {"accelerator": accelerator, "devices": devices, "strategy": strategy}
        flags |= {"max_restarts": max_restarts, "stall_timeout": stall_timeout}
        layers = cli_layers(config, overrides, strict_compile, **flags)
        # The devices a run here would start (torchrun's PET_NPROC_PER_NODE, where set); the
        # nodes are not validate's to check.
        pod = Nodes(devices=processes_per_node(os.environ))
        spec, sources = spec_from_layers(with_operator_devices(layers, pod))
        if explain:
            from launcher.config.sources import explain_text

            typer.echo(explain_text(spec, sources))
        from launcher.cli.dry_build import dry_build
        from launcher.metrics.trackers import check_trackers_usable

        check_trackers_usable(spec.log.trackers)
        if spec.fault_tolerance.enabled:
            from launcher.config.fault_tolerance import require_torchft, restart_warnings

            require_torchft()
            for warning in restart_warnings(True, spec.launch.max_restarts):
                typer.echo(f"warning: {warning}", err=True)
        from launcher.launch.reaper import children_reaped

        with children_reaped():  # what the recipe starts as it is imported and built
            summary = dry_build(spec, sources.get("recipe.source", ""))
        typer.echo(f"{config}: ok · {summary}")  # the result: stdout, as --explain's table
        return 0

    run_guarded(check, debug)
