"""`train runs`: the table of runs under a folder. Starts nothing and never imports torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from launcher.cli.options import DebugOpt, run_guarded
from launcher.errors import UsageError
from launcher.launch.closed_output import LauncherConsole


def runs_command(
    targets: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="NAME|PATH",
            help="A run.name: only its runs. Or a PATH: a run folder (one written with "
            "--run-dir, say) or a folder that holds runs (runs/, runs/NAME/), listed instead of "
            "run.output_dir's. An argument that is an existing folder is a PATH; any other, a "
            "NAME.",
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="A run spec: the runs of its run.name (unless NAME is given) under its "
            "run.output_dir (or in the PATHs given).",
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
    """List the runs under run.output_dir, or in the folders named: status, steps, last and
    best loss, best evaluation, newest checkpoint, start and duration. A run is `running` while
    its launcher holds the run folder's lock; else `finished`, `failed` or `stopped` (Ctrl-C,
    SIGTERM, a preemption), as its launcher recorded at its end; or `interrupted` when it
    recorded none (its launcher was killed). Runs live in <run.output_dir>/<run.name>/<timestamp
    or rdzv-id>/, or where --run-dir put them."""

    def list_runs() -> int:
        from launcher.runs.catalog import describe_runs, find_runs, find_runs_in
        from launcher.runs.run_table import runs_json, runs_table, unlisted_stores

        paths, names = _paths_and_names(targets or [])
        if paths and output_dir is not None:
            raise UsageError("--output-dir and a PATH: give the folders to list one way")
        folder, names = _where(names, config, output_dir, listed=not paths)
        if paths:
            rows = describe_runs(find_runs_in(paths))
            rows = [row for row in rows if not names or row.name in names]
        else:
            rows = describe_runs(find_runs(folder, names))
        if as_json:
            typer.echo(runs_json(rows))
        elif rows:
            # Piped or redirected: as wide as the table needs (not 80 columns), unless COLUMNS
            # says otherwise.
            wide = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 1000
            console = LauncherConsole(highlight=False, width=wide)
            console.print(runs_table(rows))
            for line in unlisted_stores(rows):  # what a `?` checkpoint stands for
                console.print(line)
        else:
            of = f" of {', '.join(map(repr, names))}" if names else ""
            under = ", ".join(map(str, paths or [folder]))
            typer.echo(f"no runs{of} under {under}", err=True)
        return 0

    run_guarded(list_runs, debug)


def _paths_and_names(targets: list[str]) -> tuple[list[Path], list[str]]:
    """The folders named, and the run names: an argument that is a folder is a PATH, any
    other a NAME (a run.name has no `/`, so one with a `/` that is no folder is a mistake)."""
    paths, names = [], []
    for target in targets:
        if Path(target).is_dir():
            paths.append(Path(target))
        elif "/" in target:
            raise UsageError(f"{target}: no such folder")
        else:
            names.append(target)
    return paths, names


def _where(
    names: list[str], config: Path | None, output_dir: Path | None, listed: bool
) -> tuple[Path, list[str]]:
    """The folder that holds the runs, and the run names to show only. `listed`: whether
    that folder is the one listed (no PATH given)."""
    if config is not None:
        from launcher.config.loader import load_spec_and_sources

        spec = load_spec_and_sources(config, torch_checks=False)[0]
        folder = output_dir or Path(spec.run.output_dir)
        names = names or [spec.run.name]
    else:
        folder = output_dir or Path("runs")
    # Named on purpose: no such folder is a mistake; no `runs` where we are merely has none.
    if listed and (config is not None or output_dir is not None) and not folder.is_dir():
        given = "--output-dir" if output_dir is not None else f"run.output_dir of {config}:"
        raise UsageError(f"{given} {folder}: no such folder")
    return folder, names
