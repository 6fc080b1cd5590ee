"""`train runs` and `train plot`: views of run folders that start nothing and never import
torch (each imports what it needs inside its body, once its arguments are parsed)."""

from __future__ import annotations

import os
import sys
from enum import Enum
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

    def go() -> int:
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

    run_guarded(go, debug)


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


class XAxis(str, Enum):
    step = "step"
    time = "time"


def plot_command(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR",
            help="Run folders, e.g. runs/NAME/TIMESTAMP: a curve for each metric of each.",
            show_default=False,
        ),
    ],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            help="A metric to draw (repeat it, or separate by commas), e.g. loss, val/loss, lr. "
            "Default: loss, and val/loss where a run has it.",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Write the figure to this file (.png, .svg or .pdf; needs matplotlib) instead "
            "of drawing it in the terminal (needs plotext).",
            show_default=False,
        ),
    ] = None,
    x: Annotated[
        XAxis, typer.Option(help="The x axis: the step, or the time since the run started.")
    ] = XAxis.step,
    debug: DebugOpt = False,
) -> None:
    """Draw the curves of one or several runs, from their metrics: into a PNG for a report
    (--out), or in the terminal. Metrics of one kind share a panel (loss with val/loss). Needs
    matplotlib (--out) or plotext (the terminal): pip install 'launcher\\[viz]'."""

    def go() -> int:
        from launcher.runs.plot import draw_in_terminal, load_panels, save_figure

        metrics = [m.strip() for given in metric or [] for m in given.split(",") if m.strip()]
        panels = load_panels(run_dirs, metrics, x.value)
        if out is not None:
            save_figure(panels, out, x.value)
            typer.echo(f"wrote {out}", err=True)
        else:
            draw_in_terminal(panels, x.value)
        return 0

    run_guarded(go, debug)
