"""What the CLI's commands share: the error console, the guard that turns a known failure into
one line and an exit code, and the options several commands take.

Nothing here imports torch: `train --help` and a bad flag answer in a fraction of a second.
"""

from __future__ import annotations

import gc
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from launcher.cli import interrupt
from launcher.errors import LauncherError
from launcher.launch.closed_output import LauncherConsole
from launcher.safe_text import clean

if TYPE_CHECKING:
    from launcher.config.spec import RunSpec

err = LauncherConsole(stderr=True, highlight=False, soft_wrap=True)


def run_guarded(fn: Callable[[], int], debug: bool) -> None:
    """Runs a command's body and exits with its code. Known failures print a short message;
    a traceback only with --debug.

    Python's cyclic garbage collector is paused meanwhile: importing torch creates half a
    million objects, and the full collections it triggers were a quarter of the time before a
    run starts its workers (issue 41), for almost no garbage. A run resumes it once it starts
    its workers (`launcher.launch.execute`); the other commands are short."""
    paused = gc.isenabled()
    gc.disable()
    try:
        code = interrupt.unwinding(fn)
    except LauncherError as exc:
        if debug:
            traceback.print_exc()
        # Clean: a message may quote a file's contents or a folder's name (escape codes too).
        err.print(Text("error: ", style="bold red") + Text(clean(exc.render())))
        code = exc.exit_code
    finally:
        if paused:
            gc.enable()
    raise typer.Exit(code)


def print_from_spec(
    config: Path, overrides: list[str] | None, debug: bool, text: Callable[[RunSpec], str]
) -> None:
    """The body of a command that prints a file made from the spec (`train slurm`, `train
    k8s`): the spec is loaded and its recipe checked first, so that a mistake is said here,
    not on the cluster."""

    def print_text() -> int:
        from launcher.cli.recipe_check import check_recipe
        from launcher.config.loader import load_cli_spec_and_sources

        spec, sources = load_cli_spec_and_sources(config, overrides)
        check_recipe(spec, sources)
        sys.stdout.write(text(spec))
        return 0

    run_guarded(print_text, debug)


def flag_help(key: str) -> str:
    """A flag's help: its spec key's own description, its one source of truth. `key`: a
    `launch.*` key's name, or a dotted key (`load.weights`)."""
    from launcher.config.spec import RunSpec

    section, _, name = key.rpartition(".")
    model = RunSpec.model_fields[section or "launch"].annotation
    return model.model_fields[name].description or ""  # type: ignore[union-attr]


ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="The run spec (YAML).")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="KEY=VALUE",
        help="Overrides of spec keys, e.g. optim.lr=3e-4 train.max_steps=500.",
        show_default=False,
    ),
]
DebugOpt = Annotated[bool, typer.Option(help="Show tracebacks.")]

# The flags that set `launch.*` keys: the run command's, and validate's (to check a spec as a
# run with these flags would see it).
AcceleratorOpt = Annotated[str | None, typer.Option(help=flag_help("accelerator"))]
DevicesOpt = Annotated[str | None, typer.Option(help=flag_help("devices"))]
StrategyOpt = Annotated[str | None, typer.Option(help=flag_help("strategy"))]
MaxRestartsOpt = Annotated[str | None, typer.Option(help=flag_help("max_restarts"))]
StallTimeoutOpt = Annotated[str | None, typer.Option(help=flag_help("stall_timeout"))]
LoadWeightsOpt = Annotated[
    str | None, typer.Option("--load-weights", metavar="PATH", help=flag_help("load.weights"))
]
StrictCompileOpt = Annotated[
    bool,
    typer.Option(
        "--strict-compile",
        help="XLA: stop the run when a new graph is compiled after warm-up "
        "(sets xla.strict_compile).",
    ),
]
