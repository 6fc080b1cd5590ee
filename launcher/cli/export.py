"""`train export`: write a checkpoint's model as one file plain PyTorch loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from launcher.cli.options import DebugOpt, run_guarded


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
    ema: Annotated[
        bool,
        typer.Option(
            "--ema",
            help="Export the weights' average (train.ema) instead of the trained weights.",
        ),
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Write a checkpoint's model as one file that plain PyTorch loads: the whole, unsharded
    state_dict, for any strategy and number of processes. Starts no processes."""

    def write_file() -> int:
        from launcher.checkpoint.export import export
        from launcher.safe_text import clean

        # Clean: it names the checkpoint's entries and its monitor, as its files spell them.
        typer.echo(clean(export(source, out, best=best, ema=ema).describe()))
        return 0

    run_guarded(write_file, debug)
