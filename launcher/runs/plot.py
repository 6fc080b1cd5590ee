"""`train plot`: runs' curves from their metrics files, as a figure file (matplotlib) or in the
terminal (plotext). Both packages are optional and imported only here, when drawing; without
the one needed, the command says what to install (exit 2)."""

from __future__ import annotations

import importlib
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from launcher.errors import UsageError
from launcher.rundir.layout import RunLayout
from launcher.runs.catalog import is_run
from launcher.runs.metrics_file import metric_names, tail_records
from launcher.runs.metrics_scan import curves, downsample

# A figure file's size: FIGURE_WIDTH x PANEL_HEIGHT inches per panel, at DPI dots per inch.
FIGURE_WIDTH, PANEL_HEIGHT, DPI = 8.0, 3.0, 100
# Curves are cut down to this many columns in a figure file (a terminal: its width).
FIGURE_COLUMNS = round(FIGURE_WIDTH * DPI)
# What names the metrics a run has, when one asked for is missing: its newest records.
NAMES_TAIL_BYTES = 4 << 20
INSTALL = "pip install 'launcher[viz]'"
FORMATS = (".png", ".svg", ".pdf")


@dataclass
class Curve:
    label: str
    xs: list[float]
    ys: list[float]
    run: int = 0  # which of the runs: its colour in a figure file
    evaluation: bool = False  # a val/* metric: dashed
    # x of each NaN, infinity or value beyond DRAWABLE (a column's)
    not_finite: list[float] = field(default_factory=list)


@dataclass
class Panel:
    """The curves of one kind of metric: `loss` holds loss and val/loss."""

    title: str
    curves: list[Curve] = field(default_factory=list)


def load_panels(
    run_dirs: list[Path], metrics: list[str], x: str, width: int = FIGURE_COLUMNS
) -> list[Panel]:
    """The panels to draw, `width` columns wide: each metric of each run, grouped by kind.
    With no `metrics`: loss, and val/loss where a run has it. A metric that no run has is an
    error naming the ones they have."""
    for run in run_dirs:
        if not is_run(run):
            raise UsageError(
                f"{run}: not a run folder",
                hint="A run folder is <run.output_dir>/<run.name>/<timestamp>; `train runs` "
                "lists them.",
            )
    wanted = list(dict.fromkeys(metrics or ["loss", "val/loss"]))
    runs = {run: curves(RunLayout(run).metrics, wanted, x) for run in dict.fromkeys(run_dirs)}
    has = {metric for found in runs.values() for metric, (xs, _) in found.items() if len(xs)}
    wanted = wanted if metrics else ["loss", *(["val/loss"] if "val/loss" in has else [])]
    for metric in wanted:
        if metric not in has:
            available = metric_names(
                [r for run in runs for r in tail_records(RunLayout(run).metrics, NAMES_TAIL_BYTES)]
            )
            raise UsageError(
                f"{'--metric ' if metrics else ''}{metric}: no such metric in "
                + (str(run_dirs[0]) if len(runs) == 1 else f"any of the {len(runs)} runs"),
                hint=f"Available: {', '.join(available) or 'none (no metrics recorded yet)'}.",
            )
    panels: dict[str, Panel] = {}
    for metric in wanted:
        kind = metric.removeprefix("val/")
        panel = panels.setdefault(kind, Panel(kind))
        for index, (run, found) in enumerate(runs.items()):
            xs, ys, not_finite = downsample(*found[metric], width)
            if len(xs) or len(not_finite):
                name = f"{run.parent.name}/{run.name} " if len(runs) > 1 else ""
                curve = Curve(name + metric, xs.tolist(), ys.tolist(), index)
                curve.evaluation, curve.not_finite = metric.startswith("val/"), not_finite.tolist()
                panel.curves.append(curve)
    return list(panels.values())


