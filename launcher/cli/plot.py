"""`train plot`: draw runs' curves into a file or the terminal. Never imports torch."""

from __future__ import annotations

import shutil
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from launcher.cli.options import DebugOpt, run_guarded


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

    def draw() -> int:
        from launcher.runs.plot import FIGURE_COLUMNS, draw_in_terminal, load_panels, save_figure

        metrics = [m.strip() for given in metric or [] for m in given.split(",") if m.strip()]
        # Each curve cut down to what can be drawn: the figure's width, or the terminal's.
        width = FIGURE_COLUMNS if out is not None else shutil.get_terminal_size().columns
        panels = load_panels(run_dirs, metrics, x.value, width)
        if out is not None:
            save_figure(panels, out, x.value)
            typer.echo(f"wrote {out}")
        else:
            draw_in_terminal(panels, x.value)
        return 0

    run_guarded(draw, debug)
