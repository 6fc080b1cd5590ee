"""`train runs`: the table of runs under a folder. Starts nothing and never imports torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from launcher.cli.options import DebugOpt, run_guarded
from launcher.errors import UsageError


def runs_command(
    name: Annotated[
        str | None,
        typer.Argument(metavar="NAME", help="Only the runs of this run.name.", show_default=False),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="A run spec: the runs of its run.name (unless NAME is given) under its "
            "run.output_dir.",
            show_default=False,
        ),
    ] = None,
    output_dir: Annotated[
        Path | None,
        typer.Option(
            help="The folder that holds the runs (run.output_dir).",
            show_default="runs",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON list of the runs, for scripts.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """List the runs under run.output_dir: status, steps, last and best loss, best evaluation,
    newest checkpoint, start and duration. A run is `running` while its launcher holds the run
    folder's lock; else `finished`, `failed` or `stopped` (Ctrl-C, SIGTERM, a preemption), as
    its launcher recorded at its end; or `interrupted` when it recorded none (its launcher was
    killed). Runs live in <run.output_dir>/<run.name>/<timestamp or rdzv-id>/."""

    def list_runs() -> int:
        from rich.console import Console

        from launcher.runs.catalog import describe_run, find_runs
        from launcher.runs.run_table import runs_json, runs_table

        folder, only = _where(name, config, output_dir)
        rows = [describe_run(run) for run in find_runs(folder, only)]
        if as_json:
            typer.echo(runs_json(rows))
        elif rows:
            # Piped or redirected: as wide as the table needs (not 80 columns), unless COLUMNS
            # says otherwise.
            wide = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 1000
            Console(highlight=False, width=wide).print(runs_table(rows))
        else:
            of = f" of {only!r}" if only else ""
            typer.echo(f"no runs{of} under {folder}", err=True)
        return 0

    run_guarded(list_runs, debug)


def _where(
    name: str | None, config: Path | None, output_dir: Path | None
) -> tuple[Path, str | None]:
    """The folder that holds the runs, and the run name to show only."""
    if config is not None:
        from launcher.config.loader import load_spec_and_sources

        spec = load_spec_and_sources(config, torch_checks=False)[0]
        folder = output_dir or Path(spec.run.output_dir)
        name = name or spec.run.name
    else:
        folder = output_dir or Path("runs")
    # Named on purpose: no such folder is a mistake; no `runs` where we are merely has none.
    if (config is not None or output_dir is not None) and not folder.is_dir():
        given = "--output-dir" if output_dir is not None else f"run.output_dir of {config}:"
        raise UsageError(f"{given} {folder}: no such folder")
    return folder, name