def save_figure(panels: list[Panel], out: Path, x: str) -> None:
    """The panels, one above the other, into `out` (its suffix says the format): a figure of
    FIGURE_WIDTH x PANEL_HEIGHT * panels inches at DPI."""
    if out.suffix.lower() not in FORMATS:
        raise UsageError(f"--out {out}: expected a {', '.join(FORMATS)} file")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: no folder {out.parent}")
    # The Figure API, not pyplot: no GUI backend, no global state; files are drawn by Agg.
    figure_module = _optional("matplotlib.figure", "matplotlib")
    fig = figure_module.Figure(
        figsize=(FIGURE_WIDTH, PANEL_HEIGHT * len(panels)), dpi=DPI, layout="constrained"
    )
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    scale, unit = _time_scale(panels) if x == "time" else (1.0, "")
    for ax, panel in zip(axes, panels, strict=True):
        for curve in panel.curves:
            xs = [v / scale for v in curve.xs]
            # Points marked where they are few (evaluations), so that each one shows.
            marker = "o" if len(xs) <= 30 else None
            style = "--" if curve.evaluation else "-"
            ax.plot(
                xs, curve.ys, f"C{curve.run}{style}", label=curve.label, marker=marker, markersize=3
            )
            if curve.not_finite:  # a NaN or infinity has no height: a line across the panel
                ax.vlines(
                    [v / scale for v in curve.not_finite], 0, 1, colors=f"C{curve.run}",
                    linestyles=":", transform=ax.get_xaxis_transform(),
                    label=f"{curve.label} not finite",
                )  # fmt: skip
        ax.set_title(panel.title)
        ax.set_xlabel(f"time ({unit})" if x == "time" else "step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    try:
        fig.savefig(out, dpi=DPI)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write it ({exc.strerror})") from None


def draw_in_terminal(panels: list[Panel], x: str) -> None:
    """The panels, one above the other, as wide as the terminal (plotext 5 or 6)."""
    plt = _optional("plotext", "plotext")
    columns, lines = shutil.get_terminal_size()
    height = max(12, min(24, (lines - 1) // len(panels)))
    scale, unit = _time_scale(panels) if x == "time" else (1.0, "")
    x_label = f"time ({unit})" if x == "time" else "step"
    draw = _draw_v6 if hasattr(getattr(plt, "figure", None), "signal") else _draw_v5
    text = draw(plt, panels, (columns, height * len(panels)), x_label, scale)
    sys.stdout.write((text if sys.stdout.isatty() else plt.uncolorize(text)) + "\n")
    for curve in (c for panel in panels for c in panel.curves if c.not_finite):
        shown = ", ".join(f"{v / scale:g}" for v in curve.not_finite[:5])
        more = f" and {len(curve.not_finite) - 5} more" if len(curve.not_finite) > 5 else ""
        sys.stdout.write(
            f"{curve.label}: not finite (NaN, infinite or beyond ±1e300) at {x_label} "
            f"{shown}{more}\n"
        )


def _draw_v6(
    plt: Any, panels: list[Panel], size: tuple[int, int], x_label: str, scale: float
) -> str:
    # plotext 6: an explicit figure, whose signals are drawn into subplots.
    fig = plt.figure
    fig.clear()
    if len(panels) > 1:  # a 1 x 1 grid has no subplot: the figure is the plot
        fig.subplots(len(panels), 1)
    fig.plot_size(*size)
    for row, panel in enumerate(panels, start=1):
        sub = fig.subplot(row, 1) if len(panels) > 1 else fig
        for curve in panel.curves:
            signal = sub.signal([v / scale for v in curve.xs], curve.ys)
            signal.label(curve.label)
            signal.lines()
            sub.draw(signal)
        sub.title(panel.title)
        sub.label(x_label, axis=0)
    return fig.build().string()


def _draw_v5(
    plt: Any, panels: list[Panel], size: tuple[int, int], x_label: str, scale: float
) -> str:
    # plotext 5: matplotlib-like functions on one global figure.
    plt.clf()
    plt.subplots(len(panels), 1)
    plt.plotsize(*size)
    for row, panel in enumerate(panels, start=1):
        plt.subplot(row, 1)
        for curve in panel.curves:
            plt.plot([v / scale for v in curve.xs], curve.ys, label=curve.label)
        plt.title(panel.title)
        plt.xlabel(x_label)
    return plt.build()


def _time_scale(panels: list[Panel]) -> tuple[float, str]:
    """Seconds, minutes or hours, by the longest run."""
    longest = max((max(c.xs) for p in panels for c in p.curves if c.xs), default=0.0)
    return (3600.0, "h") if longest > 3 * 3600 else (60.0, "min") if longest > 180 else (1.0, "s")


def _optional(module: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"train plot {'--out' if package == 'matplotlib' else '(in the terminal)'} needs "
            f"{package}, which is not installed",
            hint=f"Install it: {INSTALL} (or pip install {package}).",
        ) from None
